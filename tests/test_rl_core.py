"""Parity of vlforge.rl.core against straightforward loop references (verl's formulas)."""

import math

import pytest
import torch

from vlforge.rl.core import AGG_MODES, agg_loss, grpo_advantages, kl_penalty, masked_mean, policy_loss

DT = torch.float64


# ----------------------------------------------------------------------------- references


def ref_advantages(rewards, k, scale, eps=1e-6):
    r = [float(x) for x in rewards]
    n = len(r)
    batch_std = torch.tensor(r, dtype=DT).std().item() if n > 1 else 1.0
    out = []
    for g in range(n // k):
        grp = r[g * k : (g + 1) * k]
        if k == 1:
            mean, std = 0.0, 1.0
        else:
            mean = sum(grp) / k
            std = math.sqrt(sum((x - mean) ** 2 for x in grp) / (k - 1))
        for x in grp:
            c = 0.0 if (k > 1 and all(y == grp[0] for y in grp)) else x - mean
            out.append({"group": c / (std + eps), "batch": c / (batch_std + eps), "none": c}[scale])
    return torch.tensor(out, dtype=DT)


def ref_policy_loss(logp, old, adv, mask, cl, ch, c, agg, norm_length=None):
    """Per-token loops; returns (loss, clip_frac, clip_frac_lower, approx_kl, ratio_mean)."""
    N, T = logp.shape
    if adv.dim() == 1:
        adv = adv[:, None].expand(N, T)
    L = [[0.0] * T for _ in range(N)]
    n = nclip = nlow = 0
    kl_sum = ratio_sum = 0.0
    for b in range(N):
        for t in range(T):
            a = adv[b, t].item()
            lr = min(max(logp[b, t].item() - old[b, t].item(), -20.0), 20.0)
            ratio = math.exp(lr)
            l1, l2 = -a * ratio, -a * min(max(ratio, 1 - cl), 1 + ch)
            loss = max(l1, l2)
            low = False
            if c is not None and a < 0:
                low = loss > -a * c
                loss = min(loss, -a * c)
            L[b][t] = loss
            if mask[b, t]:
                n += 1
                nclip += l2 > l1
                nlow += low
                kl_sum += -lr
                ratio_sum += ratio
    rows = [[L[b][t] for t in range(T) if mask[b, t]] for b in range(N)]
    if agg == "token-mean":
        toks = [x for row in rows for x in row]
        loss = sum(toks) / len(toks) if toks else 0.0
    elif agg == "seq-mean-token-sum-norm":
        loss = sum(sum(row) for row in rows) / (norm_length or T)
    else:
        per_row = [(sum(row) / len(row) if agg == "seq-mean-token-mean" else sum(row)) for row in rows if row]
        loss = sum(per_row) / len(per_row) if per_row else 0.0
    d = max(n, 1)
    return loss, nclip / d, nlow / d, kl_sum / d, ratio_sum / d


def rand_inputs(N=6, T=9, spread=1.0, seed=0, empty_rows=(2,)):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(N, T, generator=g, dtype=DT) * 3
    logp = old + spread * torch.randn(N, T, generator=g, dtype=DT)
    adv = torch.randn(N, generator=g, dtype=DT)
    lengths = torch.randint(1, T + 1, (N,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    for r in empty_rows:
        mask[r] = False
    return logp, old, adv, mask


# ----------------------------------------------------------------------------- advantages


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_advantages_match_reference(scale, k):
    g = torch.Generator().manual_seed(1)
    r = torch.randint(0, 3, (12,), generator=g).to(DT) + torch.rand(12, generator=g, dtype=DT).round(decimals=1)
    r[:k] = 0.7  # one group with all-equal rewards
    got = grpo_advantages(r, k, scale)
    torch.testing.assert_close(got, ref_advantages(r, k, scale), rtol=1e-12, atol=1e-12)
    assert torch.isfinite(got).all()
    if k > 1:
        assert (got[:k] == 0).all()  # exact zero, not ~1e-10


def test_advantages_known_values():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0])
    std = math.sqrt(0.5)  # unbiased std of {1, 0}
    want = torch.tensor([1, -1, -1, 1]) * 0.5 / (std + 1e-6)
    torch.testing.assert_close(grpo_advantages(r, 2), want)
    torch.testing.assert_close(grpo_advantages(r, 2, "none"), torch.tensor([0.5, -0.5, -0.5, 0.5]))
    batch_std = torch.tensor([1.0, 0.0, 0.0, 1.0]).std()
    torch.testing.assert_close(grpo_advantages(r, 2, "batch"), torch.tensor([1, -1, -1, 1]) * 0.5 / (batch_std + 1e-6))


def test_advantages_all_equal_and_singleton():
    r = torch.tensor([0.1, 0.1, 0.1, 3.0, 3.0, 3.0])
    for scale in ("group", "batch", "none"):
        assert torch.equal(grpo_advantages(r, 3, scale), torch.zeros(6))
    # verl's singleton fallback: mean 0, std 1 -> the raw reward, never NaN
    single = grpo_advantages(torch.tensor([2.0, -1.0]), 1)
    torch.testing.assert_close(single, torch.tensor([2.0, -1.0]) / (1 + 1e-6))
    assert torch.isfinite(grpo_advantages(torch.tensor([5.0]), 1, "batch")).all()


def test_advantages_int_rewards_and_no_grad():
    r = torch.tensor([1, 0, 1, 1])
    out = grpo_advantages(r, 2)
    assert out.dtype == torch.float32 and out.shape == (4,)
    rg = torch.tensor([1.0, 0.0], requires_grad=True)
    assert not grpo_advantages(rg, 2).requires_grad


def test_advantages_validation():
    with pytest.raises(ValueError, match="multiple of group_size"):
        grpo_advantages(torch.zeros(5), 2)
    with pytest.raises(ValueError, match="multiple of group_size"):
        grpo_advantages(torch.zeros(4), 0)
    with pytest.raises(ValueError, match="group, batch, none"):
        grpo_advantages(torch.zeros(4), 2, scale="std")
    with pytest.raises(ValueError, match="1-D"):
        grpo_advantages(torch.zeros(2, 2), 2)


# ----------------------------------------------------------------------------- policy loss


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("dual_clip", [None, 3.0])
@pytest.mark.parametrize("spread", [0.3, 100.0])
def test_policy_loss_matches_reference(agg, dual_clip, spread):
    logp, old, adv, mask = rand_inputs(spread=spread, seed=int(spread))
    loss, st = policy_loss(logp, old, adv, mask, 0.2, 0.28, dual_clip, agg)
    want = ref_policy_loss(logp, old, adv, mask, 0.2, 0.28, dual_clip, agg)
    assert torch.isfinite(loss)
    assert loss.item() == pytest.approx(want[0], rel=1e-10, abs=1e-10)
    got_stats = [st[k].item() for k in ("clip_frac", "clip_frac_lower", "approx_kl", "ratio_mean")]
    assert got_stats == pytest.approx(list(want[1:]), rel=1e-10, abs=1e-10)
    assert all(v.dim() == 0 and not v.requires_grad for v in st.values())


def test_policy_loss_token_advantages_and_float_mask():
    logp, old, adv, mask = rand_inputs(seed=3)
    adv_BT = adv[:, None] + 0.1 * torch.randn(logp.shape, dtype=DT, generator=torch.Generator().manual_seed(4))
    loss, _ = policy_loss(logp, old, adv_BT, mask.to(DT), dual_clip=2.0, agg="seq-mean-token-mean")
    want = ref_policy_loss(logp, old, adv_BT, mask, 0.2, 0.2, 2.0, "seq-mean-token-mean")[0]
    assert loss.item() == pytest.approx(want, rel=1e-10)


def test_norm_length_constant():
    logp, old, adv, mask = rand_inputs(seed=5)
    loss, _ = policy_loss(logp, old, adv, mask, agg="seq-mean-token-sum-norm", norm_length=4096)
    want = ref_policy_loss(logp, old, adv, mask, 0.2, 0.2, None, "seq-mean-token-sum-norm", 4096)[0]
    assert loss.item() == pytest.approx(want, rel=1e-10)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_all_empty_mask_gives_zero_without_nan(agg):
    logp, old, adv, _ = rand_inputs()
    logp.requires_grad_(True)
    mask = torch.zeros(logp.shape, dtype=torch.bool)
    loss, st = policy_loss(logp, old, adv, mask, dual_clip=3.0, agg=agg)
    loss.backward()
    assert loss.item() == 0.0
    assert all(v.item() == 0.0 for v in st.values())
    assert torch.equal(logp.grad, torch.zeros_like(logp))


def test_extreme_log_ratios_finite_with_grad():
    logp, old, adv, mask = rand_inputs(spread=0.0, empty_rows=())
    logp = (old + torch.tensor([100.0, -100.0, 50.0, -50.0, 0.0, 30.0], dtype=DT)[:, None]).requires_grad_(True)
    for agg in AGG_MODES:
        loss, st = policy_loss(logp, old, adv, mask, dual_clip=3.0, agg=agg)
        (g,) = torch.autograd.grad(loss, logp)
        assert torch.isfinite(loss) and torch.isfinite(g).all()
        assert all(torch.isfinite(v) for v in st.values())


def test_dual_clip_caps_negative_advantage_loss():
    # ratio = e^3 ~ 20 with A = -1: plain PPO loss 20.1, dual clip caps it at c = 3
    old = torch.zeros(2, 1)
    logp = torch.full((2, 1), 3.0)
    adv = torch.tensor([-1.0, 1.0])
    mask = torch.ones(2, 1)
    plain, st0 = policy_loss(logp, old, adv, mask, agg="seq-mean-token-sum")
    dual, st1 = policy_loss(logp, old, adv, mask, dual_clip=3.0, agg="seq-mean-token-sum")
    # row 0 (A<0): max(20.09, 1.2) = 20.09 -> capped to 3; row 1 (A>0): max(-20.09, -1.2) = -1.2
    assert plain.item() == pytest.approx((math.exp(3) - 1.2) / 2)
    assert dual.item() == pytest.approx((3.0 - 1.2) / 2)
    assert st0["clip_frac_lower"].item() == 0.0 and st1["clip_frac_lower"].item() == 0.5
    assert st1["clip_frac"].item() == 0.5  # only the A>0 row took the clipped branch
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        policy_loss(logp, old, adv, mask, dual_clip=1.0)


def test_gradient_at_ratio_one():
    logp, old, adv, mask = rand_inputs(seed=7)
    logp = old.clone().requires_grad_(True)
    loss, st = policy_loss(logp, old, adv, mask, dual_clip=3.0)
    loss.backward()
    m = mask.to(DT)
    torch.testing.assert_close(logp.grad, -adv[:, None] * m / m.sum())
    assert st["ratio_mean"].item() == pytest.approx(1.0) and st["approx_kl"].item() == 0.0
    assert st["clip_frac"].item() == 0.0


def test_policy_loss_validation():
    logp, old, adv, mask = rand_inputs()
    with pytest.raises(ValueError, match="token-mean"):
        policy_loss(logp, old, adv, mask, agg="sum")
    with pytest.raises(ValueError, match=r"\[N, T\]"):
        policy_loss(logp, old[:, :-1], adv, mask)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(logp, old, adv[:-1], mask)
    with pytest.raises(ValueError, match="seq-mean-token-sum-norm"):
        agg_loss(logp, mask, "mean")


def test_masked_mean():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    m = torch.tensor([[1, 1, 0], [0, 0, 0]], dtype=torch.bool)
    assert masked_mean(x, m).item() == 1.5
    torch.testing.assert_close(masked_mean(x, m, dim=-1), torch.tensor([1.5, 0.0]))
    assert masked_mean(x, torch.zeros_like(m)).item() == 0.0


# ----------------------------------------------------------------------------- KL


def test_kl_kinds_match_formulas():
    g = torch.Generator().manual_seed(9)
    logp = -torch.rand(5, 7, generator=g, dtype=DT) * 5
    ref = logp + 3 * torch.randn(5, 7, generator=g, dtype=DT)
    ref[0, 0] = logp[0, 0] + 50  # exercises the +20 clamp and the 10 cap
    ref[0, 1] = logp[0, 1] - 50  # exercises the -20 clamp
    for b in range(5):
        for t in range(7):
            lp, rp = logp[b, t].item(), ref[b, t].item()
            d = min(max(rp - lp, -20.0), 20.0)
            want = {"k1": lp - rp, "k2": 0.5 * (lp - rp) ** 2, "k3": min(max(math.exp(d) - d - 1, -10.0), 10.0)}
            for kind, w in want.items():
                assert kl_penalty(logp, ref, kind)[b, t].item() == pytest.approx(w, rel=1e-12, abs=1e-12)
    k3 = kl_penalty(logp, ref, "k3")
    assert (k3 >= 0).all() and torch.isfinite(k3).all() and k3[0, 0].item() == 10.0
    assert torch.equal(kl_penalty(logp, logp, "k3"), torch.zeros_like(logp))
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_penalty(logp, ref, "k4")


# ----------------------------------------------------------------------------- RLOO, REINFORCE++, GSPO, CISPO


def _masked_whiten(values_NT: torch.Tensor, mask_NT: torch.Tensor) -> torch.Tensor:
    """verl.utils.torch_functional.masked_whiten written out: token-level mean and unbiased variance."""
    mean = (values_NT * mask_NT).sum() / mask_NT.sum()
    var = (((values_NT - mean) ** 2) * mask_NT).sum() / mask_NT.sum()
    var = var * mask_NT.sum() / (mask_NT.sum() - 1)
    return (values_NT - mean) * torch.rsqrt(var + 1e-8)


def test_rloo_is_the_leave_one_out_baseline():
    from vlforge.rl import outcome_advantages

    r = torch.tensor([1.0, 0.0, 0.0, 3.0, 2.0, 2.0, 2.0, 2.0, 0.5, 4.0, 1.0, 1.5])  # 3 groups of 4
    expected = [r[i] - (r[i - i % 4:i - i % 4 + 4].sum() - r[i]) / 3 for i in range(12)]
    torch.testing.assert_close(outcome_advantages(r, 4, "rloo"), torch.stack(expected))
    assert torch.equal(outcome_advantages(r, 4, "rloo")[4:8], torch.zeros(4))  # equal rewards: exactly 0
    torch.testing.assert_close(outcome_advantages(r, 4, "rloo"), 4 / 3 * outcome_advantages(r, 4, "grpo", "none"))
    assert torch.equal(outcome_advantages(r, 1, "rloo"), r)  # no other response: no baseline


@pytest.mark.parametrize("estimator", ["reinforce++", "reinforce++-baseline"])
def test_reinforce_plus_plus_whitens_over_the_batch_tokens_as_verl(estimator):
    """The outcome reward broadcast over each response's tokens, whitened over every token of the
    batch (verl's masked_whiten): longer responses weigh more in the mean and variance."""
    from vlforge.rl import outcome_advantages

    g = torch.Generator().manual_seed(0)
    r = torch.randint(0, 3, (12,), generator=g).float()
    lengths = torch.randint(1, 9, (12,), generator=g)
    mask_NT = (torch.arange(8) < lengths[:, None]).float()
    scores = r - r.view(-1, 4).mean(1).repeat_interleave(4) if estimator == "reinforce++-baseline" else r
    expected = _masked_whiten(scores[:, None] * mask_NT, mask_NT)  # every token of a row holds its value
    adv = outcome_advantages(r, 4, estimator, lengths=lengths)
    torch.testing.assert_close(adv[:, None].expand(-1, 8)[mask_NT.bool()], expected[mask_NT.bool()])
    unweighted = outcome_advantages(r, 4, estimator)
    assert not torch.allclose(adv, unweighted)  # the lengths matter
    torch.testing.assert_close(unweighted.mean(), torch.tensor(0.0), atol=1e-6, rtol=0)


def test_gspo_uses_one_ratio_per_sequence_and_its_gradient():
    """GSPO-token: every token of a row carries s_i = exp(mean log-ratio of the row); unclipped, a
    token's gradient is -A_i s_i / |o_i| / N under seq-mean-token-mean (the paper's objective); a
    row whose s_i is clipped gets none. On-policy it is GRPO's loss under the same aggregation."""
    g = torch.Generator().manual_seed(1)
    old = -torch.rand(3, 5, generator=g) * 2
    shift = torch.tensor([[1e-4], [5e-3], [-1e-4]])  # rows 0, 2 inside [1 - 3e-4, 1 + 4e-4]; row 1 outside
    logp = (old + shift).clone().requires_grad_(True)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]).float()
    adv = torch.tensor([1.0, 2.0, -1.0])
    loss, stats = policy_loss(logp, old, adv, mask, clip_low=3e-4, clip_high=4e-4, agg="seq-mean-token-mean",
                              kind="gspo")
    loss.backward()
    s = torch.exp(shift.squeeze(1))
    lengths = mask.sum(1)
    expected = -adv[:, None] * s[:, None] / lengths[:, None] / 3 * mask
    expected[1] = 0.0  # positive advantage, s above 1 + clip_high: the clipped branch, constant
    torch.testing.assert_close(logp.grad, expected)
    torch.testing.assert_close(stats["ratio_mean"], (s[:, None] * mask).sum() / mask.sum())
    assert stats["clip_frac"] == pytest.approx(5 / 10)
    same = old.clone().requires_grad_(True)
    on_policy, _ = policy_loss(same, old, adv, mask, agg="seq-mean-token-mean", kind="gspo")
    grpo, _ = policy_loss(old.clone().requires_grad_(True), old, adv, mask, agg="seq-mean-token-mean")
    torch.testing.assert_close(on_policy, grpo)


def test_cispo_keeps_the_gradient_of_tokens_ppo_clips():
    """CISPO: loss = -sg(clamp(ratio, 1 - low, 1 + high)) * A * logp. A token whose ratio is past
    1 + high with A > 0 gets no gradient from PPO's clipped surrogate but keeps CISPO's, weighted by
    the truncated ratio; inside the range both give -A * ratio / n."""
    old = torch.log(torch.tensor([[0.5, 0.5, 0.2]]))
    logp = torch.log(torch.tensor([[0.5, 0.8, 0.2]])).requires_grad_(True)  # token 1: ratio 1.6
    mask, adv = torch.ones(1, 3), torch.tensor([2.0])
    loss, stats = policy_loss(logp, old, adv, mask, clip_low=1.0, clip_high=0.2, kind="cispo")
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-2.0 / 3, -2.0 * 1.2 / 3, -2.0 / 3]]))
    assert stats["clip_frac"] == pytest.approx(1 / 3)
    ppo_logp = logp.detach().clone().requires_grad_(True)
    ppo, _ = policy_loss(ppo_logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    ppo.backward()
    assert ppo_logp.grad[0, 1] == 0 and logp.grad[0, 1] != 0


def test_policy_loss_kinds_validation():
    logp = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="unknown policy loss"):
        policy_loss(logp, logp, torch.ones(1), torch.ones(1, 2), kind="ppo2")
    with pytest.raises(ValueError, match="dual_clip is PPO's"):
        policy_loss(logp, logp, torch.ones(1), torch.ones(1, 2), dual_clip=3.0, kind="cispo")
    from vlforge.rl import outcome_advantages
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        outcome_advantages(torch.ones(4), 2, "ppo")


# ------------------------------------------------------------- both clip bounds, both signs of the advantage


def test_gspo_clips_both_bounds_for_both_signs_of_the_advantage():
    """GSPO (Zheng et al. 2025, eq. 5-7) written out per sequence: s_i = exp(mean_t (logp - old)),
    loss = mean_i max(-A_i s_i, -A_i clip(s_i, 1 - low, 1 + high)), d loss / d logp_it = -A_i s_i /
    |y_i| / N where the unclipped branch is taken, 0 where the clip binds. Rows on each side of the
    band with A > 0 and A < 0: the upper bound binds for A > 0, the lower one for A < 0 (s = 0.6
    with A = -1: PPO's pessimism keeps -A (1 - low) = 0.9 over 0.6), the other two pass."""
    low, high = 0.1, 0.15
    seq_ratio = [1.5, 0.6, 0.6, 1.5, 1.05, 0.97]
    adv = [1.0, 1.0, -1.0, -1.0, 0.5, -0.5]
    clipped_rows = {0, 2}  # A > 0 above 1 + high; A < 0 below 1 - low
    g = torch.Generator().manual_seed(3)
    N, T = len(adv), 5
    lengths = [5, 3, 4, 2, 5, 1]
    mask = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).to(DT)
    old = -torch.rand(N, T, generator=g, dtype=DT) * 2
    # per-token log-ratios that vary inside a row but average to log s_i over its tokens
    noise = torch.randn(N, T, generator=g, dtype=DT) * 0.3 * mask
    noise -= (noise.sum(1, keepdim=True) / mask.sum(1, keepdim=True)) * mask
    logp = (old + (torch.log(torch.tensor(seq_ratio, dtype=DT))[:, None] + noise) * mask).requires_grad_(True)
    loss, stats = policy_loss(logp, old, torch.tensor(adv, dtype=DT), mask, clip_low=low, clip_high=high,
                              agg="seq-mean-token-mean", kind="gspo")
    loss.backward()

    expected_loss, expected_grad = 0.0, torch.zeros(N, T, dtype=DT)
    for i in range(N):
        s = math.exp(sum(float(logp[i, t].detach() - old[i, t]) for t in range(lengths[i])) / lengths[i])
        assert s == pytest.approx(seq_ratio[i], rel=1e-9)
        unclipped, clipped = -adv[i] * s, -adv[i] * min(max(s, 1 - low), 1 + high)
        expected_loss += max(unclipped, clipped) / N
        assert (clipped > unclipped) == (i in clipped_rows), i  # the rows were chosen to hit the bounds
        if clipped <= unclipped:
            expected_grad[i, :lengths[i]] = -adv[i] * s / lengths[i] / N
    assert float(loss.detach()) == pytest.approx(expected_loss, rel=1e-12)
    torch.testing.assert_close(logp.grad, expected_grad, rtol=1e-10, atol=1e-12)
    assert float(stats["clip_frac"]) == pytest.approx(sum(lengths[i] for i in clipped_rows) / sum(lengths))
    assert expected_grad[2].abs().sum() == 0 and expected_grad[1].abs().sum() > 0  # the lower bound acted on A < 0 only


def test_cispo_truncates_the_weight_at_both_bounds_for_both_signs_of_the_advantage():
    """CISPO (MiniMax-M1 2025, eq. 4) written out per token: w = sg(clip(r, 1 - low, 1 + high)),
    loss = -sum(w A logp) / tokens (token-mean), gradient -w A / tokens on every token, clipped or
    not. Ratios below 1 - low and above 1 + high in a row with A > 0 and one with A < 0: each
    truncated weight is the bound, whatever the sign of A."""
    low, high = 0.2, 0.25
    ratios = torch.tensor([[1.6, 0.5, 1.0, 0.9, 1.3], [0.3, 1.4, 1.1, 0.7, 0.95]], dtype=DT)
    adv = torch.tensor([1.5, -0.7], dtype=DT)
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=DT)
    old = torch.log(torch.tensor([[0.3, 0.6, 0.2, 0.5, 0.4], [0.9, 0.1, 0.4, 0.8, 0.5]], dtype=DT))
    logp = (old + torch.log(ratios)).requires_grad_(True)
    loss, stats = policy_loss(logp, old, adv, mask, clip_low=low, clip_high=high, kind="cispo")
    loss.backward()

    tokens = int(mask.sum())
    expected_loss, expected_grad, truncated = 0.0, torch.zeros_like(ratios), 0
    for i in range(2):
        for t in range(5):
            if not mask[i, t]:
                continue
            r = math.exp(float(logp[i, t].detach() - old[i, t]))
            w = min(max(r, 1 - low), 1 + high)
            truncated += abs(w - r) > 1e-9
            expected_loss += -w * float(adv[i]) * float(logp[i, t].detach()) / tokens
            expected_grad[i, t] = -w * float(adv[i]) / tokens
    assert float(loss.detach()) == pytest.approx(expected_loss, rel=1e-12)
    torch.testing.assert_close(logp.grad, expected_grad, rtol=1e-10, atol=1e-12)
    # the lower bound acted in both rows (A > 0: 0.5 weighted 0.8; A < 0: 0.3 and 0.7 weighted 0.8), the upper too
    assert float(logp.grad[0, 1]) == pytest.approx(-(1 - low) * 1.5 / tokens)
    assert float(logp.grad[1, 0]) == float(logp.grad[1, 3]) == pytest.approx((1 - low) * 0.7 / tokens)
    assert float(logp.grad[0, 0]) == pytest.approx(-(1 + high) * 1.5 / tokens)
    assert float(logp.grad[1, 1]) == pytest.approx((1 + high) * 0.7 / tokens)
    assert truncated == 5 and float(stats["clip_frac"]) == pytest.approx(truncated / tokens)
