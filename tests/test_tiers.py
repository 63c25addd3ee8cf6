import copy
import json

import pytest
import torch

from vlforge.cli import main
from vlforge.config import SFTConfig, TiersConfig, load_config
from vlforge.data.dataset import load_dataset
from vlforge.data.encode import collate
from vlforge.train.health import GradHealth
from vlforge.train.optim import build_optimizer
from vlforge.model.tiers import apply_plan, build_plan, param_groups, plan_summary, unwrap
from vlforge.train.trainable import setup_model
from vlforge.recipes.sft import train_step

from helpers import tiny_sft_config


def lora_tiers(**kw) -> TiersConfig:
    cfg = load_config(SFTConfig, None, ["tiers.vision.train=true"] + [f"tiers.{k}={v}" for k, v in kw.items()])
    return cfg.tiers


def test_plan_selects_the_three_tiers(tiny):
    model = copy.deepcopy(tiny[0])
    plan = build_plan(model, lora_tiers(**{"vision.last_n_blocks": 1, "language.mlp": "true"}))
    by_tier = {t: [e.module for e in plan if e.tier == t] for t in ("language", "projector", "vision")}
    assert "model.language_model.layers.1.mlp.down_proj" in by_tier["language"]
    assert len(by_tier["language"]) == 2 * 7  # 2 layers x (q,k,v,o,gate,up,down)
    assert set(by_tier["projector"]) == {"model.visual.merger.linear_fc1", "model.visual.merger.linear_fc2",
                                         "model.visual.deepstack_merger_list.0.linear_fc1",
                                         "model.visual.deepstack_merger_list.0.linear_fc2"}
    assert by_tier["vision"] == ["model.visual.blocks.1.attn.qkv", "model.visual.blocks.1.attn.proj"]
    assert {e.r for e in plan if e.tier == "projector"} == {32}


def test_plan_count_equals_real_trainable_params_and_ranks(tiny):
    model = copy.deepcopy(tiny[0])
    plan = build_plan(model, lora_tiers())
    summary = plan_summary(model, plan)
    peft_model = apply_plan(model, plan)
    assert sum(p.numel() for p in peft_model.parameters() if p.requires_grad) == summary["trainable_params"]
    merger = unwrap(peft_model).model.visual.merger.linear_fc1
    assert merger.r["default"] == 32 and merger.scaling["default"] == 64 / 32
    assert merger.lora_dropout["default"].p == 0.05
    qkv = unwrap(peft_model).model.visual.blocks[1].attn.qkv
    assert qkv.r["default"] == 4 and qkv.lora_dropout["default"].p == 0.1
    groups = {g["tier"]: g["lr"] for g in param_groups(peft_model, plan, 0.0)}
    assert groups == {"language": 2e-4, "projector": 5e-4, "vision": 1e-5}


def test_full_plan_uses_group_learning_rates(tiny):
    model = copy.deepcopy(tiny[0])
    tiers = load_config(SFTConfig, None, ["tiers.method=full", "tiers.vision.train=false"]).tiers
    plan = build_plan(model, tiers)
    model = apply_plan(model, plan)
    assert all(not p.requires_grad for n, p in model.named_parameters() if n.startswith("model.visual.blocks"))
    assert all(p.requires_grad for n, p in model.named_parameters() if n.startswith("model.language_model"))
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == plan_summary(model, plan)["trainable_params"]


@pytest.mark.parametrize("method", ["lora", "full"])
def test_every_trainable_param_changes_and_frozen_ones_do_not(shapes_dir, tmp_path, method):
    cfg = tiny_sft_config(shapes_dir, tmp_path, f"tiers.method={method}", "optim.max_grad_norm=null",
                          "tiers.vision.last_n_blocks=1")
    t = setup_model(cfg)
    before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    data = load_dataset(cfg.data.train, t.processor, cfg.data)
    optimizer = build_optimizer(param_groups(t.model, t.plan, 0.0), cfg.optim, "cpu")
    scaler = t.policy.grad_scaler()
    for step in range(2):  # LoRA B starts at zero, so A only gets a gradient from the second step
        batch = collate([data[i] for i in range(4 * step, 4 * step + 4)], data.encoder.pad_id)
        train_step(t, [batch], optimizer, scaler, GradHealth(t.model, t.plan, cfg.health), None)
    trainable = {n for n, p in t.model.named_parameters() if p.requires_grad}
    assert trainable
    for n, p in t.model.named_parameters():
        changed = not torch.equal(before[n], p.detach())
        assert changed == (n in trainable), f"{n}: trainable={n in trainable} changed={changed}"


def test_merged_lora_gives_the_same_logits(shapes_dir, tmp_path):
    cfg = tiny_sft_config(shapes_dir, tmp_path, "tiers.method=lora", "tiers.language.lr=0.05",
                          "tiers.projector.lr=0.05", "tiers.vision.lr=0.05")
    t = setup_model(cfg)
    data = load_dataset(cfg.data.train, t.processor, cfg.data)
    optimizer = build_optimizer(param_groups(t.model, t.plan, 0.0), cfg.optim, "cpu")
    for step in range(3):
        batch = collate([data[i] for i in range(4 * step, 4 * step + 4)], data.encoder.pad_id)
        train_step(t, [batch], optimizer, t.policy.grad_scaler(), GradHealth(t.model, t.plan, cfg.health), None)
    t.model.eval()
    batch = collate([data[i] for i in range(4)], data.encoder.pad_id)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        unmerged = unwrap(t.model)(**inputs).logits
        with t.model.disable_adapter():
            base = unwrap(t.model)(**inputs).logits
        merged_model = t.model.merge_and_unload()
        merged = merged_model(**inputs).logits
    assert not torch.allclose(unmerged, base, atol=1e-3)  # the adapters learned something
    # fp32 summation order, W x + s B (A x) against (W + s B A) x: ~5e-6 apart here with one thread, more on
    # other CPUs' kernels; the adapters moved the logits by ~1.7, five orders more
    torch.testing.assert_close(merged, unmerged, atol=1e-4, rtol=1e-4)


def test_cli_plan_text_and_json(shapes_dir, capsys):
    config = str(__import__("pathlib").Path(__file__).parents[1] / "configs" / "qwen3vl-8b-lora.yaml")
    assert main(["sft", config, "--plan", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    tiers = {m["tier"] for m in summary["modules"]}
    assert tiers == {"language", "projector", "vision"}
    assert 0 < summary["trainable_params"] < summary["total_params"]
    lang = next(m for m in summary["modules"] if m["tier"] == "language")
    assert (lang["r"], lang["alpha"], lang["dropout"], lang["lr"]) == (8, 16.0, 0.1, 2e-5)
    assert main(["sft", config, "--plan"]) == 0
    text = capsys.readouterr().out
    assert "model.visual.merger.linear_fc1" in text and "projector" in text and "trainable" in text
