"""The demo recipe: pinned first losses (catches silent numerics changes) and the demo end to end."""

import json

import pytest

from vlforge.cli import main
from vlforge.config import SFTConfig, load_config
from vlforge.data.synth import synth_shapes
from vlforge.demo import DEMO_TASKS, packaged_config
from vlforge.recipes.sft import run_sft

# First five training losses of configs/demo-sft.yaml on 200 shapes samples (seed 0), fp32 CPU.
GOLDEN_LOSSES = [6.452515, 6.406117, 6.363747, 6.301197, 6.259902]


def test_demo_recipe_first_losses_are_pinned(tmp_path):
    paths = synth_shapes(tmp_path / "data", 200, seed=0, tasks=DEMO_TASKS)
    cfg = load_config(SFTConfig, packaged_config("demo-sft.yaml"), [
        f"data.train={paths['train']}", "data.val=null", f"train.output_dir={tmp_path / 'run'}",
        "train.max_steps=5", "log.every=1", "log.progress=false"])
    run_sft(cfg)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert losses == pytest.approx(GOLDEN_LOSSES, rel=1e-4, abs=1e-5)


@pytest.mark.slow  # the whole demo: 2-3 minutes on 2 idle cores, 7 on busy ones
def test_demo_sft_learns_colour_and_shape_and_grpo_raises_accuracy(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "log.progress=false"]) == 0
    printed = capsys.readouterr().out
    assert "held-out accuracy" in printed and "before" in printed and "after" in printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["after"]["by_task"]["colour"] >= 0.9
    assert summary["after"]["by_task"]["shape"] >= 0.9
    assert summary["before"]["accuracy"] < 0.5
    assert (out / "loss.png").stat().st_size > 1000
    # the GRPO stage on its own, from an under-trained SFT model: at least +10 points held out
    grpo = summary["grpo"]
    assert grpo["after"]["accuracy"] >= grpo["before"]["accuracy"] + 0.10
    assert (out / "reward.png").stat().st_size > 1000
    rewards = [r["reward_mean"] for r in map(json.loads, (out / "grpo" / "metrics.jsonl").read_text().splitlines())
               if "reward_mean" in r]
    assert sum(rewards[-20:]) / 20 > sum(rewards[:20]) / 20  # the sampled reward rises
    assert json.loads((out / "sft" / "eval.json").read_text())["n"] == 200
    assert (out / "data" / "train.jsonl").exists()
    # a second demo into the same folder is refused rather than overwriting the first
    assert main(["demo", "--out", str(out)]) == 2


def test_demo_with_the_moe_preset_runs_every_stage_on_the_moe_model(tmp_path, capsys, monkeypatch):
    """`vlforge demo model.preset=tiny-moe` (the README's MoE demo) through the CLI, shrunk: fewer
    samples and steps, the same stages. Both the SFT and the GRPO stage train the MoE model."""
    import functools

    from vlforge import demo

    monkeypatch.setattr(demo, "DEMO_TRAIN_SAMPLES", 48)
    monkeypatch.setattr(demo, "DEMO_VAL_SAMPLES", 4)
    monkeypatch.setattr(demo, "UNDERTRAINED_SFT_STEPS", 2)
    # the CLI passes no GRPO overrides: shrink that stage here (cmd_demo calls demo.run_demo); a model
    # after 2 SFT steps answers nothing right, and dynamic sampling would drop every (all-zero) group
    # and leave the step without a forward
    monkeypatch.setattr(demo, "run_demo", functools.partial(demo.run_demo, grpo_overrides=[
        "train.max_steps=1", "train.save_every=1", "rollout.prompts_per_step=2", "rollout.group_size=4",
        "rl.mini_batch_size=8", "eval.max_samples=4", "rl.dynamic_sampling=false", "log.progress=false"]))
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "model.preset=tiny-moe", "train.max_steps=2", "train.save_every=2",
                 "train.batch_size=2", "log.every=1", "log.progress=false", "eval.max_samples=4"]) == 0
    printed = capsys.readouterr().out
    assert all(f"{i}/4" in printed for i in range(1, 5)) and "held-out accuracy" in printed
    for run in ("sft/checkpoint-2", "sft-undertrained/checkpoint-2", "grpo/checkpoint-1"):
        assert json.loads((out / run / "config.json").read_text())["model_type"] == "qwen3_vl_moe", run
    for run in ("sft", "grpo"):  # expert load logged by both recipes
        rows = [json.loads(line) for line in (out / run / "metrics.jsonl").read_text().splitlines()]
        assert any("moe/max_load_worst" in r and "moe/aux_loss" in r for r in rows), run
    assert next(r for r in rows if "groups_trained" in r)["groups_trained"] == 2
    summary = json.loads((out / "summary.json").read_text())
    assert summary["before"]["n"] == summary["after"]["n"] == summary["grpo"]["after"]["n"] == 4
    assert (out / "loss.png").stat().st_size > 1000 and (out / "reward.png").stat().st_size > 1000
    assert (out / "data" / "train.jsonl").exists()
