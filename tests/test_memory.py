"""`--plan`'s memory estimate: the 8B arithmetic on a meta device, and the real tensors of a tiny run."""

import json

import pytest
import torch

from vlforge.cli import main
from vlforge.config import SFTConfig, load_config
from vlforge.train.memory import GB, memory_estimate
from vlforge.model.load import build_meta_model
from vlforge.model.tiers import build_plan

FULL_8B = ["model.preset=qwen3vl-8b", "tiers.method=full", "tiers.vision.train=true", "tiers.vision.last_n_blocks=null",
           "precision.mode=bf16", "precision.master_weights=fp32", "optim.name=adamw"]


@pytest.fixture(scope="module")
def meta_8b():
    cfg = load_config(SFTConfig, None, FULL_8B)
    model, _ = build_meta_model(cfg.model)
    return cfg, model, build_plan(model, cfg.tiers)


def test_8b_full_fine_tuning_is_16_bytes_per_parameter_split_over_the_ranks(meta_8b):
    cfg, model, plan = meta_8b
    n = sum(p.numel() for p in model.parameters())  # tied weights once
    assert 8.5e9 < n < 9.0e9
    one = memory_estimate(model, plan, cfg, world_size=1)
    assert one["strategy"] == "none" and one["trainable_params"] == n
    parts = one["no_offload"]
    # fp32 masters (4) + fp32 gradients (4) + two fp32 AdamW moments (8)
    assert parts["parameters"]["gpu"] == 4 * n and parts["gradients"]["gpu"] == 4 * n
    assert parts["optimizer_state"]["gpu"] == 8 * n and parts["gathered"]["gpu"] == 0
    assert parts["total"] == {"gpu": 16 * n, "host": 0}
    assert 135 * GB < parts["total"]["gpu"] < 145 * GB  # more than one H200's 141 GB

    eight = memory_estimate(model, plan, cfg, world_size=8)
    assert eight["strategy"] == "fsdp2" and eight["selected"] == "no_offload"
    sharded = eight["no_offload"]
    for key, per_param in (("parameters", 4), ("gradients", 4), ("optimizer_state", 8)):
        # FSDP2 pads dim 0 up to a multiple of 8: a little over an eighth, never under
        assert per_param * n / 8 <= sharded[key]["gpu"] < per_param * n / 8 * 1.001, key
    # gathered in bf16: the root (embeddings, lm_head, norm), the whole vision tower and two decoder layers
    lm = model.model.language_model
    layer = sum(p.numel() for p in lm.layers[0].parameters())
    assert sharded["gathered"]["gpu"] == 2 * (n - (len(lm.layers) - 2) * layer)
    offload = eight["cpu_offload"]
    assert offload["total"]["host"] == sharded["total"]["gpu"] - sharded["gathered"]["gpu"]
    assert offload["total"]["gpu"] == sharded["gathered"]["gpu"]

    cfg.distributed.reshard_after_forward = False  # every layer stays gathered from forward to backward
    kept = memory_estimate(model, plan, cfg, world_size=8)["no_offload"]["gathered"]["gpu"]
    assert kept == 2 * n
    cfg.distributed.reshard_after_forward = True

    # units of several layers: two units (the running one and the prefetched next) of 4 layers gathered,
    # the default of FSDP2 on one process (distributed.layers_per_unit: auto), or of 3 as set
    cfg.distributed.strategy = "fsdp2"
    for per_unit, world in (("auto", 1), (3, 8)):
        cfg.distributed.layers_per_unit = per_unit
        layers = 4 if per_unit == "auto" else per_unit
        gathered = memory_estimate(model, plan, cfg, world_size=world)["no_offload"]["gathered"]["gpu"]
        assert gathered == 2 * (n - (len(lm.layers) - 2 * layers) * layer), per_unit
    cfg.distributed.strategy, cfg.distributed.layers_per_unit = "auto", "auto"


@pytest.mark.parametrize("method,master", [("lora", "compute"), ("full", "fp32")])
def test_estimate_equals_the_tensors_of_a_real_run_and_its_optimizer(tmp_path, method, master):
    """The tiny model as a run loads it (LoRA with bf16 masters; full with fp32 masters beside frozen
    bf16 vision blocks): the estimate equals the bytes of its parameters, their gradients and
    AdamW's real state after a step."""
    from vlforge.train.optim import build_optimizer
    from vlforge.train.trainable import setup_model
    from vlforge.model.tiers import param_groups

    cfg = load_config(SFTConfig, None, ["model.preset=tiny", "train.device=cpu", f"tiers.method={method}",
                                        "precision.mode=bf16", f"precision.master_weights={master}",
                                        f"train.output_dir={tmp_path}"])
    meta, _ = build_meta_model(cfg.model)
    est = memory_estimate(meta, build_plan(meta, cfg.tiers), cfg)["no_offload"]
    t = setup_model(cfg)
    params = list(t.model.parameters())
    trainable = [p for p in params if p.requires_grad]
    assert est["parameters"]["gpu"] == sum(p.numel() * p.element_size() for p in params)
    assert est["gradients"]["gpu"] == sum(p.numel() * p.element_size() for p in trainable)
    optimizer = build_optimizer(param_groups(t.model, t.plan, cfg.optim.weight_decay), cfg.optim, "cpu")
    for p in trainable:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    state = sum(v.numel() * v.element_size() for s in optimizer.state.values() for k, v in s.items() if k != "step")
    assert state == est["optimizer_state"]["gpu"]
    assert {p.dtype for p in trainable} == {torch.bfloat16 if master == "compute" else torch.float32}


def test_8bit_state_uses_the_8bit_sizes(meta_8b):
    cfg, model, plan = meta_8b
    cfg.optim.name = "adamw8bit"
    try:
        est = memory_estimate(model, plan, cfg, world_size=1)
    finally:
        cfg.optim.name = "adamw"
    n = est["trainable_params"]
    # two uint8 moments + an fp32 scale per 256 values; the few small tensors keep fp32 moments
    assert 2 * n < est["no_offload"]["optimizer_state"]["gpu"] < 2.1 * n
    assert est["fsdp2_problem"] is None  # 8-bit AdamW steps FSDP2's shards (optim.sharded_8bit)
    cfg.optim.name = "adamw8bit"
    try:
        sharded = memory_estimate(model, plan, cfg, world_size=8)
    finally:
        cfg.optim.name = "adamw"
    vision = sum(p.numel() for name, p in model.named_parameters() if name.startswith("model.visual.blocks."))
    # sharded, the 8B vision blocks' 1152-wide rows are not whole 256-value blocks: fp32 moments there
    # (8 bytes a value instead of ~2), so an eighth of the unsharded state plus ~6 bytes per vision value
    state = sharded["no_offload"]["optimizer_state"]["gpu"]
    unsharded = est["no_offload"]["optimizer_state"]["gpu"]
    assert unsharded / 8 + 5.5 * vision / 8 < state < unsharded / 8 + 6.5 * vision / 8


def test_cli_plan_memory_table_json_and_world_size(capsys, monkeypatch):
    assert main(["sft", "configs/demo-sft.yaml", "--plan", "--world-size", "4", "distributed.cpu_offload=true"]) == 0
    text = capsys.readouterr().out
    assert ("memory per process: FSDP2 over 4 process(es), every tensor split 4 ways, 1 decoder layer "
            "(and vision blocks) a unit") in text
    assert "cpu_offload GPU" in text
    assert "this config: cpu_offload" in text and "not estimated: autocast copies" in text
    assert "activations of a " in text and "every block recomputed" in text
    monkeypatch.setenv("WORLD_SIZE", "2")  # under torchrun, --plan defaults to its world size
    assert main(["sft", "configs/demo-sft.yaml", "--plan", "--json"]) == 0
    mem = json.loads(capsys.readouterr().out)["memory"]
    assert mem["world_size"] == 2 and mem["strategy"] == "fsdp2" and mem["selected"] == "no_offload"
    assert set(mem["no_offload"]) == {"parameters", "gradients", "optimizer_state", "gathered", "total"}
    assert main(["sft", "configs/demo-sft.yaml", "--plan", "--json", "distributed.strategy=none"]) == 0
    assert json.loads(capsys.readouterr().out)["memory"]["problem"].startswith("distributed.strategy=none but")
    monkeypatch.delenv("WORLD_SIZE")
    assert main(["sft", "configs/demo-sft.yaml", "--world-size", "2"]) == 2
    assert "--world-size goes with --plan" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:  # argparse's usage error
        main(["sft", "configs/demo-sft.yaml", "--plan", "--world-size", "0"])
    assert usage.value.code == 2 and "--world-size: 0: must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("preset,method,extra", [
    ("tiny", "full", []), ("tiny", "lora", []),
    ("tiny", "lora", [r"precision.overrides=[{pattern: 'self_attn\.q_proj', compute: fp32}]"]),
    ("tiny-moe", "lora", ["tiers.language.experts=true"])], ids=["full", "lora", "lora-fp32-override", "moe-experts"])
@pytest.mark.parametrize("master", ["fp32", "optimizer"])
def test_grpo_rollout_weight_copies_equal_the_copies_a_rollout_makes(tmp_path, preset, method, extra, master):
    """fp32 masters (in the model, or in the optimizer beside bf16 working weights): the estimate's
    rollout copies equal the bytes of the bf16 copies that PrecisionPolicy.inference_weights really
    makes (full: the trained linears; LoRA: the adapters' A and B, the fused experts' too, but not
    those an fp32 compute override matches); none with bf16 masters."""
    from vlforge.config import GRPOConfig
    from vlforge.train.memory import format_memory
    from vlforge.train.trainable import setup_model

    overrides = [f"model.preset={preset}", "train.device=cpu", f"tiers.method={method}", "precision.mode=bf16",
                 f"precision.master_weights={master}", f"train.output_dir={tmp_path}", *extra]
    cfg = load_config(GRPOConfig, None, overrides)
    meta, _ = build_meta_model(cfg.model)
    est = memory_estimate(meta, build_plan(meta, cfg.tiers), cfg)
    t = setup_model(cfg)
    with t.policy.inference_weights(t.model):  # makes the copies (kept on the masters)
        pass
    made = sum(p._inference_copy.numel() * p._inference_copy.element_size()
               for p in t.model.parameters() if hasattr(p, "_inference_copy"))
    assert made > 0 and est["rollout_weight_copies"] == made
    assert "GRPO rollouts: + " in format_memory(est)
    bf16 = load_config(GRPOConfig, None, [*overrides, "precision.master_weights=compute"])
    assert memory_estimate(meta, build_plan(meta, bf16.tiers), bf16)["rollout_weight_copies"] == 0


def test_grpo_rollout_copies_leave_out_fp8_linears(meta_8b):
    """FP8's converted linears are not exact nn.Linear layers: inference_weights makes no copy of
    them (a GPU-only path), so the estimate leaves exactly their weights out."""
    from vlforge.config import GRPOConfig
    from vlforge.train.fp8 import fp8_layer_plan

    _, model, _ = meta_8b
    cfg = load_config(GRPOConfig, None, FULL_8B)
    plan = build_plan(model, cfg.tiers)
    plain = memory_estimate(model, plan, cfg)["rollout_weight_copies"]
    cfg.precision.fp8.enabled = True
    converted = [n for n, d in fp8_layer_plan(model, cfg.precision.fp8).items() if d.convert]
    assert len(converted) > 100  # the decoder layers' projections
    fp8 = memory_estimate(model, plan, cfg)["rollout_weight_copies"]
    assert plain - fp8 == 2 * sum(model.get_submodule(n).weight.numel() for n in converted)


def test_cli_plan_settles_master_weights_auto_as_a_gpu_run_would(capsys):
    """--plan shows what master_weights=auto chooses on the GPUs it plans for, and counts it: masters in
    the optimizer for full bf16 SFT on one process (with gradient accumulation, their fp32 gradient
    sums), fp32 masters for LoRA or several processes, each with its reason."""
    full = ["precision.mode=bf16", "tiers.method=full", "train.grad_accum=2"]
    assert main(["sft", "configs/demo-sft.yaml", "--plan", "--json", *full]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["precision"]["master_weights_auto"].startswith("precision.master_weights auto: optimizer")
    assert out["memory"]["master_weights"] == "fp32 (in the optimizer)" and out["memory"]["held_gradient_sums"] > 0
    for extra, why in ((["tiers.method=lora"], "tiers.method=lora"), (["--world-size", "2"], "fsdp2")):
        assert main(["sft", "configs/demo-sft.yaml", "--plan", "--json", *full, *extra]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["precision"]["master_weights_auto"].startswith("precision.master_weights auto: fp32")
        assert why in out["precision"]["master_weights_auto"] and out["memory"]["held_gradient_sums"] == 0
    assert main(["sft", "configs/demo-sft.yaml", "--plan", *full]) == 0
    assert "precision.master_weights auto: optimizer" in capsys.readouterr().out
