"""train/throughput.py: the cost fields of a metrics row (step time, tokens/s, peak memory, MFU)
and the one count of model FLOPs (a run's metrics and bench/train.py)."""

import json

import pytest
import torch
from helpers import tiny_sft_config
from torch import nn

from vlforge.config import DataConfig, ModelConfig
from vlforge.data.dataset import load_dataset
from vlforge.data.encode import collate, pack
from vlforge.model.load import build_meta_model
from vlforge.recipes.sft import run_sft
from vlforge.train.throughput import FlopWeights, StepMeter, peak_flops_of, step_flops


def _linears(model, vision: bool) -> float:
    """Weights of the nn.Linear (and the tower's patch-embedding nn.Conv3d) modules of the tower (per
    patch: a merger's once per 2 x 2 patches) or of the language model (lm_head apart), found by module
    type; the function under test walks parameters."""
    merge = model.config.vision_config.spatial_merge_size
    return sum(m.weight.numel() / (merge * merge if vision and "merger" in name else 1)
               for name, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv3d))
               and ("visual" in name) == vision and name != "lm_head")


def test_trained_weights_count_six_flops_per_row_frozen_ones_four_and_an_untrained_tower_two():
    model, _ = build_meta_model(ModelConfig(preset="tiny"))
    head = model.lm_head.weight.numel()
    full = FlopWeights.of(model)
    assert (full.decoder, full.head, full.vision) == (6 * _linears(model, False), 6 * head, 6 * _linears(model, True))
    for p in model.parameters():
        p.requires_grad_(False)  # a frozen base (LoRA's): gradients still flow back through the LM
    frozen = FlopWeights.of(model)
    assert (frozen.decoder, frozen.head) == (4 * _linears(model, False), 4 * head)
    assert frozen.vision == 2 * _linears(model, True)  # nothing in the tower trains: its forward only
    model.lm_head.weight = model.model.language_model.embed_tokens.weight  # tied, as 2B and 4B are
    assert FlopWeights.of(model).head == 4 * head  # the output projection is still a matmul


def test_moe_experts_count_at_top_k_of_their_number():
    model, _ = build_meta_model(ModelConfig(preset="tiny-moe"))
    text = model.config.text_config
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n and "visual" not in n)
    routers = sum(p.numel() for n, p in model.named_parameters() if n.endswith("mlp.gate.weight"))
    assert experts > 0 and routers > 0
    share = text.num_experts_per_tok / text.num_experts
    expected = 6 * (_linears(model, False) + routers + experts * share)
    assert FlopWeights.of(model).decoder == pytest.approx(expected)


def test_a_step_counts_real_tokens_supervised_tokens_patches_and_per_sample_attention(tiny, shapes_dir):
    """The same samples padded into a batch or packed into one row are the same model FLOPs: padding,
    a packed row's filler and attention across its samples are not work the model needed."""
    model, processor = tiny
    data = load_dataset(str(shapes_dir / "train.jsonl"), processor, DataConfig())
    items = [data[i] for i in range(4)]
    padded, packed = collate(items, data.encoder.pad_id), pack(items, data.encoder.pad_id, multiple=64)
    w = FlopWeights.of(model)
    lengths = [len(x["input_ids"]) for x in items]
    assert len(set(lengths)) > 1 and padded["input_ids"].numel() > sum(lengths)  # there is padding
    supervised = sum(int((x["labels"][1:] != -100).sum()) for x in items)
    patches = int(padded["image_grid_thw"].prod(-1).sum())
    expected = (w.decoder * sum(lengths) + w.head * supervised + w.vision * patches
                + w.attention * sum(n * n for n in lengths) / 2)
    assert step_flops(w, [padded]) == pytest.approx(expected)
    assert step_flops(w, [packed]) == pytest.approx(expected)
    assert step_flops(w, [padded, packed]) == pytest.approx(2 * expected)


def test_the_peak_of_a_gpu_is_looked_up_by_its_most_specific_name():
    assert peak_flops_of("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops_of("NVIDIA H100 PCIe") == 756e12
    assert peak_flops_of("NVIDIA GH200 480GB") == 989e12
    assert peak_flops_of("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops_of("Some Future GPU") is None


def test_mfu_is_the_steps_model_flops_over_its_time_and_the_peak(tiny, shapes_dir):
    model, processor = tiny
    data = load_dataset(str(shapes_dir / "train.jsonl"), processor, DataConfig())
    batch = collate([data[i] for i in range(2)], data.encoder.pad_id)
    meter = StepMeter(model, torch.device("cpu"))
    assert "mfu" not in meter.row([batch], tokens=100, seconds=2.0)  # a CPU: no peak in the table
    meter.peak = 1e12  # as a table entry would give it
    row = meter.row([batch], tokens=100, seconds=2.0)
    assert row["mfu"] == pytest.approx(step_flops(FlopWeights.of(model), [batch]) / 2.0 / 1e12)
    assert row["tokens_per_s"] == 50.0 and row["step_time_s"] == 2.0


def test_sft_rows_carry_step_time_tokens_per_s_and_peak_memory(shapes_dir, tmp_path, capsys):
    """On a CPU: the process's peak resident memory (at least the model's fp32 weights and Adam's two
    moments), the step time, and no MFU (a CPU has no entry in the peak table), which the log says once."""
    run_sft(tiny_sft_config(shapes_dir, tmp_path, "train.max_steps=2"))
    rows = [r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert len(rows) == 2
    model, _ = build_meta_model(ModelConfig(preset="tiny"))
    weights = sum(p.numel() for p in model.parameters()) * 4 * 3 / 1e9  # fp32 weights + 2 Adam moments
    for r in rows:
        assert r["mem/peak_rss_gb"] > weights
        assert r["step_time_s"] > 0 and r["tokens_per_s"] > 0
        assert "mfu" not in r
    assert capsys.readouterr().out.count("no MFU in the metrics") == 1
