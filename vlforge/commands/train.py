"""`vlforge sft`, `grpo`, `demo` and `export`: the training recipes (with --plan and
--print-config) and writing a checkpoint as a model directory."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from vlforge.commands.base import Command, at_least, main_process, overrides_argument
from vlforge.config import ConfigError, GRPOConfig, SFTConfig, dump_config, load_config


def _print_plan(cfg, as_json: bool, world_size: int) -> None:
    """`--plan`: what trains (tiers, ranks, lrs, parameter counts), in which precision, and the
    per-process memory on `world_size` processes, from a meta-device model (no weights: works for
    32B on a laptop)."""
    from vlforge.model.load import build_meta_model
    from vlforge.model.tiers import build_plan, format_plan, plan_summary
    from vlforge.train.memory import format_memory, memory_estimate
    from vlforge.model.presets import is_moe
    from vlforge.train.distributed import planned_strategy
    from vlforge.train.precision import format_precision_plan, precision_plan, settle_master_weights

    model, _ = build_meta_model(cfg.model)
    plan = build_plan(model, cfg.tiers)
    # master_weights auto as the run would settle it on the GPUs it plans for (one per process)
    strategy, _ = planned_strategy(cfg.distributed.strategy, world_size, "cuda")
    precision, masters = settle_master_weights(cfg, "cuda", strategy, is_moe(model.config), None)
    cfg = dataclasses.replace(cfg, precision=precision)
    summary = {**plan_summary(model, plan), "precision": precision_plan(model, plan, cfg.precision, cfg.quant),
               "memory": memory_estimate(model, plan, cfg, world_size)}
    if masters:
        summary["precision"]["master_weights_auto"] = masters
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
        raise ConfigError(f"--json goes with --plan (vlforge {args.command} CONFIG --plan --json)")
    if args.world_size is not None and not args.plan:
        raise ConfigError(f"--world-size goes with --plan (vlforge {args.command} CONFIG --plan --world-size 8); "
                          "torchrun sets the processes of a run")
    cfg = load_config(cls, args.config, args.overrides)
    if args.print_config:
        print(dump_config(cfg), end="")
        return None
    if args.plan:
        _print_plan(cfg, args.json, _plan_world_size(args))
        return None
    return cfg


def _recipe_arguments(example_config: str, example_override: str):
    def arguments(p: argparse.ArgumentParser) -> None:
        p.add_argument("config", help=f"recipe YAML, e.g. {example_config}")
        overrides_argument(p, example_override)
        p.add_argument("--plan", action="store_true",
                       help="print the trainable, precision and memory plan and exit (no training)")
        p.add_argument("--json", action="store_true", help="with --plan: print JSON")
        p.add_argument("--world-size", type=at_least(1), metavar="N",
                       help="with --plan: estimate memory per process for N processes (default: WORLD_SIZE or 1)")
        p.add_argument("--print-config", action="store_true", help="print the effective config and exit")

    return arguments


def _run_recipe(cls, args) -> int:
    """`vlforge sft` / `grpo`: the recipe on its config, then its final evaluation and outputs."""
    if (cfg := _recipe_config(cls, args)) is None:
        return 0
    if cls is SFTConfig:
        from vlforge.recipes.sft import run_sft as run
    else:
        from vlforge.recipes.grpo import run_grpo as run
    result = run(cfg)
    if not main_process():
        return 0
    if ev := result["eval"]:
        print(f"eval at step {result['final_step']}: loss {ev['loss']:.4f} accuracy {ev['accuracy']:.3f} (n={ev['n']})")
    print(f"outputs in {result['output_dir']}")
    return 0


def cmd_sft(args) -> int:
    return _run_recipe(SFTConfig, args)


def cmd_grpo(args) -> int:
    return _run_recipe(GRPOConfig, args)


def _demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", help="output folder (default: ./vlforge-demo, or the next free vlforge-demo-N)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out folder")
    p.add_argument("overrides", nargs="*", help="overrides of the demo SFT recipe, e.g. train.max_steps=50")


def cmd_demo(args) -> int:
    from vlforge.demo import run_demo

    run_demo(args.out, args.overwrite, args.overrides)
    return 0


def _export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="runs/NAME/checkpoint-STEP")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--merge", action="store_true", help="merge LoRA into the base weights (else: adapter only)")
    p.add_argument("--quant", choices=["none", "nf4", "int8", "fp8"], default="none",
                   help="also quantize the language model of the written directory")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16", help="dtype of the merged weights")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--device", default="auto",
                   help="where quantization runs: auto (a GPU if visible) | cpu | cuda | cuda:N")


def cmd_export(args) -> int:
    from vlforge.config import QuantConfig
    from vlforge.model.export import export
    from vlforge.model.load import DTYPES
    from vlforge.train.hardware import quant_problem
    from vlforge.train.runtime import resolve_device

    quant, device = QuantConfig.from_flag(args.quant), resolve_device(args.device, "--device")
    if problem := quant_problem(quant, device):
        raise ConfigError(f"--quant {args.quant}: {problem}")
    result = export(args.checkpoint, args.out, merge=args.merge, quant=quant, dtype=DTYPES[args.dtype],
                    overwrite=args.overwrite, device=device)
    print(f"exported {result['kind']} model (quant {result['quant']}) to {result['out']}: {', '.join(result['files'])}")
    return 0


COMMANDS = [
    Command("sft", "supervised fine-tuning (LoRA tiers or full)",
            _recipe_arguments("configs/qwen3vl-8b-lora.yaml", "tiers.language.lr=1e-4"), cmd_sft, compiles=True),
    Command("grpo", "GRPO reinforcement learning with verifiable rewards",
            _recipe_arguments("configs/qwen3vl-8b-grpo.yaml", "rollout.group_size=8"), cmd_grpo, compiles=True),
    Command("demo", "synthesise data, train the tiny model on CPU, show before/after", _demo_arguments, cmd_demo),
    Command("export", "write a checkpoint as a standard HF model directory", _export_arguments, cmd_export),
]
