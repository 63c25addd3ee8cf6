"""The `vlforge` command: parses arguments, loads a typed config, calls one recipe function."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
from pathlib import Path

from vlforge.config import ConfigError, GRPOConfig, SFTConfig, dump_config, load_config
from vlforge.data.jsonl import DataError
from vlforge.engine.errors import CheckpointWriteError
from vlforge.engine.health import TrainingDiverged
from vlforge.engine.stop import signal_name, sigterm_interrupts
from vlforge.rl.rewards import RewardError


def _quiet_libraries() -> None:
    import logging

    # torch warns at import of optional libraries built for another torch (torchao's enum
    # registrations): noise for a CLI user, nothing to act on
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    from vlforge.model.quiet import offline_and_quiet

    offline_and_quiet()  # before any command imports bitsandbytes (doctor does, to report it)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def _print_plan(cfg, as_json: bool, world_size: int) -> None:
    """`--plan`: what trains (tiers, ranks, lrs, parameter counts), in which precision, and the
    per-process memory on `world_size` processes, from a meta-device model (no weights: works for
    32B on a laptop)."""
    from vlforge.engine.memory import format_memory, memory_estimate
    from vlforge.engine.precision import format_precision_plan, precision_plan
    from vlforge.model.load import build_meta_model
    from vlforge.model.tiers import build_plan, format_plan, plan_summary

    model, _ = build_meta_model(cfg.model)
    plan = build_plan(model, cfg.tiers)
    summary = {**plan_summary(model, plan), "precision": precision_plan(model, plan, cfg.precision, cfg.quant),
               "memory": memory_estimate(model, plan, cfg, world_size)}
    print(json.dumps(summary, indent=2) if as_json
          else "\n\n".join((format_plan(summary), format_precision_plan(summary["precision"]),
                             format_memory(summary["memory"]))))


def _plan_world_size(args) -> int:
    """--world-size, else torchrun's WORLD_SIZE, else 1."""
    if args.world_size is not None:
        return args.world_size
    text = os.environ.get("WORLD_SIZE", "1")
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(f"WORLD_SIZE={text!r} in the environment is not a process count; pass --world-size N")
    return int(text)


def _recipe_config(cls, args):
    """The recipe's config; handles --print-config and --plan. None when the command is done."""
    if args.json and not args.plan:
        raise ConfigError("--json goes with --plan (vlforge %s CONFIG --plan --json)" % args.command)
    if args.world_size is not None and not args.plan:
        raise ConfigError("--world-size goes with --plan (vlforge %s CONFIG --plan --world-size 8); torchrun "
                          "sets the processes of a run" % args.command)
    cfg = load_config(cls, args.config, args.overrides)
    if args.print_config:
        print(dump_config(cfg), end="")
        return None
    if args.plan:
        _print_plan(cfg, args.json, _plan_world_size(args))
        return None
    return cfg


def cmd_sft(args) -> int:
    if (cfg := _recipe_config(SFTConfig, args)) is None:
        return 0
    from vlforge.recipes.sft import run_sft

    result = run_sft(cfg)
    if not _main_process():
        return 0
    if result["eval"]:
        print(f"eval at step {result['final_step']}: loss {result['eval']['loss']:.4f} "
              f"accuracy {result['eval']['accuracy']:.3f} (n={result['eval']['n']})")
    print(f"outputs in {result['output_dir']}")
    return 0


def cmd_grpo(args) -> int:
    if (cfg := _recipe_config(GRPOConfig, args)) is None:
        return 0
    from vlforge.recipes.grpo import run_grpo

    result = run_grpo(cfg)
    if not _main_process():
        return 0
    if result["eval"]:
        print(f"eval at step {result['final_step']}: accuracy {result['eval']['accuracy']:.3f} (n={result['eval']['n']})")
    print(f"outputs in {result['output_dir']}")
    return 0


def cmd_demo(args) -> int:
    from vlforge.demo import run_demo

    run_demo(args.out, args.overwrite, args.overrides)
    return 0


def cmd_data_synth(args) -> int:
    from vlforge.data.synth import synth_motion, synth_shapes, synth_tool_use, synth_zoom

    if args.kind == "motion":
        paths = synth_motion(args.out, args.n, seed=args.seed, val_fraction=args.val_fraction, size=args.size)
        print(f"wrote {paths['train']} and {paths['val']} (videos as frame lists: which way does the shape move?)")
        return 0
    if args.kind == "tools":
        paths = synth_tool_use(args.out, args.n, seed=args.seed, size=args.size)
        print(f"wrote {paths['sft']} (tool-use conversations, for SFT) and {paths['prompts']} (prompts and answers, "
              "for GRPO with tools.names=[calculator])")
        return 0
    if args.kind == "zoom":
        paths = synth_zoom(args.out, args.n, seed=args.seed, size=args.size)
        print(f"wrote {paths['sft']} (zoom_in conversations, for SFT) and {paths['prompts']} (prompts and answers, "
              "for GRPO with tools.names=[zoom_in])")
        return 0
    tasks = tuple(t.strip() for t in args.tasks.split(",")) if args.tasks else None
    kwargs = {"tasks": tasks} if tasks else {}
    paths = synth_shapes(args.out, args.n, seed=args.seed, val_fraction=args.val_fraction, size=args.size, **kwargs)
    print(f"wrote {paths['train']} and {paths['val']}")
    return 0


def cmd_data_check(args) -> int:
    from vlforge.data.check import check_file, format_check
    from vlforge.model.load import load_processor

    cfg = load_config(SFTConfig, args.config, args.overrides)
    if not cfg.model.path and not cfg.model.preset:
        cfg.model.preset = "tiny"  # token counts then use the tiny tokenizer; pass a config for exact ones
    report = check_file(args.file, load_processor(cfg.model), cfg.data)
    print(json.dumps(report, indent=2) if args.json else format_check(report))
    return 1 if report["errors"] else 0


def cmd_data_convert(args) -> int:
    from vlforge.data.convert import convert

    cfg = load_config(SFTConfig, args.config, args.overrides)  # data.format, data.columns, the image limits
    report = convert(args.src, args.out, cfg.data, cfg.data.on_error)
    skipped = sum(report.skipped.values())
    print(f"wrote {args.out}: {report.kept} of {report.rows} rows" + (f" ({skipped} skipped: "
          f"{dict(report.skipped)})" if skipped else ""))
    for e in report.first_errors:
        print("  " + e)
    return 0


def cmd_view(args) -> int:
    from vlforge.view.app import command  # the viewer (docs/view.md)

    return command(args.runs, args.host, args.port, args.export)


def cmd_doctor(args) -> int:
    from vlforge.config import load_recipe_config
    from vlforge.doctor import format_report, run_checks

    cfg = load_recipe_config(args.config, args.overrides) if args.config or args.overrides else None
    report = run_checks(cfg, config_path=args.config)
    if not _main_process():  # under torchrun: rank 0 prints the report, the others only what fails on them
        for c in report["checks"]:
            if c["status"] == "fail":
                print(f"{_rank_prefix()}[FAIL] {c['name']}: {c['detail']}", file=sys.stderr)
    else:
        print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0 if report["ok"] else 1


def _engine(args, slots: int = 1):
    """The loaded InferenceEngine; with --compile its decode step is compiled and warmed now, at
    `slots` decode slots (the batch its command generates: serve's --max-batch, eval's --batch-size)."""
    from vlforge.config import QuantConfig
    from vlforge.serve.engine import InferenceEngine

    quant = None if args.quant is None else QuantConfig.from_flag(args.quant)  # None: a QLoRA checkpoint's own
    if args.min_pixels is not None and args.max_pixels is not None and args.min_pixels > args.max_pixels:
        raise ConfigError(f"--min-pixels {args.min_pixels} is above --max-pixels {args.max_pixels}")  # before loading
    engine = InferenceEngine.load(args.source, quant=quant, device=args.device, min_pixels=args.min_pixels,
                                  max_pixels=args.max_pixels, engine=getattr(args, "engine", "vlforge"),
                                  compile=args.compile)
    if engine.quant_report:
        from vlforge.model.quant import format_report

        print(format_report(engine.quant_report), file=sys.stderr)
    if args.compile:
        if problem := engine.compile_problem():
            print(f"--compile: not applied ({problem}); decoding eager", file=sys.stderr)
        else:
            print("--compile: compiling the decode step (a minute or two; once per process) ...", file=sys.stderr,
                  flush=True)
            seconds = engine.warm_up(slots)
            if failure := engine.gen_engine().compile_failure:  # _compiled_once warned and runs eager
                print(f"--compile: the decode step did not compile ({failure}); decoding eager", file=sys.stderr)
            else:
                print(f"--compile: decode step compiled and warmed in {seconds:.0f} s", file=sys.stderr)
    return engine


def cmd_export(args) -> int:
    from vlforge.config import QuantConfig
    from vlforge.engine.hardware import quant_problem
    from vlforge.engine.runtime import resolve_device
    from vlforge.model.export import export
    from vlforge.model.load import DTYPES

    quant, device = QuantConfig.from_flag(args.quant), resolve_device(args.device, "--device")
    if problem := quant_problem(quant, device):
        raise ConfigError(f"--quant {args.quant}: {problem}")
    result = export(args.checkpoint, args.out, merge=args.merge, quant=quant, dtype=DTYPES[args.dtype],
                    overwrite=args.overwrite, device=device)
    print(f"exported {result['kind']} model (quant {result['quant']}) to {result['out']}: {', '.join(result['files'])}")
    return 0


def cmd_infer(args) -> int:
    from vlforge.recipes.infer import answer

    engine = _engine(args)
    text = answer(engine, args.prompt, args.image or [], max_new_tokens=args.max_new_tokens, task=args.task,
                  temperature=args.temperature, on_text=lambda text: print(text, end="", flush=True),
                  video_paths=args.video or [])
    print()
    if not text.strip():  # an empty line alone looks like a broken command
        print("(the model produced no text before its end-of-turn token; a barely trained checkpoint often "
              "does this)", file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    from vlforge.recipes.infer import chat

    chat(_engine(args), stream=lambda text: print(text, end="", flush=True), max_new_tokens=args.max_new_tokens)
    return 0


def _grpo_run(source: str):
    """The GRPO run config `--rewards-from` names: a run's config YAML, or one of its checkpoints."""
    from vlforge.config import load_recipe_config
    from vlforge.model.export import run_config

    path = Path(source)
    if not path.exists():
        raise ConfigError(f"--rewards-from {source}: no such file or directory (a GRPO config YAML or checkpoint)")
    run = run_config(path) if path.is_dir() else load_recipe_config(path)
    if not isinstance(run, GRPOConfig):
        raise ConfigError(f"--rewards-from {source}: an SFT run, which has no rl.rewards; name a GRPO run's config "
                          "or checkpoint, or give --reward specs")
    return run


def cmd_eval(args) -> int:
    from vlforge.config import ToolsConfig
    from vlforge.engine.metrics import check_writable, write_json_atomic
    from vlforge.config import DataConfig
    from vlforge.data.sources import check_readable
    from vlforge.recipes.infer import evaluate_dataset
    from vlforge.rl.rewards import RewardSpec

    if args.out:
        check_writable(args.out, "--out")  # before the model loads and every answer is computed
    columns = dict(c.partition("=")[::2] for c in args.column)
    if bad := [c for c in args.column if "=" not in c or not all(c.partition("=")[::2])]:
        raise ConfigError(f"--column {bad[0]}: give FIELD=NAME, e.g. --column prompt=problem")
    check_readable(args.data, cfg=DataConfig(columns=columns))  # any format training reads; before the model loads
    rewards = tools = None
    reward_specs, tool_specs, flag = args.reward, args.tool, "--reward"
    settings = ToolsConfig()  # the tools section: its defaults, or the run's; the flags given override
    max_new_tokens = args.max_new_tokens or 16
    if args.rewards_from:  # the GRPO run's rewards and tools, as its own evaluation scores and answers
        if args.reward or args.tool:
            raise ConfigError("--rewards-from takes the run's rl.rewards and tools.names: leave out --reward and "
                              "--tool (or use those alone)")
        run = _grpo_run(args.rewards_from)
        reward_specs = [RewardSpec(r.name, r.weight, dict(r.kwargs)) for r in run.rl.rewards]
        tool_specs, flag, settings = run.tools.names, f"--rewards-from {args.rewards_from}", run.tools
        # GRPO's evaluation: rollout.max_new_tokens for a conversation with tools, eval.max_new_tokens otherwise
        max_new_tokens = args.max_new_tokens or (run.rollout.max_new_tokens if tool_specs else run.eval.max_new_tokens)
    given = {"turns": args.tool_turns, "processes": args.tool_processes}
    settings = dataclasses.replace(settings, **{k: v for k, v in given.items() if v is not None})
    if tool_specs:  # loaded before the model, as GRPO's tools.names
        from vlforge.rl.tools import load_tools

        try:
            tools = load_tools(tool_specs)
        except ValueError as e:
            raise ConfigError(f"{'--tool' if args.tool else flag}: {e}") from e
    if reward_specs:  # loaded before the model: a typo fails at once
        from vlforge.rl.rewards import build_rewards
        from vlforge.serve.judge import ModelJudge

        try:  # a judge reward (serve/judge.py) as GRPO builds it; its model loads at first use, on --device
            rewards = build_rewards(reward_specs, factories={"judge": ModelJudge.from_kwargs})
        except (ValueError, FileNotFoundError, AttributeError, TypeError, ImportError) as e:
            raise ConfigError(f"{flag}: {e}") from e
        for fn in rewards.fns:
            if isinstance(fn, ModelJudge) and fn.device == "auto":
                fn.device = args.device
    engine = _engine(args, slots=args.batch_size)
    if tools:
        from vlforge.rollout.multiturn import check_tool_template

        check_tool_template(engine.encoder, "--tool" if args.tool else flag)  # the chat template renders a tool turn
    report = evaluate_dataset(engine, args.data, batch_size=args.batch_size, max_new_tokens=max_new_tokens,
                              max_samples=args.max_samples, rewards=rewards, tools=tools, tool_settings=settings,
                              data=DataConfig(columns=columns))
    if args.out:
        write_json_atomic(report, args.out)
    tasks = " ".join(f"{k} {v:.3f}" for k, v in report["by_task"].items())
    scores = "".join(f"; {k} {v:.3f}" for k, v in report.get("rewards", {}).items())
    if "tool_calls_mean" in report:
        scores += f"; {report['tool_calls_mean']:.2f} tool calls an answer"
    print(f"accuracy {report['accuracy']:.3f} (n={report['n']}; {tasks}){scores}"
          + (f"; answers in {args.out}" if args.out else ""))
    return 0


def cmd_serve(args) -> int:
    try:
        from vlforge.serve.app import create_app, require_uvicorn, serve  # fastapi, prometheus_client
        from vlforge.serve.config import ServeConfig
    except ImportError as e:
        raise ConfigError(f"vlforge serve needs fastapi, uvicorn and prometheus_client ({e.name} is missing): "
                          "pip install 'vlforge[serve]'") from None
    require_uvicorn()  # app.py imports it only where the server runs: say it is missing before the model loads
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port {args.port}: must be 0..65535")
    cfg = ServeConfig.from_flags(vars(args), environ=os.environ)  # checked before the model loads
    app = create_app(_engine(args, slots=cfg.max_batch), cfg)
    name = app.state.vlforge.model_name
    if args.host not in ("127.0.0.1", "localhost", "::1") and cfg.api_key is None:
        print(f"warning: listening on {args.host} without authentication; anyone who can reach the port can use "
              "the model (set VLFORGE_API_KEY, or put a proxy with auth in front)", file=sys.stderr)
    print(f"serving {name!r} on http://{args.host}:{args.port}/v1 (POST /v1/chat/completions, GET /v1/models, "
          f"GET /health, GET /metrics); local image files: {cfg.allow_files or 'not allowed'}; API key: "
          f"{'required' if cfg.api_key else 'none'}", flush=True)
    stopped = serve(app, host=args.host, port=args.port)  # uvicorn, draining on shutdown
    if stopped is None:
        return 0
    print(f"vlforge serve: stopped by {signal_name(stopped)} (accepted requests were given up to --drain-timeout "
          "to finish)", file=sys.stderr)
    return 128 + stopped


def _at_least(minimum: int):
    """An argparse type: a whole number >= minimum (a bad value is argparse's usage error, exit 2)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value}: must be >= {minimum}")
        return value

    return parse


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text}: must be a finite number >= 0")
    return value


def _model_source_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", help="model directory (export output, full checkpoint, released weights), "
                                  "a LoRA checkpoint-STEP directory, or the preset 'tiny'")
    p.add_argument("--quant", choices=["none", "nf4", "int8", "fp8"],
                   help="quantize the language model at load (vision tower and projector stay bf16); default "
                        "none, except a QLoRA checkpoint, which loads on its run's quantized base")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--engine", choices=["vlforge", "hf"], default="vlforge",
                   help="generation: vlforge = generate/'s engine (continuous batching, as GRPO rollouts); hf = "
                        "transformers generate, requests batched by sampling settings (the old path, for comparison)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile generate/'s decode step (CUDA, unquantized; 1.9x faster decode steps for 64 "
                        "rows of the 2B on an H200) "
                        "and warm it up at start-up, which takes a minute or two; worth it for serve, chat and "
                        "long evals")
    p.add_argument("--min-pixels", type=_at_least(1), help="images smaller than this (width x height) are "
                                                           "upscaled; default: the model's preprocessor config")
    p.add_argument("--max-pixels", type=_at_least(1), help="images larger than this are downscaled; default: the "
                                                           "model's preprocessor config")


def _recipe_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--plan", action="store_true", help="print the trainable, precision and memory plan and exit (no training)")
    p.add_argument("--json", action="store_true", help="with --plan: print JSON")
    p.add_argument("--world-size", type=_at_least(1), metavar="N",
                   help="with --plan: estimate memory per process for N processes (default: WORLD_SIZE or 1)")
    p.add_argument("--print-config", action="store_true", help="print the effective config and exit")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vlforge", description="Fine-tune, RL-train and serve Qwen3-VL models.")
    sub = p.add_subparsers(dest="command", required=True)

    sft = sub.add_parser("sft", help="supervised fine-tuning (LoRA tiers or full)")
    sft.add_argument("config", help="recipe YAML, e.g. configs/qwen3vl-8b-lora.yaml")
    sft.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. tiers.language.lr=1e-4")
    _recipe_options(sft)
    sft.set_defaults(func=cmd_sft)

    grpo = sub.add_parser("grpo", help="GRPO reinforcement learning with verifiable rewards")
    grpo.add_argument("config", help="recipe YAML, e.g. configs/qwen3vl-8b-grpo.yaml")
    grpo.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. rollout.group_size=8")
    _recipe_options(grpo)
    grpo.set_defaults(func=cmd_grpo)

    demo = sub.add_parser("demo", help="synthesise data, train the tiny model on CPU, show before/after")
    demo.add_argument("--out", help="output folder (default: ./vlforge-demo, or the next free vlforge-demo-N)")
    demo.add_argument("--overwrite", action="store_true", help="replace a non-empty --out folder")
    demo.add_argument("overrides", nargs="*", help="overrides of the demo SFT recipe, e.g. train.max_steps=50")
    demo.set_defaults(func=cmd_demo)

    data = sub.add_parser("data", help="dataset tools").add_subparsers(dest="data_command", required=True)
    synth = data.add_parser("synth", help="generate a synthetic dataset")
    synth.add_argument("kind", choices=["shapes", "tools", "motion", "zoom"],
                       help="shapes: questions about coloured shapes; tools: count the shapes, multiply with the "
                            "calculator tool (SFT conversations + GRPO prompts); motion: videos (frame lists) of a "
                            "shape moving left or right, for SFT; zoom: the colour of a small shape, seen through "
                            "the zoom_in tool (SFT conversations + GRPO prompts; images 4x --size; tools and zoom "
                            "write no val split)")
    synth.add_argument("--n", type=int, required=True, help="number of samples (train + val)")
    synth.add_argument("--out", required=True, help="output folder")
    synth.add_argument("--seed", type=int, default=0)
    synth.add_argument("--val-fraction", type=float, default=0.1)
    synth.add_argument("--size", type=int, default=64, help="image side in pixels")
    synth.add_argument("--tasks", help="comma-separated subset of colour,shape,position,count")
    synth.set_defaults(func=cmd_data_synth)
    check = data.add_parser("check", help="validate a dataset (any format docs/data.md lists) and report token lengths")
    check.add_argument("file")
    check.add_argument("--config", help="recipe YAML whose model/tokenizer and data limits to use")
    check.add_argument("--json", action="store_true")
    check.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. data.max_length=4096")
    check.set_defaults(func=cmd_data_check)
    conv = data.add_parser("convert", help="write a dataset (ShareGPT/LLaVA, OpenAI messages, parquet, a datasets "
                                           "folder) as native JSONL, embedded images as files (docs/data.md)")
    conv.add_argument("src", help="the dataset: a .jsonl / .json / .parquet file or a folder")
    conv.add_argument("out", help="the JSONL file to write (new); images go to <name>-images/ beside it")
    conv.add_argument("--config", help="recipe YAML whose data settings (format, columns, limits) to use")
    conv.add_argument("overrides", nargs="*", help="e.g. data.columns.prompt=problem data.on_error=skip")
    conv.set_defaults(func=cmd_data_convert)

    exp = sub.add_parser("export", help="write a checkpoint as a standard HF model directory")
    exp.add_argument("checkpoint", help="runs/NAME/checkpoint-STEP")
    exp.add_argument("--out", required=True, help="output directory")
    exp.add_argument("--merge", action="store_true", help="merge LoRA into the base weights (else: adapter only)")
    exp.add_argument("--quant", choices=["none", "nf4", "int8", "fp8"], default="none",
                     help="also quantize the language model of the written directory")
    exp.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16", help="dtype of the merged weights")
    exp.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    exp.add_argument("--device", default="auto", help="where quantization runs: auto (a GPU if visible) | cpu | cuda | cuda:N")
    exp.set_defaults(func=cmd_export)

    infer = sub.add_parser("infer", help="answer one prompt (with images or videos) from a model")
    _model_source_args(infer)
    infer.add_argument("--image", action="append", help="image file (repeat for several)")
    infer.add_argument("--video", action="append", help="video file (PyAV: the `video` extra; repeat for several)")
    infer.add_argument("--prompt", required=True)
    infer.add_argument("--task", choices=["classify", "qa", "describe"], default="qa",
                       help="sets the default --max-new-tokens: 16 / 64 / 512")
    infer.add_argument("--max-new-tokens", type=_at_least(1))
    infer.add_argument("--temperature", type=_non_negative_float, default=0.0, help="0 = greedy")
    infer.set_defaults(func=cmd_infer)

    chat = sub.add_parser("chat", help="interactive chat with a model (/image PATH, /video PATH, /reset, /quit)")
    _model_source_args(chat)
    chat.add_argument("--max-new-tokens", type=_at_least(1), default=512)
    chat.set_defaults(func=cmd_chat)

    ev = sub.add_parser("eval", help="batched greedy answers + exact-match accuracy on a dataset")
    _model_source_args(ev)
    ev.add_argument("--data", required=True, help="a dataset with reference answers, in any format training reads "
                    "(JSONL, ShareGPT/LLaVA, OpenAI messages, parquet, a datasets folder: docs/data-formats.md)")
    ev.add_argument("--column", action="append", default=[], metavar="FIELD=NAME",
                    help="the dataset's column for FIELD (prompt, answer, images, ...), as data.columns; repeatable")
    ev.add_argument("--batch-size", type=_at_least(1), default=16)
    ev.add_argument("--max-new-tokens", type=_at_least(1),
                    help="default 16; with --rewards-from, the run's (rollout.max_new_tokens with tools, "
                         "else eval.max_new_tokens)")
    ev.add_argument("--max-samples", type=_at_least(1), help="only the first N rows")
    ev.add_argument("--out", help="write the report with every answer to this JSON file")
    ev.add_argument("--reward", action="append", default=[], metavar="SPEC",
                    help="also score each answer with this reward function, as GRPO's rl.rewards (a builtin: "
                         "exact_match, choice, numeric, format; or path/to/file.py:function); repeatable: "
                         "the report gives each one's mean")
    ev.add_argument("--tool", action="append", default=[], metavar="SPEC",
                    help="answer each prompt as a conversation with this tool, as GRPO's tools.names (a builtin: "
                         "calculator; or path/to/file.py:function); repeatable; --max-new-tokens is then the whole "
                         "response's budget, the answer its last assistant turn")
    ev.add_argument("--tool-turns", type=_at_least(1),
                    help="assistant turns whose calls run, at most (default 4; with --rewards-from, the run's)")
    ev.add_argument("--tool-processes", type=_at_least(0),
                    help="0 (default): tool calls on threads; N: in up to N worker processes (tools.processes; "
                         "with --rewards-from, the run's unless given)")
    ev.add_argument("--rewards-from", metavar="RUN",
                    help="score with a GRPO run's rl.rewards (names, weights, kwargs) and answer with its "
                         "tools.names and tool settings, as its own evaluation does: the run's config YAML or "
                         "one of its checkpoints")
    ev.set_defaults(func=cmd_eval)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat completions, streaming, batching)")
    _model_source_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000)
    from vlforge.serve.config import ServeConfig  # no fastapi needed: the flags and defaults are the config's

    for f in ServeConfig.flags():
        unit, meta = f.metadata.get("unit", 1), f.metadata
        if f.default is None:  # an optional setting: a string, or an int (its annotation is a string: __future__)
            serve.add_argument(meta["flag"], dest=f.name, metavar=meta.get("metavar"), help=meta["help"],
                               type=int if str(f.type).startswith("int") else None)
        else:
            default = f.default / unit if unit != 1 else f.default
            serve.add_argument(meta["flag"], dest=f.name, type=float if unit != 1 or f.type == "float" else int,
                               default=default,
                               metavar=meta["flag"].lstrip("-").upper().replace("-", "_"),
                               help=f"{meta['help']} (default {default:g})" if unit != 1 else
                               f"{meta['help']} (default {default})")
    serve.set_defaults(func=cmd_serve)

    view = sub.add_parser("view", help="a local page of runs: curves, GRPO rollouts, eval answers (or --export HTML)")
    view.add_argument("runs", nargs="+", metavar="RUN_DIR", help="a run's train.output_dir, or a folder of runs")
    view.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    view.add_argument("--port", type=int, default=8600)
    view.add_argument("--export", metavar="HTML", help="write one self-contained HTML file instead of serving")
    view.set_defaults(func=cmd_view)

    doctor = sub.add_parser("doctor", help="check Python, torch, GPUs and libraries (and what a recipe needs)")
    doctor.add_argument("--config", help="recipe YAML: also check what it needs (device, bf16, FP8, flash-attn, model.path, "
                             "optimizer, distributed)")
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    doctor.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. precision.fp8.enabled=true")
    doctor.set_defaults(func=cmd_doctor)
    return p


def _rank_prefix() -> str:
    """Under torchrun, which process an error comes from (torchrun then stops the others)."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    return f"[rank {os.environ.get('RANK', '0')} of {size}] " if size > 1 else ""


def _main_process() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _interrupted(command: str, e: KeyboardInterrupt) -> int:
    """Ctrl-C (KeyboardInterrupt) or SIGTERM (engine/stop.Interrupted): one line, no traceback, and the
    shell's code for the signal, 128 + its number (130, 143). A training run's stop says what it
    saved (its rank 0 said it already when every rank stopped after one step)."""
    signum = getattr(e, "signum", signal.SIGINT)
    message = getattr(e, "message", None)
    if message is None:
        print(f"{_rank_prefix()}vlforge {command}: interrupted ({signal_name(signum)})", file=sys.stderr)
    elif not getattr(e, "said", False):
        print(f"{_rank_prefix()}{message}", file=sys.stderr)
    return 128 + signum


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # key=value overrides may come before or after options (argparse leaves the late ones over)
    args, extra = parser.parse_known_args(argv)
    unknown = [e for e in extra if e.startswith("-") or "=" not in e or not hasattr(args, "overrides")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    _quiet_libraries()
    try:
        with sigterm_interrupts():  # SIGTERM raises, as SIGINT does: both end below, in one line
            return args.func(args)
    except KeyboardInterrupt as e:
        return _interrupted(args.command, e)
    except (ConfigError, DataError, RewardError, FileNotFoundError) as e:
        print(f"{_rank_prefix()}error: {e}", file=sys.stderr)
        return 2
    except TrainingDiverged as e:  # the health monitor gave up; finished checkpoints are on disk
        print(f"{_rank_prefix()}error: training diverged: {e}", file=sys.stderr)
        return 3
    except CheckpointWriteError as e:  # disk full, quota, permissions: finished checkpoints are on disk
        print(f"{_rank_prefix()}error: {e}", file=sys.stderr)
        return 4


if __name__ == "__main__":
    sys.exit(main())
