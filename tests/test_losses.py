"""Chunked / fused lm_head + cross-entropy and GRPO log-probs against the plain computation.

fp32 and bf16 (autocast, as training runs), loss/log-probs/entropy and gradients; and the point of
the chunking: lm_head never produces more than [chunk, V] logits, in forward or in backward.
"""

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from vlforge.config import ConfigError
from vlforge.train.losses import (liger_chunk_mem_const, linear_cross_entropy_sum, resolve_loss_impl,
                                   token_logprobs_entropy)

N, H, V = 53, 24, 97


def _inputs(seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(H, V, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g) * 0.3)
    hidden = torch.randn(N, H, generator=g).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=g)
    return head.to(device), hidden.detach().to(device).requires_grad_(), targets.to(device)


def _grads(fn, head, hidden):
    head.zero_grad(set_to_none=True)
    hidden.grad = None
    out = fn()
    out.backward()
    return out.detach(), hidden.grad.clone(), head.weight.grad.clone()


def _autocast(dtype):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16")


def _check_against_plain(ours, plain, truth, dtype):
    """fp32: equal to the plain computation. bf16: bf16 matmuls round differently per chunk (the
    plain weight gradient is one bf16 product, ours a fp32 sum of per-chunk ones), so each tensor
    must be as close to the fp32 truth as the plain bf16 computation is (within 1.5x)."""
    for a, b, t in zip(ours, plain, truth):
        if dtype == "fp32":
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-5)
        else:
            assert (a - t).norm() <= 1.5 * (b - t).norm() + 1e-3 * t.norm(), (a - t).norm() / t.norm()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_chunked_cross_entropy_matches_plain(dtype):
    head, hidden, targets = _inputs()
    plain_fn = lambda: F.cross_entropy(head(hidden).float(), targets, reduction="sum")
    truth = _grads(plain_fn, head, hidden)
    with _autocast(dtype):
        plain = _grads(plain_fn, head, hidden)
        chunked = _grads(lambda: linear_cross_entropy_sum(hidden, head, targets, "chunked", chunk_size=8), head, hidden)
    assert chunked[0].dtype == torch.float32
    _check_against_plain(chunked, plain, truth, dtype)
    if dtype == "bf16":
        torch.testing.assert_close(chunked[0], truth[0], rtol=1e-2, atol=0)


def _rows_seen_by(head):
    """Rows of every lm_head output, forward and backward-recompute alike."""
    rows = []
    handle = head.register_forward_hook(lambda m, a, out: rows.append(out.shape[0]))
    return rows, handle


@pytest.mark.parametrize("fn", ["loss", "logprobs"])
def test_chunks_bound_the_logits_in_forward_and_backward(fn):
    head, hidden, targets = _inputs()
    rows, handle = _rows_seen_by(head)
    if fn == "loss":
        out = linear_cross_entropy_sum(hidden, head, targets, "chunked", chunk_size=8)
    else:
        out = token_logprobs_entropy(hidden, head, targets, 0.7, [1, 2], with_entropy=True, chunk_size=8)[0].sum()
    forward = len(rows)
    out.backward()
    handle.remove()
    assert max(rows) <= 8 and sum(rows[:forward]) == N
    assert sum(rows[forward:]) == N  # backward recomputes each chunk, one at a time
    rows, handle = _rows_seen_by(head)
    linear_cross_entropy_sum(hidden, head, targets, "plain").backward()
    handle.remove()
    assert rows == [N]  # the reference holds all of them: what the chunked path avoids


def test_empty_targets_give_zero_with_a_graph():
    head, hidden, _ = _inputs()
    for impl in ("chunked", "plain"):
        loss = linear_cross_entropy_sum(hidden[:0], head, torch.zeros(0, dtype=torch.long), impl)
        assert float(loss.detach()) == 0.0
        loss.backward()  # sharded ranks must all run backward, an empty micro-batch included
    logp, _ = token_logprobs_entropy(hidden[:0], head, torch.zeros(0, dtype=torch.long))
    assert logp.shape == (0,)
    logp.sum().backward()


def _plain_logprobs(head, hidden, tokens, temperature, banned):
    logits = head(hidden).float() / temperature
    logits[..., banned] = float("-inf")
    logp_all = F.log_softmax(logits, dim=-1)
    entropy = -(logp_all.exp() * logp_all.nan_to_num(neginf=0.0)).sum(-1)
    return logp_all.gather(-1, tokens[:, None])[:, 0], entropy


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_chunked_logprobs_and_entropy_match_plain(dtype):
    head, hidden, tokens = _inputs(1)
    tokens = tokens.clamp(min=3)  # the sampled tokens are never banned ones
    banned, weights = [0, 1, 2], torch.linspace(-1, 1, N)
    results = {}
    for name, autocast in (("truth", _autocast("fp32")), ("plain", _autocast(dtype)), ("ours", _autocast(dtype))):
        with autocast:
            if name == "ours":
                logp, entropy = token_logprobs_entropy(hidden, head, tokens, 0.7, banned, with_entropy=True, chunk_size=16)
            else:
                logp, entropy = _plain_logprobs(head, hidden, tokens, 0.7, banned)
            logp_value, grad_hidden, grad_weight = _grads(lambda: (logp * weights).sum(), head, hidden)
        results[name] = (logp.detach(), entropy.detach(), grad_hidden, grad_weight)
        if name == "ours":
            assert logp.dtype == entropy.dtype == torch.float32 and not entropy.requires_grad
    _check_against_plain(results["ours"], results["plain"], results["truth"], dtype)
    # banned ids really are excluded: without them the log-probs are lower
    unbanned, _ = token_logprobs_entropy(hidden, head, tokens, 0.7, None)
    assert (unbanned < results["truth"][0] - 1e-6).all()


def test_loss_impl_choice_on_cpu():
    head = torch.nn.Linear(H, V, bias=False)
    assert resolve_loss_impl("auto", head, torch.device("cpu")) == "chunked"
    assert resolve_loss_impl("plain", head, torch.device("cpu")) == "plain"
    with pytest.raises(ConfigError, match="loss.impl=liger"):
        resolve_loss_impl("liger", head, torch.device("cpu"))


@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is not None, reason="liger-kernel installed here")
def test_liger_without_the_library_is_refused_before_loading(shapes_dir, tmp_path):
    """loss.impl=liger is refused when the run is set up, before any weight loads: the model
    directory does not even exist, and the error is liger's, not the missing directory's."""
    from vlforge.config import LossConfig
    from vlforge.train.losses import loss_impl_problem
    from vlforge.recipes.sft import run_sft

    from helpers import tiny_sft_config

    assert "not installed" in loss_impl_problem(LossConfig(impl="liger"), torch.device("cuda"))
    assert loss_impl_problem(LossConfig(impl="auto"), torch.device("cpu")) is None
    cfg = tiny_sft_config(shapes_dir, tmp_path / "run", "loss.impl=liger", f"model.path={tmp_path / 'absent'}")
    with pytest.raises(ConfigError, match="loss.impl=liger: liger-kernel is not installed"):
        run_sft(cfg)


def test_liger_off_cuda_is_refused_when_the_config_is_resolved(monkeypatch):
    """With the library present (or not), a CPU device is refused from the config and the device."""
    from vlforge.config import LossConfig, SFTConfig, load_config
    from vlforge.train import losses
    from vlforge.train.trainable import refuse_bad_combinations

    monkeypatch.setattr(losses, "liger_available", lambda: True)  # only the device is in question here
    cfg = load_config(SFTConfig, None, ["loss.impl=liger", "precision.mode=fp32"])
    with pytest.raises(ConfigError, match="loss.impl=liger needs CUDA .* the run's device is cpu"):
        refuse_bad_combinations(cfg, torch.device("cpu"))
    assert losses.loss_impl_problem(LossConfig(impl="liger"), torch.device("cuda")) is None


@pytest.mark.gpu
def test_liger_fused_cross_entropy_matches_plain_on_cuda():
    pytest.importorskip("liger_kernel")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    head, hidden, targets = _inputs(2, "cuda")
    assert resolve_loss_impl("auto", head, hidden.device) == "chunked"  # ours measured faster
    for dtype in (None, torch.bfloat16):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype is not None):
            plain = _grads(lambda: F.cross_entropy(head(hidden).float(), targets, reduction="sum"), head, hidden)
            fused = _grads(lambda: linear_cross_entropy_sum(hidden, head, targets, "liger"), head, hidden)
        tol = dict(rtol=1e-4, atol=1e-4) if dtype is None else dict(rtol=2e-2, atol=2e-2)
        for a, b in zip(fused, plain):
            torch.testing.assert_close(a.float(), b.float(), **tol)


def _liger_chunk(positions: int, hidden: int, vocab: int, chunk_mem_const: int) -> int:
    """liger-kernel 0.8's chunk rule (ops/fused_linear_cross_entropy.py), restated as the reference."""
    inc_factor = -(-vocab // (chunk_mem_const * hidden))
    return min(1 << (-(-positions // inc_factor) - 1).bit_length(), positions)


@pytest.mark.parametrize("positions,hidden,vocab", [(4400, 2048, 151936), (4400, 4096, 151936), (700, 2048, 151936),
                                                    (30000, 5120, 151936), (3000, 64, 500)])
def test_liger_chunks_are_about_the_configured_size(positions, hidden, vocab):
    """Its default (C=1) takes ~64 positions a chunk at the 2B shapes, each adding a [V, H] fp32
    weight gradient; ours makes them ~chunk_size (never more than twice), one chunk when it all fits."""
    assert _liger_chunk(4400, 2048, 151936, 1) == 64  # the default measured slow (docs/benchmarks.md)
    chunk = _liger_chunk(positions, hidden, vocab, liger_chunk_mem_const(positions, hidden, vocab, 1024))
    assert chunk == positions if positions <= 1024 else 512 <= chunk <= 2048


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None, reason="liger-kernel not installed")
def test_liger_with_large_chunks_equals_the_plain_loss_under_autocast():
    """fp32 master weights under bf16 autocast (the recipes' default): liger with our chunk size,
    several chunks, gives the plain loss and the hidden/weight gradients within bf16 tolerance."""
    torch.manual_seed(0)
    head = torch.nn.Linear(256, 6000, bias=False, device="cuda")
    hidden = torch.randn(3000, 256, device="cuda", requires_grad=True)
    targets = torch.randint(0, 6000, (3000,), device="cuda")
    out = {}
    for impl in ("plain", "liger"):
        head.zero_grad(set_to_none=True)
        hidden.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = linear_cross_entropy_sum(hidden, head, targets, impl=impl, chunk_size=512)
        loss.backward()
        out[impl] = (float(loss), hidden.grad.clone(), head.weight.grad.clone())
    assert _liger_chunk(3000, 256, 6000, liger_chunk_mem_const(3000, 256, 6000, 512)) < 3000  # several chunks
    assert out["liger"][0] == pytest.approx(out["plain"][0], rel=1e-2)
    for ours, plain in zip(out["liger"][1:], out["plain"][1:]):
        assert (ours - plain).norm() <= 2e-2 * plain.norm()
