"""The `vlforge` subcommands, one module per family: train.py (sft, grpo, demo, export), data.py
(data synth / check / convert), inference.py (infer, chat, eval, serve), inspection.py (view, doctor).
Each module lists its commands in COMMANDS; cli.py builds the parser from them."""
