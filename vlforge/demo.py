"""`vlforge demo`: the whole pipeline on the built-in tiny Qwen3-VL and synthetic shapes, on a CPU.

1. synthesise data; evaluate the untrained model; fine-tune it (configs/demo-sft.yaml); evaluate.
2. GRPO (configs/demo-grpo.yaml) from a deliberately under-trained SFT model (80 steps), with
   held-out accuracy before and after, and the reward per step as a PNG.
Everything goes under one folder (default ./vlforge-demo).

It chains the SFT and GRPO recipes, so it sits above them (docs/architecture.md): the one place
that runs one recipe after another.
"""

from __future__ import annotations

import json
import shutil
import time
from importlib import resources
from pathlib import Path

from vlforge.config import ConfigError, GRPOConfig, SFTConfig, load_config
from vlforge.data.dataset import load_dataset
from vlforge.data.synth import synth_shapes
from vlforge.train.evaluate import evaluate
from vlforge.train.trainable import setup_model
from vlforge.recipes.grpo import run_grpo
from vlforge.recipes.sft import run_sft

DEMO_TRAIN_SAMPLES = 10000
DEMO_VAL_SAMPLES = 200
# Colour and shape: what the tiny model learns reliably in two CPU minutes. Counting and position
# are left to later stages (GRPO): mixed into this SFT run they slow the others without being learnt.
DEMO_TASKS = ("colour", "shape")
UNDERTRAINED_SFT_STEPS = 80  # where GRPO starts: the model answers, but mostly wrongly
# everything the demo writes under its folder (what --overwrite may remove)
DEMO_OUTPUTS = ("data", "sft", "sft-undertrained", "grpo", "loss.png", "reward.png", "summary.json")


def packaged_config(name: str) -> Path:
    return Path(str(resources.files("vlforge") / "configs" / name))


def demo_dir(out: str | None, overwrite: bool) -> Path:
    if out is None:  # never clobber an earlier demo: vlforge-demo, vlforge-demo-2, ...
        path, i = Path("vlforge-demo"), 1
        while path.exists() and any(path.iterdir()):
            i += 1
            path = Path(f"vlforge-demo-{i}")
        return path
    path = Path(out)
    if path.exists() and any(path.iterdir()):
        if not overwrite:
            raise ConfigError(f"--out {path} is not empty; pass --overwrite to replace it or choose another folder")
        # --overwrite replaces an earlier demo, never anything else that lives in the folder
        foreign = sorted(p.name for p in path.iterdir() if p.name not in DEMO_OUTPUTS)
        if foreign:
            raise ConfigError(f"--out {path} holds files the demo did not write ({', '.join(foreign[:5])}); "
                              "--overwrite only replaces an earlier demo: choose another folder")
        for name in DEMO_OUTPUTS:
            target = path / name
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
    return path


def format_table(before: dict, after: dict) -> str:
    tasks = sorted(set(before["by_task"]) | set(after["by_task"]))
    lines = [f"{'held-out accuracy':<20}{'before':>8}{'after':>8}"]
    for task in tasks:
        lines.append(f"{task:<20}{before['by_task'].get(task, 0):>8.2f}{after['by_task'].get(task, 0):>8.2f}")
    lines.append(f"{'all (n=' + str(after['n']) + ')':<20}{before['accuracy']:>8.2f}{after['accuracy']:>8.2f}")
    lines.append(f"{'val loss':<20}{before['loss']:>8.3f}{after['loss']:>8.3f}")
    return "\n".join(lines)


def run_grpo_stage(root: Path, paths: dict, overrides: list[str], model_overrides: list[str] = ()) -> dict:
    """GRPO from an SFT model stopped early: the RL stage on its own, measured on held-out data.
    `model_overrides`: the demo's model.* overrides (model.preset=tiny-moe), so both stages use that model."""
    start_dir = root / "sft-undertrained"
    cfg = load_config(SFTConfig, packaged_config("demo-sft.yaml"), [
        f"data.train={paths['train']}", "data.val=null", f"train.output_dir={start_dir}",
        f"train.max_steps={UNDERTRAINED_SFT_STEPS}", f"train.save_every={UNDERTRAINED_SFT_STEPS}", "log.progress=false",
        *model_overrides])
    run_sft(cfg)
    grpo_cfg = load_config(GRPOConfig, packaged_config("demo-grpo.yaml"), [
        f"model.path={start_dir / f'checkpoint-{UNDERTRAINED_SFT_STEPS}'}", f"data.train={paths['train']}",
        f"data.val={paths['val']}", f"train.output_dir={root / 'grpo'}", *overrides])
    result = run_grpo(grpo_cfg)
    shutil.copy(Path(result["output_dir"]) / "reward.png", root / "reward.png")
    return result


def run_demo(out: str | None = None, overwrite: bool = False, overrides: list[str] | None = None,
             grpo_overrides: list[str] | None = None) -> dict:
    root = demo_dir(out, overwrite)
    start = time.perf_counter()
    print(f"vlforge demo -> {root}/")
    paths = synth_shapes(root / "data", DEMO_TRAIN_SAMPLES + DEMO_VAL_SAMPLES, seed=0, tasks=DEMO_TASKS,
                         val_fraction=DEMO_VAL_SAMPLES / (DEMO_TRAIN_SAMPLES + DEMO_VAL_SAMPLES))
    print(f"1/4 synthesised {DEMO_TRAIN_SAMPLES} train + {DEMO_VAL_SAMPLES} val shapes samples in {root / 'data'}")
    cfg: SFTConfig = load_config(SFTConfig, packaged_config("demo-sft.yaml"), [
        f"data.train={paths['train']}", f"data.val={paths['val']}", f"train.output_dir={root / 'sft'}",
        *(overrides or [])])

    t = setup_model(cfg)  # same seed as the run below: this *is* the model before training
    val = load_dataset(cfg.data.val, t.processor, cfg.data)
    before = evaluate(t.model, val, batch_size=cfg.eval.batch_size, max_new_tokens=cfg.eval.max_new_tokens,
                      max_samples=cfg.eval.max_samples, policy=t.policy, device=t.device)
    del t
    print(f"2/4 untrained tiny Qwen3-VL: accuracy {before['accuracy']:.2f}; fine-tuning ...")
    result = run_sft(cfg)
    after = result["eval"]
    shutil.copy(Path(result["output_dir"]) / "loss.png", root / "loss.png")
    sft_seconds = time.perf_counter() - start
    print(f"3/4 SFT done in {sft_seconds:.0f} s\n\n{format_table(before, after)}\n\n"
          f"loss curve: {root / 'loss.png'}   run: {result['output_dir']}\n")
    print(f"4/4 GRPO from an under-trained SFT model ({UNDERTRAINED_SFT_STEPS} steps), exact-match reward ...")
    grpo = run_grpo_stage(root, paths, grpo_overrides or [], [o for o in overrides or [] if o.startswith("model.")])
    elapsed = time.perf_counter() - start
    print(f"\nGRPO stage (greedy accuracy on held-out data)\n"
          f"{format_table(grpo['first_eval'], grpo['eval'])}\n\nreward curve: {root / 'reward.png'}   "
          f"run: {grpo['output_dir']}\ndemo done in {elapsed:.0f} s")
    summary = {"before": before, "after": after, "sft_seconds": sft_seconds,
               "grpo": {"before": grpo["first_eval"], "after": grpo["eval"]}, "seconds": elapsed,
               "output_dir": str(root)}
    (root / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
