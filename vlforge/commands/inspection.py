"""`vlforge view` (the runs of a directory as a local page, or one HTML file) and `vlforge doctor`
(Python, torch, GPUs, libraries, and what a recipe needs)."""

from __future__ import annotations

import argparse
import json
import sys

from vlforge.commands.base import Command, main_process, overrides_argument, rank_prefix


def _view_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="a run's train.output_dir, or a folder of runs")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=8600)
    p.add_argument("--export", metavar="HTML", help="write one self-contained HTML file instead of serving")


def cmd_view(args) -> int:
    from vlforge.view.app import command  # the viewer (docs/view.md)

    return command(args.runs, args.host, args.port, args.export)


def _doctor_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="recipe YAML: also check what it needs (device, bf16, FP8, flash-attn, "
                                    "model.path, optimizer, distributed)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    overrides_argument(p, "precision.fp8.enabled=true")


def cmd_doctor(args) -> int:
    from vlforge.config import load_recipe_config
    from vlforge.doctor import format_report, run_checks

    cfg = load_recipe_config(args.config, args.overrides) if args.config or args.overrides else None
    report = run_checks(cfg, config_path=args.config)
    if not main_process():  # under torchrun: rank 0 prints the report, the others only what fails on them
        for c in report["checks"]:
            if c["status"] == "fail":
                print(f"{rank_prefix()}[FAIL] {c['name']}: {c['detail']}", file=sys.stderr)
    else:
        print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0 if report["ok"] else 1


COMMANDS = [
    Command("view", "a local page of runs: curves, GRPO rollouts, eval answers (or --export HTML)", _view_arguments,
            cmd_view),
    Command("doctor", "check Python, torch, GPUs and libraries (and what a recipe needs)", _doctor_arguments,
            cmd_doctor),
]
