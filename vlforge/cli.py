"""The `vlforge` command: parses arguments, loads a typed config, calls one recipe function."""

from __future__ import annotations

import argparse
import json
import sys

from vlforge.config import ConfigError, GRPOConfig, SFTConfig, dump_config, load_config
from vlforge.data.jsonl import DataError
from vlforge.engine.health import TrainingDiverged
from vlforge.rl.rewards import RewardError


def _quiet_libraries() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def cmd_sft(args) -> int:
    cfg = load_config(SFTConfig, args.config, args.overrides)
    if args.print_config:
        print(dump_config(cfg), end="")
        return 0
    if args.plan:
        from vlforge.engine.precision import format_precision_plan, precision_plan
        from vlforge.model.load import build_meta_model
        from vlforge.model.tiers import build_plan, format_plan, plan_summary

        model, _ = build_meta_model(cfg.model)
        plan = build_plan(model, cfg.tiers)
        summary = {**plan_summary(model, plan), "precision": precision_plan(model, plan, cfg.precision)}
        print(json.dumps(summary, indent=2) if args.json
              else format_plan(summary) + "\n\n" + format_precision_plan(summary["precision"]))
        return 0
    from vlforge.recipes.sft import run_sft

    result = run_sft(cfg)
    if result["eval"]:
        print(f"eval at step {result['final_step']}: loss {result['eval']['loss']:.4f} "
              f"accuracy {result['eval']['accuracy']:.3f} (n={result['eval']['n']})")
    print(f"outputs in {result['output_dir']}")
    return 0


def cmd_grpo(args) -> int:
    cfg = load_config(GRPOConfig, args.config, args.overrides)
    if args.print_config:
        print(dump_config(cfg), end="")
        return 0
    from vlforge.recipes.grpo import run_grpo

    result = run_grpo(cfg)
    if result["eval"]:
        print(f"eval at step {result['final_step']}: accuracy {result['eval']['accuracy']:.3f} (n={result['eval']['n']})")
    print(f"outputs in {result['output_dir']}")
    return 0


def cmd_demo(args) -> int:
    from vlforge.recipes.demo import run_demo

    run_demo(args.out, args.overwrite, args.overrides)
    return 0


def cmd_data_synth(args) -> int:
    from vlforge.data.synth import synth_shapes

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


def cmd_doctor(args) -> int:
    from vlforge.doctor import format_report, load_recipe_config, run_checks

    cfg = load_recipe_config(args.config, args.overrides) if args.config or args.overrides else None
    report = run_checks(cfg, config_path=args.config)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0 if report["ok"] else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vlforge", description="Fine-tune, RL-train and serve Qwen3-VL models.")
    sub = p.add_subparsers(dest="command", required=True)

    sft = sub.add_parser("sft", help="supervised fine-tuning (LoRA tiers or full)")
    sft.add_argument("config", help="recipe YAML, e.g. configs/qwen3vl-8b-lora.yaml")
    sft.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. tiers.language.lr=1e-4")
    sft.add_argument("--plan", action="store_true", help="print the trainable plan and exit (no training)")
    sft.add_argument("--json", action="store_true", help="with --plan: print JSON")
    sft.add_argument("--print-config", action="store_true", help="print the effective config and exit")
    sft.set_defaults(func=cmd_sft)

    grpo = sub.add_parser("grpo", help="GRPO reinforcement learning with verifiable rewards")
    grpo.add_argument("config", help="recipe YAML, e.g. configs/qwen3vl-8b-grpo.yaml")
    grpo.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. rollout.group_size=8")
    grpo.add_argument("--print-config", action="store_true", help="print the effective config and exit")
    grpo.set_defaults(func=cmd_grpo)

    demo = sub.add_parser("demo", help="synthesise data, train the tiny model on CPU, show before/after")
    demo.add_argument("--out", help="output folder (default: ./vlforge-demo, or the next free vlforge-demo-N)")
    demo.add_argument("--overwrite", action="store_true", help="replace a non-empty --out folder")
    demo.add_argument("overrides", nargs="*", help="overrides of the demo SFT recipe, e.g. train.max_steps=50")
    demo.set_defaults(func=cmd_demo)

    data = sub.add_parser("data", help="dataset tools").add_subparsers(dest="data_command", required=True)
    synth = data.add_parser("synth", help="generate a synthetic dataset")
    synth.add_argument("kind", choices=["shapes"])
    synth.add_argument("--n", type=int, required=True, help="number of samples (train + val)")
    synth.add_argument("--out", required=True, help="output folder")
    synth.add_argument("--seed", type=int, default=0)
    synth.add_argument("--val-fraction", type=float, default=0.1)
    synth.add_argument("--size", type=int, default=64, help="image side in pixels")
    synth.add_argument("--tasks", help="comma-separated subset of colour,shape,position,count")
    synth.set_defaults(func=cmd_data_synth)
    check = data.add_parser("check", help="validate a JSONL file and report token lengths")
    check.add_argument("file")
    check.add_argument("--config", help="recipe YAML whose model/tokenizer and data limits to use")
    check.add_argument("--json", action="store_true")
    check.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. data.max_length=4096")
    check.set_defaults(func=cmd_data_check)

    doctor = sub.add_parser("doctor", help="check Python, torch, GPUs and libraries (and what a recipe needs)")
    doctor.add_argument("--config", help="recipe YAML: also check what it needs (device, bf16, FP8, flash-attn, model.path)")
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    doctor.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. precision.fp8.enabled=true")
    doctor.set_defaults(func=cmd_doctor)
    return p


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
        return args.func(args)
    except (ConfigError, DataError, RewardError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except TrainingDiverged as e:  # the health monitor gave up; finished checkpoints are on disk
        print(f"error: training diverged: {e}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
