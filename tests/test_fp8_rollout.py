"""rollout.precision=fp8 (generate/fp8.py, rollout/precision.py): GRPO's rollouts run the decoder
projections on FP8 copies of the trained weights (torch._scaled_mm, row-wise scales), refreshed before
every step's rollouts, with LoRA deltas merged in; the trainer's parameters untouched; the
rollout/trainer mismatch reported. Real GRPO runs of the tiny model on the CPU (torch._scaled_mm has
a CPU kernel), and on a GPU the 2B architecture."""

import copy
import json
from contextlib import nullcontext

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from test_grpo import grpo_config
from vlforge.generate.fp8 import Fp8Projections, fp8_projections, quantize_rows
from vlforge.model.tiers import unwrap
from vlforge.recipes import grpo as recipe


class CountScaledMM(TorchDispatchMode):
    """Counts the FP8 GEMMs (aten._scaled_mm) run inside."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._scaled_mm.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def dequantized(weight: torch.Tensor) -> torch.Tensor:
    q = quantize_rows(weight)
    return q.qdata.float() * q.scale


def projections(core):
    """(name, module) of every decoder projection the FP8 copies cover (a LoRA layer where peft wrapped one)."""
    out = []
    for i, layer in enumerate(core.model.language_model.layers):
        for owner, names in (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                             ("mlp", ("gate_proj", "up_proj", "down_proj"))):
            out += [(f"{i}.{owner}.{n}", getattr(getattr(layer, owner), n)) for n in names]
    return out


def merged_weight(module) -> torch.Tensor:
    """W + scale * B @ A written out from peft's layer parts (not through get_delta_weight), in fp32."""
    base = getattr(module, "base_layer", module)
    weight = base.weight.detach().float()
    if base is module:
        return weight
    for name in module.active_adapters:
        weight = weight + module.scaling[name] * (module.lora_B[name].weight.float() @ module.lora_A[name].weight.float())
    return weight


def run_spied(shapes_dir, tmp_path, name, monkeypatch, *overrides):
    """A GRPO run whose every rollout round is observed: the FP8 GEMMs it ran, its sampled tokens, the
    trainer's parameters just before and after it, and (fp8) how each projection's FP8 copy compares to
    the quantized current weights. Returns (metric rows, per-round records, the Trainable)."""
    captured, rounds = {}, []
    setup, real_round, real_groups = recipe.setup_model, recipe.rollout_round, recipe.generate_groups

    def capture(c, **kwargs):
        captured["t"] = setup(c, **kwargs)
        return captured["t"]

    def observed_groups(model, *args, **kwargs):
        calls = []  # the language model's forwards: the prefill and every decode step
        hook = unwrap(model).model.language_model.layers[0].register_forward_pre_hook(lambda *_: calls.append(1))
        with CountScaledMM() as counted:
            rollout = real_groups(model, *args, **kwargs)
        hook.remove()
        rounds[-1].update(scaled_mm=counted.count, forwards=len(calls), rollout=rollout)
        return rollout

    def observed_round(t, *args, **kwargs):
        before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
        copies = fp8_projections(t.model, made=False)
        record = {"before": before, "fresh": None if copies is None else all(
            torch.equal(copies.copy_of(m), dequantized(merged_weight(m))) for _, m in projections(unwrap(t.model)))}
        rounds.append(record)
        out = real_round(t, *args, **kwargs)
        record["after"] = {n: p.detach().clone() for n, p in t.model.named_parameters()}
        return out

    monkeypatch.setattr(recipe, "setup_model", capture)
    monkeypatch.setattr(recipe, "rollout_round", observed_round)
    monkeypatch.setattr(recipe, "generate_groups", observed_groups)
    cfg = grpo_config(shapes_dir, tmp_path / name, tmp_path, *overrides)
    recipe.run_grpo(cfg)
    monkeypatch.undo()
    rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return rows, rounds, captured["t"]


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_an_fp8_rollout_runs_the_projections_as_fp8_gemms_and_leaves_the_trainer_untouched(
        shapes_dir, tmp_path, monkeypatch, precision):
    """fp8: the rollout's prefill and decode steps run 4 FP8 GEMMs a decoder layer a forward (q/k/v
    and gate/up fused, o and down), bf16 none; its tokens are valid samples; the trainer's parameters
    are the same bits after the rollout as before it."""
    rows, rounds, t = run_spied(shapes_dir, tmp_path, precision, monkeypatch, "tiers.method=full",
                                f"rollout.precision={precision}")
    layers = len(unwrap(t.model).model.language_model.layers)
    (r,) = rounds
    if precision == "fp8":
        assert r["forwards"] > 1 and r["scaled_mm"] == r["forwards"] * 4 * layers
        assert rows[0]["rollout/fp8_refresh_s"] >= 0
    else:
        assert r["scaled_mm"] == 0 and "rollout/fp8_refresh_s" not in rows[0]
    for n, p in r["before"].items():
        assert torch.equal(p, r["after"][n]) and p.dtype == r["after"][n].dtype, n
    rollout, vocab = r["rollout"], unwrap(t.model).config.text_config.vocab_size
    on = rollout.response_mask.bool()
    ids = rollout.response_ids[on]
    assert on[:, 0].all() and ((ids >= 0) & (ids < vocab)).all()
    assert not torch.isin(ids, torch.tensor(rollout.banned_ids)).any()
    logp = rollout.logprobs[on]
    assert torch.isfinite(logp).all() and (logp <= 0).all()


def test_each_rollouts_fp8_copies_are_made_from_the_weights_of_that_step(shapes_dir, tmp_path, monkeypatch):
    """Two steps of full fine-tuning: each step's rollout reads FP8 copies equal to the quantized weights
    the trainer has then (the second step's: after the first optimizer step, which moved them), and
    every step logs the refresh's time."""
    rows, rounds, _ = run_spied(shapes_dir, tmp_path, "run", monkeypatch, "tiers.method=full",
                                "rollout.precision=fp8", "train.max_steps=2")
    assert len(rows) == 2 and all(row["rollout/fp8_refresh_s"] >= 0 for row in rows)
    first, second = rounds
    moved = [n for n in first["before"] if "language_model.layers" in n and "proj" in n
             and not torch.equal(first["before"][n], second["before"][n])]
    assert moved  # the first update changed the projections
    assert first["fresh"] and second["fresh"]


@pytest.mark.parametrize("method,extra", [("lora", []), ("full", []), ("full", ["precision.mode=bf16"])])
def test_a_grpo_step_with_fp8_rollouts_reports_a_small_mismatch_and_trains_exactly_the_trainable_params(
        shapes_dir, tmp_path, monkeypatch, method, extra):
    """rollout.precision=fp8 with the trainer's old log-probs and TIS: rollout/k3_kl between the FP8
    rollout's log-probs and the trainer's is reported, above what the same weights give without FP8 and
    below 1e-4 (measured on the tiny model, seed 1: fp8 1.7e-5 (LoRA), 1.9e-5 (full, fp32 and bf16);
    bf16 rollouts 0 in fp32, 3.3e-8 under bf16 autocast); the step changes exactly the trainable
    parameters (LoRA: A and B, with two mini-batches)."""
    rows, rounds, t = run_spied(shapes_dir, tmp_path, "run", monkeypatch, f"tiers.method={method}", "train.seed=1",
                                "rollout.precision=fp8", "rl.old_logprobs=trainer", "rl.rollout_correction.method=tis",
                                *extra)
    row = rows[0]
    assert 1e-6 < row["rollout/k3_kl"] < 1e-4, row["rollout/k3_kl"]
    assert "rollout/fp8_refresh_s" in row and "rollout/corrected_frac" in row
    before = rounds[0]["before"]  # the parameters before the step (the rollout leaves them as they are)
    for n, p in t.model.named_parameters():
        changed = not torch.equal(before[n], p.detach())
        assert changed == p.requires_grad, f"{n}: trainable={p.requires_grad} changed={changed}"


def test_a_lora_layers_fp8_copy_is_the_quantized_merged_weight(tiny):
    """Every LoRA layer's FP8 copy is quantize(W + scale * B @ A) (B made non-zero: at init the delta is
    0), not quantize(W); a forward on the copies is close to the merged model's; the adapters and the
    base weights are the trainer's, unchanged."""
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(copy.deepcopy(tiny[0]), LoraConfig(r=4, lora_alpha=8, target_modules=targets)).eval()
    torch.manual_seed(0)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.05)
    core = unwrap(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    copies = Fp8Projections(core)
    assert len(copies.groups) == 4 * len(core.model.language_model.layers)
    for name, module in projections(core):
        assert hasattr(module, "lora_A"), name  # peft's lora.Linear
        assert torch.equal(copies.copy_of(module), dequantized(merged_weight(module))), name
        assert not torch.equal(copies.copy_of(module), dequantized(module.base_layer.weight)), name
    ids = torch.randint(0, core.config.text_config.vocab_size, (2, 9))
    with torch.no_grad():
        with copies.installed():
            fp8 = core.lm_head(core.model.language_model(input_ids=ids).last_hidden_state)
        merged = copy.deepcopy(model).merge_and_unload()
        want = merged.lm_head(merged.model.language_model(input_ids=ids).last_hidden_state)
        with model.disable_adapter():
            base = core.lm_head(core.model.language_model(input_ids=ids).last_hidden_state)
    # measured: 6.5% of the logits' norm off the merged model's, the base model 80% (FP8's 3 mantissa bits)
    assert (fp8 - want).norm() < 0.1 * want.norm() and (fp8 - want).norm() < 0.2 * (base - want).norm()
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) and p.requires_grad == ("lora_" in n), n


def test_moe_experts_keep_their_weights_and_the_attention_runs_in_fp8(tiny_moe):
    """On a mixture-of-experts model the copies cover each layer's attention projections (2 groups a
    layer: q/k/v and o); the fused expert stacks and the routers are not copied."""
    core = copy.deepcopy(tiny_moe[0]).eval()
    copies = Fp8Projections(core)
    layers = core.model.language_model.layers
    assert len(copies.groups) == 2 * len(layers)
    covered = {id(w) for g in copies.groups for w in g.wrappers}
    assert all(id(layer.self_attn.q_proj) in covered and id(layer.mlp.gate) not in covered for layer in layers)
    ids = torch.randint(0, core.config.text_config.vocab_size, (2, 5))
    with torch.no_grad(), copies.installed(), CountScaledMM() as counted:
        core.model.language_model(input_ids=ids)
    assert counted.count == 2 * len(layers)


def test_the_compiled_decode_step_runs_the_fp8_copies(tiny, shapes_dir, monkeypatch):
    """The engine's compiled step (torch.compile, as rollout.compile runs it on CUDA; here the aot_eager
    backend on the CPU) traces the FP8 groups: the tokens and log-probs of the eager FP8 steps, which
    differ from the bf16 weights' log-probs."""
    from helpers import compiled_on_cpu
    from vlforge.config import DataConfig
    from vlforge.data.dataset import load_dataset
    from vlforge.data.encode import encode_prompt
    from vlforge.generate import engine as engines
    from vlforge.generate.fp8 import decoding_in_fp8
    from vlforge.generate.forward import vision_token_ids
    from vlforge.generate.requests import GenRequest, Prompt

    model = copy.deepcopy(tiny[0]).eval()
    data = load_dataset(str(shapes_dir / "train.jsonl"), tiny[1], DataConfig())
    enc = data.encoder
    requests = [GenRequest(Prompt(x["input_ids"], x.get("pixel_values"), x.get("image_grid_thw")), n=2,
                           max_new_tokens=8, temperature=1.0, seed=3, first_row=2 * i)
                for i, x in enumerate(encode_prompt(enc, s) for s in data.samples[:3])]
    copies = Fp8Projections(model)

    def run(engine, fp8: bool, compile: bool = False):
        monkeypatch.setitem(engines._ENGINES, model, engine)  # the engine decoding_in_fp8 switches
        with decoding_in_fp8(model, copies) if fp8 else nullcontext():
            return engine.generate(requests, stop_ids=[], banned_ids=vision_token_ids(enc),
                                   image_token_id=enc.image_token_id, pad_id=enc.pad_id, compile=compile)

    plain = run(engines.Engine(model), False)
    eager = run(engines.Engine(model), True)
    compiled_engine = compiled_on_cpu(engines.Engine(model, compile=True), monkeypatch)
    compiled = run(compiled_engine, True, compile=True)
    assert compiled_engine.plan.compiled and compiled_engine.plan.fp8 and compiled_engine.compile_failure is None
    for a, b, c in zip(eager, compiled, plain):
        assert torch.equal(a.tokens, b.tokens)
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
    assert any(not torch.equal(a.logprobs, c.logprobs) for a, c in zip(eager, plain))


def rollout_mismatch(model, data, precision: str, prompts: int = 4, group: int = 4, tokens: int = 32) -> float:
    """rollout/k3_kl of one rollout round of `model` at `precision`: the mean k3 over response tokens
    between the rollout's log-probs and the model's own teacher-forced ones (the trainer's)."""
    from vlforge.config import RolloutConfig
    from vlforge.data.encode import collate, encode_prompt, visuals_per_prompt
    from vlforge.rl.correction import mismatch_stats
    from vlforge.rollout.groups import generate_groups
    from vlforge.rollout.logprobs import sequence_logprobs
    from vlforge.rollout.precision import rollout_precision

    device = next(model.parameters()).device
    cfg = RolloutConfig(group_size=group, max_new_tokens=tokens, temperature=1.0, compile=False, precision=precision)
    encoded = [encode_prompt(data.encoder, s) for s in data.samples[:prompts]]
    batch = {k: v.to(device) for k, v in collate(encoded, data.encoder.pad_id, left_pad=True).items()}
    with torch.no_grad():
        with rollout_precision(model, cfg):
            rollout = generate_groups(model, data.encoder, batch, [visuals_per_prompt(x) for x in encoded], cfg,
                                      seed=3)
        logp, _ = sequence_logprobs(model, rollout, cfg.temperature)
    stats = mismatch_stats(logp.float(), rollout.logprobs.float(), rollout.response_mask)
    return float(stats["k3_kl_sum"] / stats["tokens"])


@pytest.mark.gpu
def test_fp8_rollouts_of_the_2b_architecture_stay_within_a_kl_of_the_trainers_logprobs(shapes_dir):
    """The 2B architecture (random weights, bf16) on a GPU with FP8 GEMMs: an FP8 rollout's tokens, scored
    by the bf16 model itself (the trainer), are within k3 KL 0.1 of the rollout's log-probs, and further
    than a bf16 rollout's (the FP8 path acted). The bound is 2.5x what this function measured on the
    CPU (torch._scaled_mm's reference kernel; 2 prompts x 2 samples x 16 tokens, 2026-12-07): fp8 4.0e-2,
    bf16 3.3e-4. Random weights are FP8's worst case (no structure for the 3-bit mantissa's noise to
    hide under); the issue's 1e-3 is a target for trained weights after rollout correction, which only
    a GPU run of a trained checkpoint can check (docs/benchmarks.md)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMMs need a CUDA device of compute capability >= 8.9")
    from vlforge.config import DataConfig, ModelConfig
    from vlforge.data.dataset import load_dataset
    from vlforge.model.load import load_model

    model, processor = load_model(ModelConfig(preset="qwen3vl-2b"), dtype=torch.bfloat16, device=torch.device("cuda"))
    model.eval().requires_grad_(False)
    data = load_dataset(str(shapes_dir / "train.jsonl"), processor, DataConfig())
    bf16, fp8 = rollout_mismatch(model, data, "bf16"), rollout_mismatch(model, data, "fp8")
    print(f"2B k3 KL rollout vs trainer: bf16 {bf16:.3g}, fp8 {fp8:.3g}")  # -s shows the numbers for docs
    assert bf16 < fp8 < 0.1
