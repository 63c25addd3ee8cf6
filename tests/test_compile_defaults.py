"""compile.enabled=auto with activation checkpointing: compiled where measured faster (one H100,
docs/benchmarks.md, compile: 8B LoRA with every block recomputed, compiled layers 1.57x eager), and
compiled layers under checkpointing train the tiny model on the CPU as eager ones do."""

from __future__ import annotations

import json

import torch

from helpers import tiny_sft_config
from vlforge.train.trainable import default_compile, measured_setup


def test_auto_compiles_a_checkpointed_run_on_cuda(shapes_dir, tmp_path):
    for enabled in ("true", "auto"):
        cfg = tiny_sft_config(shapes_dir, tmp_path, f"activation_checkpointing.enabled={enabled}")
        measured = measured_setup(cfg, "none", moe=False)
        assert default_compile(cfg.compile, cfg.precision.fp8, torch.device("cuda"), measured) is True
        assert default_compile(cfg.compile, cfg.precision.fp8, torch.device("cpu"), measured) is False
    cfg = tiny_sft_config(shapes_dir, tmp_path, "activation_checkpointing.enabled=true")
    assert not measured_setup(cfg, "fsdp2", moe=False) and not measured_setup(cfg, "none", moe=True)


def _losses(out) -> list[float]:
    return [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def test_compiled_layers_with_every_block_recomputed_train_as_eager_ones(shapes_dir, tmp_path, capsys):
    """Inductor on the CPU, 2 steps of the tiny model (full, dropout-free): the compiled run's layers
    run their checkpointed forward again in backward, and its losses are the eager run's."""
    from vlforge.recipes.sft import run_sft

    torch._dynamo.reset()
    losses = {}
    for compiled in ("false", "true"):
        out = tmp_path / compiled
        run_sft(tiny_sft_config(shapes_dir, out, "tiers.method=full", "eval.every=0", "train.max_steps=2",
                                "activation_checkpointing.enabled=true", f"compile.enabled={compiled}",
                                "compile.vision=false"))
        losses[compiled] = _losses(out)
    text = capsys.readouterr().out
    assert "compiled: decoder layers" in text and "every block recomputed" in text
    torch.testing.assert_close(losses["true"], losses["false"], rtol=1e-4, atol=1e-5)
