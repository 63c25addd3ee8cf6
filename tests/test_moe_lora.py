"""Expert LoRA as activations (model/moe_lora.py) against peft's own folding forward, tiny-moe, fp32, CPU."""

import copy
import json

import pytest
import torch
from peft.tuners.lora.layer import ParamWrapper
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from vlforge.config import DataConfig, ModelConfig, SFTConfig, load_config
from vlforge.data.dataset import load_dataset
from vlforge.data.encode import collate
from vlforge.model.load import load_model
from vlforge.model.moe_lora import FusedExpertsLoRA, expert_wrapper, unfuse_expert_lora
from vlforge.model.tiers import apply_plan, build_plan, unwrap


@pytest.fixture(scope="module")
def batch(tiny_moe, shapes_dir):
    data = load_dataset(str(shapes_dir / "val.jsonl"), tiny_moe[1], DataConfig())
    b = collate([data[i] for i in range(3)], data.encoder.pad_id)
    return {k: v for k, v in b.items() if k != "labels"}


def _tiers(*overrides):
    return load_config(SFTConfig, None, ["tiers.language.experts=true", *overrides]).tiers


def _trained(model, *overrides, seed=0):
    """The plan applied to a copy of `model`, with every lora_B drawn (a trained adapter, not peft's zeros)."""
    model = copy.deepcopy(model)
    peft_model = apply_plan(model, build_plan(model, _tiers(*overrides)))
    torch.manual_seed(seed)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.1)
    return peft_model


def _experts(peft_model, layer=0):
    return unwrap(peft_model).model.language_model.layers[layer].mlp.experts


def _pair(tiny_moe, *overrides):
    """(fused, peft's path) on the same weights."""
    fused = _trained(tiny_moe[0], *[f"tiers.{t}.dropout=0" for t in ("language", "projector", "vision")], *overrides)
    reference = copy.deepcopy(fused)
    assert unfuse_expert_lora(reference) == 2 and type(_experts(reference)) is ParamWrapper
    assert type(_experts(fused)) is FusedExpertsLoRA
    return fused, reference


@pytest.mark.parametrize("kernel,r", [("eager", 8), ("grouped_mm", 8), ("grouped_mm", 2), ("batched_mm", 8)])
def test_logits_and_every_lora_gradient_equal_peft_path(tiny_moe, batch, kernel, r):
    """r=2 in fp32 (8-byte rows) takes the grouped GEMM's zero-padded rank."""
    fused, reference = _pair(tiny_moe, f"tiers.language.r={r}", "tiers.vision.train=true")
    results = []
    for m in (fused, reference):
        unwrap(m).set_experts_implementation(kernel)
        m.train()
        logits = m(**batch).logits
        (logits ** 2).mean().backward()
        results.append((logits.detach(), {n: p.grad for n, p in m.named_parameters() if p.requires_grad}))
    (ours, ours_grads), (theirs, their_grads) = results
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert any("experts" in n for n in their_grads) and any("self_attn" in n for n in their_grads)
    assert ours_grads.keys() == their_grads.keys()
    for n, g in their_grads.items():
        assert g is not None and g.abs().sum() > 0, n
        torch.testing.assert_close(ours_grads[n], g, rtol=1e-5, atol=1e-5, msg=n)


def test_disabled_adapters_give_the_base_model_and_merged_gives_unmerged(tiny_moe, batch):
    base = tiny_moe[0]
    fused = _trained(base).eval()
    with torch.no_grad():
        plain = base(**batch).logits
        unmerged = fused(**batch).logits
        assert (unmerged - plain).abs().max() > 1e-2  # the adapters matter
        with fused.disable_adapter():  # GRPO's reference forward
            torch.testing.assert_close(fused(**batch).logits, plain, rtol=1e-6, atol=1e-6)
        fused.merge_adapter()  # in place, wrappers kept: the update must not count twice
        assert all(w.merged for w in unwrap(fused).modules() if isinstance(w, ParamWrapper))
        torch.testing.assert_close(fused(**batch).logits, unmerged, rtol=1e-5, atol=1e-5)
        with fused.disable_adapter():  # unmerges, as peft's own forward does
            torch.testing.assert_close(fused(**batch).logits, plain, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(fused(**batch).logits, unmerged, rtol=1e-5, atol=1e-5)


def test_two_active_adapters_sum_as_in_peft(tiny_moe, batch):
    from peft import LoraConfig

    fused, reference = _pair(tiny_moe)
    for m in (fused, reference):
        cfg = copy.deepcopy(m.peft_config["default"])
        torch.manual_seed(1)  # the same lora_A draws in both
        m.add_adapter("second", LoraConfig(**{**cfg.to_dict(), "r": 4, "rank_pattern": {}, "alpha_pattern": {}}))
        torch.manual_seed(1)
        with torch.no_grad():
            for n, p in m.named_parameters():
                if "lora_B.second" in n:
                    p.normal_(std=0.1)
        m.base_model.set_adapter(["default", "second"])
    assert type(_experts(fused)) is FusedExpertsLoRA  # adding an adapter keeps the fused forward
    with torch.no_grad():
        both = fused(**batch).logits
        torch.testing.assert_close(both, reference(**batch).logits, rtol=1e-5, atol=1e-5)
        fused.base_model.set_adapter("default")
        assert (both - fused(**batch).logits).abs().max() > 1e-3  # the second one counted


class _RowHash(nn.Module):
    """A deterministic dropout stand-in: zeroes features by a hash of each input row's values, so a
    reference computed token by token applies the very mask the fused forward applied."""

    def forward(self, x):
        keep = torch.frac(x * 977.0).abs() > 0.3
        return x * keep / 0.7


def _reference_experts(experts_wrapper, h, idx, w):
    """Per token and top-k slot, from peft's raw factors: base + s * B_e A_e drop(x), drop on LoRA only."""
    experts = experts_wrapper.get_base_layer()
    out = torch.zeros_like(h)
    factors = {}
    for name in ("gate_up_proj", "down_proj"):
        layer = expert_wrapper(experts_wrapper, name)
        E, r = experts.num_experts, layer.r["default"]
        A = layer.lora_A["default"].weight.view(E, r, -1)  # peft: A [r*E, in], expert-major rows
        B = layer.lora_B["default"].weight.view(-1, r, E)  # B [out, r*E], expert-minor columns
        s = layer.scaling["default"]
        torch.testing.assert_close(torch.stack([B[:, :, e] @ A[e] for e in range(E)]) * s,
                                   layer.get_delta_weight("default"))  # the layout is peft's
        factors[name] = (getattr(experts, name), A, B, s, layer.lora_dropout["default"])

    def proj(x, name, e):
        W, A, B, s, drop = factors[name]
        return W[e] @ x + s * B[:, :, e] @ (A[e] @ drop(x))

    for t in range(h.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            gate, up = proj(h[t], "gate_up_proj", e).chunk(2)
            out[t] += w[t, j] * proj(experts.act_fn(gate) * up, "down_proj", e)
    return out


@pytest.mark.parametrize("kernel", ["eager", "grouped_mm", "batched_mm"])
def test_dropout_applies_to_each_pairs_lora_input_only(tiny_moe, kernel):
    """Exact against a per-(token, expert) reference with a deterministic mask; with nn.Dropout
    itself: eval mode is dropout-free, train mode draws from the seed."""
    model = _trained(tiny_moe[0], "tiers.language.dropout=0.3")
    unwrap(model).set_experts_implementation(kernel)
    wrapper = _experts(model)
    gu, down = expert_wrapper(wrapper, "gate_up_proj"), expert_wrapper(wrapper, "down_proj")
    assert isinstance(gu.lora_dropout["default"], nn.Dropout) and gu.lora_dropout["default"].p == 0.3
    torch.manual_seed(0)
    h = torch.randn(6, 64)
    idx = torch.stack([torch.randperm(8)[:2] for _ in range(6)])
    w = torch.rand(6, 2)
    with torch.no_grad():
        model.eval()
        no_dropout = wrapper(h, idx, w)
        model.train()
        torch.manual_seed(1)
        first = wrapper(h, idx, w)
        torch.manual_seed(1)
        torch.testing.assert_close(wrapper(h, idx, w), first, rtol=0, atol=0)
        assert (first - no_dropout).abs().max() > 1e-3
        for layer in (gu, down):
            layer.lora_dropout["default"] = _RowHash()
        torch.testing.assert_close(wrapper(h, idx, w), _reference_experts(wrapper, h, idx, w), rtol=1e-5, atol=1e-6)
        for layer in (gu, down):
            layer.lora_dropout["default"] = nn.Identity()
        torch.testing.assert_close(wrapper(h, idx, w), no_dropout, rtol=1e-6, atol=1e-6)


class _LargestAllocation(TorchDispatchMode):
    """The most elements any op's output allocated (fresh storage, not a view of an input)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                self.largest = max(self.largest, t.untyped_storage().nbytes() // t.element_size())
        return out


@pytest.mark.parametrize("kernel", ["eager", "grouped_mm"])
def test_no_expert_sized_tensor_is_allocated_forward_or_backward(tiny_moe, kernel):
    fused, reference = _pair(tiny_moe)
    experts = _experts(fused).get_base_layer()
    smallest = min(experts.gate_up_proj.numel(), experts.down_proj.numel())  # [E, out, in]
    torch.manual_seed(0)
    h = torch.randn(5, 64, requires_grad=True)
    idx = torch.stack([torch.randperm(8)[:2] for _ in range(5)])
    w = torch.rand(5, 2)
    largest = {}
    for name, m in (("fused", fused), ("peft", reference)):
        unwrap(m).set_experts_implementation(kernel)
        with _LargestAllocation() as mode:
            _experts(m)(h, idx, w).square().sum().backward()
        largest[name] = mode.largest
    assert largest["peft"] >= smallest  # the detector sees peft's folded copy
    assert largest["fused"] * 4 <= smallest, largest


def test_plan_dropout_memory_and_the_peft_escape_hatch(tiny_moe):
    from vlforge.train.memory import expert_lora_copies
    from vlforge.model.tiers import format_plan, plan_summary

    model = tiny_moe[0]
    cfg = load_config(SFTConfig, None, ["tiers.language.experts=true", "activation_checkpointing.enabled=true"])
    fused = build_plan(model, cfg.tiers)
    experts = [e for e in fused if e.target == "parameter"]
    assert {(e.expert_lora, e.dropout) for e in experts} == {("fused", cfg.tiers.language.dropout)}
    assert expert_lora_copies(model, fused, cfg, 2) == 0  # nothing folded
    assert "3-D experts, fused" in format_plan(plan_summary(model, fused))
    cfg = load_config(SFTConfig, None, ["tiers.language.experts=true", "tiers.expert_lora=peft",
                                        "activation_checkpointing.enabled=true"])
    plan = build_plan(model, cfg.tiers)
    assert {(e.expert_lora, e.dropout) for e in plan if e.target == "parameter"} == {("peft", 0.0)}
    assert expert_lora_copies(model, plan, cfg, 2) == 8 * 3 * 32 * 64 * 2  # one layer's experts, bf16
    cfg.activation_checkpointing.every = 2  # tiny-moe's 2 layers: layer 1 is not recomputed, so keeps its copy
    assert expert_lora_copies(model, plan, cfg, 2) == 2 * 8 * 3 * 32 * 64 * 2
    peft_model = apply_plan(copy.deepcopy(model), plan)
    assert type(_experts(peft_model)) is ParamWrapper  # peft's own forward


def test_other_kernels_are_refused_with_the_way_out(tiny_moe, batch):
    fused = _trained(tiny_moe[0])
    unwrap(fused).config.text_config._experts_implementation = "sonicmoe"
    with pytest.raises(ValueError, match="tiers.expert_lora=peft"):
        fused(**batch)


def test_grouped_fused_experts_trace_as_one_graph(tiny_moe):
    """The rollout engine compiles its decode step (rollout.compile): the fused experts forward
    must not break the graph (peft's parametrisation is registered and removed inside it)."""
    fused = _trained(tiny_moe[0]).eval()
    unwrap(fused).set_experts_implementation("grouped_mm")
    wrapper = _experts(fused)
    torch.manual_seed(0)
    h, idx, w = torch.randn(5, 64), torch.stack([torch.randperm(8)[:2] for _ in range(5)]), torch.rand(5, 2)
    compiled = torch.compile(wrapper, backend="eager", fullgraph=True)  # dynamo only: fails on a graph break
    with torch.no_grad():
        torch.testing.assert_close(compiled(h, idx, w), wrapper(h, idx, w), rtol=0, atol=0)


def test_sft_with_fused_expert_lora_under_fsdp2_and_gradient_checkpointing_matches_peft(shapes_dir, tmp_path):
    """Two SFT steps: fused (FSDP2 at world size 1, recomputed layers) and peft's path give the
    same losses and the same trained adapter."""
    from safetensors.torch import load_file

    from helpers import tiny_sft_config
    from vlforge.model.export import export
    from vlforge.recipes.sft import run_sft

    common = ["model.preset=tiny-moe", "tiers.method=lora", "tiers.language.experts=true", "data.val=null",
              "tiers.language.lr=0.01", "train.save_every=2", "optim.schedule=constant",
              *[f"tiers.{t}.dropout=0" for t in ("language", "projector", "vision")]]
    runs = {"peft": ["tiers.expert_lora=peft"],
            "fused": ["distributed.strategy=fsdp2", "activation_checkpointing.enabled=true"]}
    for name, extra in runs.items():
        run_sft(tiny_sft_config(shapes_dir, tmp_path / name, *common, *extra))
    loss = {name: [json.loads(line)["loss"] for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()
                   if "loss" in json.loads(line)] for name in runs}
    assert len(loss["fused"]) == 2 and loss["fused"] == pytest.approx(loss["peft"], rel=1e-5)
    # the sharded checkpoint consolidates (its plan re-applied, fused) and merges as peft's does
    export(tmp_path / "fused" / "checkpoint-2", tmp_path / "fused-merged", dtype=torch.float32)
    export(tmp_path / "peft" / "checkpoint-2", tmp_path / "peft-merged", merge=True, dtype=torch.float32)
    ours, theirs = (load_file(tmp_path / f"{name}-merged" / "model.safetensors") for name in ("fused", "peft"))
    base = load_model(ModelConfig(preset="tiny-moe"))[0].state_dict()
    assert ours.keys() == theirs.keys()
    expert = "model.language_model.layers.0.mlp.experts.down_proj"
    assert (theirs[expert] - base[expert]).abs().max() > 1e-3  # the experts trained
    for k in theirs:  # two Adam steps at lr 0.01 amplify fp32 rounding to ~2e-6, against updates of >1e-3
        torch.testing.assert_close(ours[k], theirs[k], rtol=1e-4, atol=1e-5, msg=k)
