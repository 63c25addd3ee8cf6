"""`vlforge data synth`, `check` and `convert`: make a synthetic dataset, validate one and report its
token lengths, or write any format training reads as native JSONL (docs/data.md)."""

from __future__ import annotations

import argparse
import json

from vlforge.commands.base import Command, overrides_argument
from vlforge.config import SFTConfig, load_config


def _synth_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("kind", choices=["shapes", "tools", "motion", "zoom"],
                   help="shapes: questions about coloured shapes; tools: count the shapes, multiply with the "
                        "calculator tool (SFT conversations + GRPO prompts); motion: videos (frame lists) of a "
                        "shape moving left or right, for SFT; zoom: the colour of a small shape, seen through "
                        "the zoom_in tool (SFT conversations + GRPO prompts; images 4x --size; tools and zoom "
                        "write no val split)")
    p.add_argument("--n", type=int, required=True, help="number of samples (train + val)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--val-fraction", type=float, default=0.1)
    p.add_argument("--size", type=int, default=64, help="image side in pixels")
    p.add_argument("--tasks", help="comma-separated subset of colour,shape,position,count")


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


def _check_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file")
    p.add_argument("--config", help="recipe YAML whose model/tokenizer and data limits to use")
    p.add_argument("--json", action="store_true")
    overrides_argument(p, "data.max_length=4096")


def cmd_data_check(args) -> int:
    from vlforge.data.check import check_file, format_check
    from vlforge.model.load import load_processor

    cfg = load_config(SFTConfig, args.config, args.overrides)
    if not cfg.model.path and not cfg.model.preset:
        cfg.model.preset = "tiny"  # token counts then use the tiny tokenizer; pass a config for exact ones
    report = check_file(args.file, load_processor(cfg.model), cfg.data)
    print(json.dumps(report, indent=2) if args.json else format_check(report))
    return 1 if report["errors"] else 0


def _convert_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="the dataset: a .jsonl / .json / .parquet file or a folder")
    p.add_argument("out", help="the JSONL file to write (new); images go to <name>-images/ beside it")
    p.add_argument("--config", help="recipe YAML whose data settings (format, columns, limits) to use")
    p.add_argument("overrides", nargs="*", help="e.g. data.columns.prompt=problem data.on_error=skip")


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


COMMANDS = [  # under `vlforge data`
    Command("synth", "generate a synthetic dataset", _synth_arguments, cmd_data_synth),
    Command("check", "validate a dataset (any format docs/data.md lists) and report token lengths", _check_arguments,
            cmd_data_check),
    Command("convert", "write a dataset (ShareGPT/LLaVA, OpenAI messages, parquet, a datasets folder) as native "
            "JSONL, embedded images as files (docs/data.md)", _convert_arguments, cmd_data_convert),
]
