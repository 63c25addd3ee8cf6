"""GRPO's update on packed responses (rl.packing): the same numbers as the padded batch.

Tiny model, fp32, CPU. A rollout with unequal prompt lengths (0-3 images of three sizes, text-only
prompts) and unequal response lengths: packed log-probs, entropy, reference log-probs, gradients of
a GRPO loss and the MoE router loss equal the padded path's; the packed forward sees each
sequence's own M-RoPE positions; one GRPO step end to end gives the same loss and weights.
"""

import copy
import json

import pytest
import torch
from safetensors.torch import load_file

from vlforge.generate.engine import Engine
from vlforge.config import ConfigError, DataConfig, GRPOConfig, ModelConfig, RolloutConfig, SFTConfig, load_config
from vlforge.data.dataset import load_dataset
from vlforge.data.encode import collate, encode_prompt
from vlforge.train.moe import Routing, capture
from vlforge.model.load import load_model
from vlforge.model.tiers import apply_plan, build_plan, unwrap
from vlforge.recipes.grpo import run_grpo
from vlforge.rollout.minibatch import token_rows
from vlforge.rl import kl_penalty, policy_loss
from vlforge.rollout import logprobs as rollout_logprobs
from vlforge.rollout.groups import generate_groups
from vlforge.rollout.logprobs import PackedLayout, packing_enabled, sequence_logprobs

from test_grpo import grpo_config

IMAGES_PER_PROMPT = [2, 0, 3, 1, 0]
RESPONSE_LENGTHS = [1, 6, 3, 5, 2, 6, 4, 1, 6, 2]  # G = 2: 10 sequences


def mixed_rollout(model, processor, path):
    """A rollout of the 5 prompts x 2, its responses cut to RESPONSE_LENGTHS (as EOS would cut them)."""
    data = load_dataset(str(path), processor, DataConfig())
    prompts = collate([encode_prompt(data.encoder, s) for s in data.samples], data.encoder.pad_id, left_pad=True)
    assert len(set(prompts["attention_mask"].sum(1).tolist())) == 5  # unequal prompt lengths
    torch.manual_seed(0)
    rollout = generate_groups(Engine(model), data.encoder, prompts, IMAGES_PER_PROMPT,
                              RolloutConfig(group_size=2, max_new_tokens=6, temperature=1.0))
    assert rollout.response_ids.shape == (10, 6)
    for n, length in enumerate(RESPONSE_LENGTHS):
        rollout.response_mask[n, length:] = 0
        rollout.response_ids[n, length:] = data.encoder.pad_id
        rollout.logprobs[n, length:] = 0.0
    return rollout


@pytest.fixture(scope="module")
def tiny_rollout(tiny, prompts_jsonl):
    model = copy.deepcopy(tiny[0]).eval()
    return model, mixed_rollout(model, tiny[1], prompts_jsonl)


def language_model_positions(model, fn):
    """(fn's result, the position_ids every language-model forward inside it received)."""
    seen = []
    lm = unwrap(model).model.language_model
    handle = lm.register_forward_pre_hook(lambda mod, args, kwargs: seen.append(kwargs["position_ids"]),
                                          with_kwargs=True)
    try:
        return fn(), seen
    finally:
        handle.remove()


@pytest.mark.parametrize("seq_index", [None, [2, 3, 8, 9], [9, 2, 3]], ids=["all", "text-only", "reordered"])
def test_packed_logprobs_and_entropy_equal_the_padded(tiny_rollout, seq_index):
    model, rollout = tiny_rollout
    with torch.no_grad():
        (padded, ent_padded), pos_padded = language_model_positions(
            model, lambda: sequence_logprobs(model, rollout, 0.7, seq_index, with_entropy=True))
        (packed, ent_packed), pos_packed = language_model_positions(
            model, lambda: sequence_logprobs(model, rollout, 0.7, seq_index, with_entropy=True, packing=True))
    seqs = list(range(10)) if seq_index is None else seq_index
    mask = rollout.response_mask[seqs].bool()
    assert packed.shape == padded.shape == mask.shape and int(mask.sum()) > len(seqs)
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent_packed, ent_padded, atol=1e-5, rtol=1e-5)
    assert bool((packed[~mask] == 0).all()) and bool((ent_packed[~mask] == 0).all())
    # the packed forward is one row of real tokens only, and each token gets the padded batch's
    # M-RoPE position: the image positions restart with every sequence
    prompt_mask = rollout.prompt_mask[[rollout.prompt_of_seq[s] for s in seqs]]
    real = torch.cat([prompt_mask, rollout.response_mask[seqs]], dim=1).bool()
    (padded_3nT,), (packed_41T,) = pos_padded, pos_packed
    assert packed_41T.shape == (4, 1, int(real.sum()))
    assert torch.equal(packed_41T[1:, 0], padded_3nT[:, real])


def test_packed_rollout_logprobs_match_the_rollouts(tiny_rollout):
    """The trainer's packed recomputation is the rollout policy's (ratio 1 on-policy)."""
    model, rollout = tiny_rollout
    with torch.no_grad():
        logp, _ = sequence_logprobs(model, rollout, 1.0, packing=True)
    mask = rollout.response_mask.bool()
    torch.testing.assert_close(logp[mask], rollout.logprobs[mask], atol=1e-5, rtol=1e-5)


def test_packed_images_are_encoded_once_per_prompt(tiny_rollout):
    model, rollout = tiny_rollout
    seen = []
    handle = model.model.visual.register_forward_hook(
        lambda mod, args, kwargs, out: seen.append(int(kwargs["grid_thw"].shape[0])), with_kwargs=True)
    try:
        with torch.no_grad():
            sequence_logprobs(model, rollout, 1.0, packing=True)  # 10 sequences, 6 images over 3 prompts
            sequence_logprobs(model, rollout, 1.0, [0, 1, 6, 7], packing=True)  # prompts 0 and 3
            sequence_logprobs(model, rollout, 1.0, [2, 3], packing=True)  # text-only: no vision pass
    finally:
        handle.remove()
    assert seen == [6, 3]


def _grpo_loss(model, rollout, ref_logp, packing, keep_vision=False):
    logp, _ = sequence_logprobs(model, rollout, 0.7, with_entropy=True, packing=packing, keep_vision=keep_vision)
    mask = rollout.response_mask.float()
    adv = torch.linspace(-1.0, 1.0, len(mask), device=mask.device)
    loss, _ = policy_loss(logp, rollout.logprobs - 0.05, adv, mask)  # ratio != 1: the clip binds somewhere
    return loss + 0.1 * (kl_penalty(logp, ref_logp, "k3") * mask).sum() / mask.sum()


def _grads(model, fn):
    model.zero_grad(set_to_none=True)
    loss = fn()
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("method", ["lora", "full"])
def test_grpo_loss_gradients_equal_the_padded(tiny, tiny_rollout, method):
    _, rollout = tiny_rollout
    model = copy.deepcopy(tiny[0])
    if method == "lora":  # a trained adapter; the reference is the adapter-disabled model
        model = apply_plan(model, build_plan(model, load_config(SFTConfig, None, ["tiers.vision.train=true"]).tiers))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(std=0.05)
    model.eval()
    refs = {}
    for packing in (False, True):
        with torch.no_grad():
            if method == "lora":
                with model.disable_adapter():
                    refs[packing] = sequence_logprobs(model, rollout, 0.7, packing=packing)[0]
            else:
                refs[packing] = sequence_logprobs(tiny[0], rollout, 0.7, packing=packing)[0] - 0.02
    torch.testing.assert_close(refs[True], refs[False], atol=1e-5, rtol=1e-5)
    loss_padded, padded = _grads(model, lambda: _grpo_loss(model, rollout, refs[False], False))
    loss_packed, packed = _grads(model, lambda: _grpo_loss(model, rollout, refs[False], True))
    assert loss_packed == pytest.approx(loss_padded, rel=1e-5, abs=1e-6)
    assert padded.keys() == packed.keys() and any("visual" in n for n in padded) and len(padded) > 10
    for n in padded:
        torch.testing.assert_close(packed[n], padded[n], atol=1e-5, rtol=1e-4, msg=n)


def test_keep_vision_on_a_text_only_packed_part(tiny, tiny_rollout):
    """Sharded runs: a text-only part still runs the vision tower (exact zero gradients)."""
    _, rollout = tiny_rollout
    model = copy.deepcopy(tiny[0]).eval()
    grads = {}
    for packing in (False, True):
        model.zero_grad(set_to_none=True)
        logp, _ = sequence_logprobs(model, rollout, 1.0, [2, 3, 8, 9], keep_vision=True, packing=packing)
        logp.sum().backward()
        grads[packing] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    visual = [n for n in grads[True] if ".visual." in f".{n}"]
    assert visual and all(not grads[True][n].any() for n in visual)
    for n in grads[False]:
        torch.testing.assert_close(grads[True][n], grads[False][n], atol=1e-5, rtol=1e-4, msg=n)


def test_moe_packed_logprobs_router_loss_and_gradients_equal_the_padded(prompts_jsonl):
    model, processor = load_model(ModelConfig(preset="tiny-moe"))
    model.eval()
    rollout = mixed_rollout(model, processor, prompts_jsonl)
    routing = Routing.of(model, coef=1.0)
    results = {}
    for packing in (False, True):
        model.zero_grad(set_to_none=True)
        seqs = list(range(10))
        with capture(routing, token_rows(rollout, seqs, packing)) as routed:
            logp, _ = sequence_logprobs(model, rollout, 1.0, packing=packing)
        aux = routed.aux_loss()
        mask = rollout.response_mask.float()
        ((logp * mask).sum() / mask.sum() + aux).backward()
        results[packing] = (logp.detach(), float(aux.detach()), routed.counts(),
                            {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    routing.remove()
    (logp0, aux0, counts0, grads0), (logp1, aux1, counts1, grads1) = results[False], results[True]
    torch.testing.assert_close(logp1, logp0, atol=1e-5, rtol=1e-5)
    assert aux1 == pytest.approx(aux0, rel=1e-5)
    assert torch.equal(counts1, counts0)  # the same tokens routed to the same experts, padding not counted
    assert any(".gate." in n for n in grads0)
    for n in grads0:
        torch.testing.assert_close(grads1[n], grads0[n], atol=1e-5, rtol=1e-4, msg=n)


def test_packed_layout_keeps_real_tokens_in_sequence_order():
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1], [0, 0, 1, 0, 0]])
    ids = torch.arange(15).view(3, 5)
    layout = PackedLayout.of(mask)
    assert layout.seq_lens == [3, 5, 1]
    assert layout.pack(ids).tolist() == [[1, 2, 3, 5, 6, 7, 8, 9, 12]]
    assert layout.row_index_nT.tolist() == [[-1, 0, 1, 2, -1], [3, 4, 5, 6, 7], [-1, -1, 8, -1, -1]]


def test_auto_packing_is_on_where_attention_runs_per_sample(tiny):
    model = copy.deepcopy(tiny[0])
    assert packing_enabled(model, "auto") and not packing_enabled(model, False) and packing_enabled(model, True)
    eager = copy.deepcopy(model)
    eager.model.language_model.config._attn_implementation = "eager"
    assert not packing_enabled(eager, "auto")
    with pytest.raises(ConfigError, match="rl.packing"):
        load_config(GRPOConfig, None, ["rl.packing=sometimes"])


@pytest.mark.parametrize("method,extra", [("lora", []), ("full", ["activation_checkpointing.enabled=true"])])
def test_one_grpo_step_with_packing_equals_without(shapes_dir, tmp_path, monkeypatch, method, extra):
    """Two mini-batch updates (8 sequences, mini-batches of 4), KL to the reference, through run_grpo;
    under activation checkpointing the packed row's sequences reach the recomputed layers too."""
    calls = []
    real = rollout_logprobs._packed_hidden
    monkeypatch.setattr(rollout_logprobs, "_packed_hidden", lambda *a, **k: calls.append(1) or real(*a, **k))
    rows, weights = {}, {}
    for packing in ("false", "true"):
        out = tmp_path / packing
        run_grpo(grpo_config(shapes_dir, out, tmp_path, f"tiers.method={method}", "rl.kl_beta=0.1",
                             f"rl.packing={packing}", "train.save_every=1", "train.seed=3", *extra))
        rows[packing] = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
        name = "adapter_model.safetensors" if method == "lora" else "model.safetensors"
        weights[packing] = load_file(out / "checkpoint-1" / name)
        if packing == "false":
            assert not calls
    assert len(calls) == 3  # the packed run's forwards: the reference's (one for the round), 2 mini-batches
    off, on = rows["false"], rows["true"]
    assert off["skipped"] == 0 and abs(off["loss"]) > 0 and off["kl"] > 0
    for key in ("loss", "kl", "entropy", "ratio_mean", "clip_frac", "grad_norm"):
        assert on[key] == pytest.approx(off[key], rel=1e-4, abs=1e-6), key
    assert weights["true"].keys() == weights["false"].keys()
    for n in weights["false"]:  # Adam's first step is about lr x sign(g): a few near-zero gradient entries may flip
        diff = (weights["true"][n] - weights["false"][n]).abs()
        flipped = int((diff > 1e-5).sum())
        assert diff.mean() < 1e-6 and flipped <= max(2, diff.numel() // 1000), (n, flipped, diff.max(), diff.mean())


@pytest.mark.gpu
def test_packed_update_on_cuda_runs_varlen_and_matches_padded_in_bf16(tiny, tiny_rollout, monkeypatch):
    """On CUDA in bf16 the packed forward runs torch's varlen_attn (counted: not the per-sample
    fallback) and gives the padded batch's log-probs and GRPO-loss gradients within bf16 tolerance."""
    import dataclasses

    from vlforge.train import packed_attention

    _, cpu_rollout = tiny_rollout
    rollout = dataclasses.replace(cpu_rollout, **{f.name: getattr(cpu_rollout, f.name).to("cuda")
                                                  for f in dataclasses.fields(cpu_rollout)
                                                  if torch.is_tensor(getattr(cpu_rollout, f.name))})
    model = copy.deepcopy(tiny[0]).to("cuda", torch.bfloat16).eval()
    calls = []
    real = packed_attention._varlen_call
    monkeypatch.setattr(packed_attention, "_varlen_call", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        ref = sequence_logprobs(model, rollout, 0.7)[0]
    loss_pad, grads_pad = _grads(model, lambda: _grpo_loss(model, rollout, ref, False))
    assert not calls
    loss_pack, grads_pack = _grads(model, lambda: _grpo_loss(model, rollout, ref, True))
    assert len(calls) == model.config.text_config.num_hidden_layers
    assert loss_pack == pytest.approx(loss_pad, rel=2e-2, abs=1e-3)
    with torch.no_grad():
        a, b = (sequence_logprobs(model, rollout, 0.7, packing=p)[0].float() for p in (True, False))
    assert (a - b).norm() <= 2e-2 * b.norm()
    for name in grads_pad:
        g, h = grads_pack[name].float(), grads_pad[name].float()
        assert (g - h).norm() <= 5e-2 * h.norm() + 1e-6, name
