"""Rollout correction (rl/correction.py, rl.rollout_correction): TIS and MIS weights against an
independent per-token implementation of verl's formulas (docs/algo/rollout_corr_math.md 3.3-3.4;
slime's MIS: IS weights apart from the rejection), the weighted policy loss and its gradient, the
mismatch metrics, and GRPO steps through the recipe with each option."""

import json
import math

import pytest
import torch

from vlforge.config import ConfigError, GRPOConfig, load_config
from vlforge.rl.core import policy_loss
from vlforge.rl.correction import mismatch_stats, rollout_correction


def _inputs():
    """4 rows x 6 tokens: a normal row, an empty row (no response token), a row with extreme ratios
    (log rho 40 and -10: past the safety bound of 20), a short row; padding holds garbage log-probs."""
    torch.manual_seed(0)
    old = -torch.rand(4, 6) * 3
    rollout = old + torch.randn(4, 6) * 0.05
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0]]).float()
    rollout[2, 0], rollout[2, 1] = old[2, 0] - 40.0, old[2, 1] + 10.0  # rho = e^40 and e^-10
    rollout[mask == 0] = 123.0  # padding: never read
    return old, rollout, mask


def _reference(old, rollout, mask, method, level, cap, band):
    """verl's formulas, one token at a time in plain Python."""
    N, T = mask.shape
    weight, kept, changed = [[0.0] * T for _ in range(N)], [[0.0] * T for _ in range(N)], [[False] * T for _ in range(N)]
    for n in range(N):
        tokens = [t for t in range(T) if mask[n, t] > 0]
        log_seq = sum(float(old[n, t]) - float(rollout[n, t]) for t in tokens)
        for t in tokens:
            log_rho = log_seq if level == "sequence" else float(old[n, t]) - float(rollout[n, t])
            rho = math.exp(min(max(log_rho, -20.0), 20.0))
            if method == "tis":
                weight[n][t], kept[n][t], changed[n][t] = min(rho, cap), 1.0, rho > cap
            else:
                inside = band[0] <= rho <= band[1]
                weight[n][t], kept[n][t], changed[n][t] = (rho if inside else 0.0), float(inside), not inside
    return torch.tensor(weight), torch.tensor(kept), torch.tensor(changed)


@pytest.mark.parametrize("method", ["tis", "mis"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_weights_and_masks_equal_verls_formulas(method, level):
    old, rollout, mask = _inputs()
    cap, band = 1.5, (0.8, 1.25)
    weight, kept, changed = rollout_correction(old, rollout, mask, method, level, cap, band)
    want_w, want_k, want_c = _reference(old, rollout, mask, method, level, cap, band)
    torch.testing.assert_close(weight, want_w, rtol=1e-5, atol=1e-6)
    assert torch.equal(kept, want_k) and torch.equal(changed, want_c)
    assert torch.isfinite(weight).all() and not weight.requires_grad
    assert weight[1].abs().sum() == 0 and kept[1].sum() == 0  # the empty row: nothing
    if method == "tis":
        assert torch.equal(kept, mask) and weight.max() <= cap and changed.any()
    else:
        assert (kept <= mask).all() and changed.any() and kept.sum() > 0
    none_w, none_k, none_c = rollout_correction(old, rollout, mask, "none")
    assert torch.equal(none_w, mask) and torch.equal(none_k, mask) and not none_c.any()


def test_the_weighted_policy_loss_and_its_gradient_equal_a_hand_written_one():
    """policy_loss(is_weight=w): each token's clipped surrogate times w (a constant), token-mean over
    the kept mask, as verl multiplies pg_losses by rollout_is_weights; MIS's mask leaves the rejected
    tokens out of the mean's denominator too."""
    old, rollout, mask = _inputs()
    weight, kept, _ = rollout_correction(old, rollout, mask, "mis", "token", band=(0.8, 1.25))
    logp = (old + 0.1 * torch.randn_like(old)).requires_grad_()
    adv = torch.tensor([1.0, -1.0, 0.5, -2.0])
    loss, _ = policy_loss(logp, old, adv, kept, 0.2, 0.2, is_weight=weight)
    loss.backward()
    ours_grad = logp.grad.clone()
    logp2 = logp.detach().clone().requires_grad_()
    ratio = torch.exp(logp2 - old)
    per_token = torch.maximum(-adv[:, None] * ratio, -adv[:, None] * ratio.clamp(0.8, 1.2)) * weight
    want = (per_token * kept).sum() / kept.sum()
    want.backward()
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(ours_grad, logp2.grad)
    assert (ours_grad[kept == 0] == 0).all()  # rejected and padding tokens get no gradient


def test_mismatch_stats_are_k3_and_the_log_ratios_over_response_tokens():
    old, rollout, mask = _inputs()
    stats = mismatch_stats(old, rollout, mask)
    log_rho = ((old - rollout) * mask).clamp(-20, 20)[mask > 0]
    assert float(stats["tokens"]) == 11
    torch.testing.assert_close(stats["k3_kl_sum"], (torch.exp(log_rho) - log_rho - 1).sum())
    torch.testing.assert_close(stats["log_ratio_abs_max"], torch.tensor(20.0))
    torch.testing.assert_close(stats["log_ratio_abs_sum"], log_rho.abs().sum())


def test_config_needs_the_trainers_old_logprobs_and_sane_bounds():
    with pytest.raises(ConfigError, match="set rl.old_logprobs=trainer too"):
        load_config(GRPOConfig, None, ["rl.rollout_correction.method=tis"])
    with pytest.raises(ConfigError, match="rl.rollout_correction.band must be"):
        load_config(GRPOConfig, None, ["rl.old_logprobs=trainer", "rl.rollout_correction.method=mis",
                                       "rl.rollout_correction.band=[1.2, 2.0]"])
    with pytest.raises(ConfigError, match="cap must be >= 1"):
        load_config(GRPOConfig, None, ["rl.old_logprobs=trainer", "rl.rollout_correction.cap=0.5"])


def _run(shapes_dir, tmp_path, name, monkeypatch, shift, *extra):
    """One GRPO step whose rollout log-probs are `shift` off the trainer's on every response token
    (rho = exp(-shift)); returns (its metrics row, the parameters before and after, which train)."""
    from test_grpo import grpo_config
    from vlforge.recipes import grpo as recipe

    real, captured = recipe.generate_groups, {}

    def shifted(*args, **kwargs):
        rollout = real(*args, **kwargs)
        rollout.logprobs.add_(shift * rollout.response_mask.to(rollout.logprobs.dtype))
        return rollout

    def capture(c, **kwargs):
        t = setup(c, **kwargs)
        captured["t"], captured["before"] = t, {n: p.detach().clone() for n, p in t.model.named_parameters()}
        return t

    setup = recipe.setup_model
    monkeypatch.setattr(recipe, "generate_groups", shifted)
    monkeypatch.setattr(recipe, "setup_model", capture)
    cfg = grpo_config(shapes_dir, tmp_path / name, tmp_path, "tiers.method=lora", "rl.old_logprobs=trainer",
                      "rl.mini_batch_size=8", "train.seed=1", *extra)
    recipe.run_grpo(cfg)
    monkeypatch.undo()
    row = json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[0])
    return row, captured


@pytest.mark.parametrize("method,level", [("tis", "token"), ("tis", "sequence"), ("mis", "token"), ("mis", "sequence")])
def test_a_grpo_step_with_rollout_correction_trains_exactly_the_trainable_params(shapes_dir, tmp_path, monkeypatch,
                                                                                  method, level):
    # mini-batches of 4: two optimizer steps, so LoRA A moves too (B starts at zero)
    row, captured = _run(shapes_dir, tmp_path, "run", monkeypatch, 0.05, f"rl.rollout_correction.method={method}",
                         f"rl.rollout_correction.level={level}", "rl.mini_batch_size=4")
    assert row["rollout/k3_kl"] == pytest.approx(math.exp(-0.05) + 0.05 - 1, rel=1e-3)
    assert row["rollout/log_ratio_abs_mean"] == pytest.approx(0.05, abs=1e-5)
    assert row["rollout/log_ratio_abs_max"] == pytest.approx(0.05, abs=1e-5)
    assert 0.0 <= row["rollout/corrected_frac"] <= 1.0
    for n, p in captured["t"].model.named_parameters():
        changed = not torch.equal(captured["before"][n], p.detach())
        assert changed == p.requires_grad, f"{n}: trainable={p.requires_grad} changed={changed}"


def test_the_correction_acts_on_the_gradient(shapes_dir, tmp_path, monkeypatch):
    """At the first mini-batch every PPO ratio is 1 (old log-probs: the trainer's), so each token's
    gradient is -A x w x grad log pi: token-level TIS with rho = exp(-0.05) < cap scales the step's
    gradient (one mini-batch, no clipping of its norm) by exactly exp(-0.05); rho = exp(0.05) above a
    cap of 1 truncates every token back to weight 1; MIS whose band leaves out exp(-0.05) masks every
    token (no gradient, every token counted as corrected)."""
    plain, _ = _run(shapes_dir, tmp_path, "none", monkeypatch, 0.05)
    tis, _ = _run(shapes_dir, tmp_path, "tis", monkeypatch, 0.05, "rl.rollout_correction.method=tis")
    assert plain["grad_norm"] > 0
    assert tis["grad_norm"] == pytest.approx(math.exp(-0.05) * plain["grad_norm"], rel=1e-4)
    assert "rollout/corrected_frac" not in plain and tis["rollout/corrected_frac"] == 0.0
    assert plain["rollout/k3_kl"] == pytest.approx(tis["rollout/k3_kl"])  # measured with or without correction
    up, _ = _run(shapes_dir, tmp_path, "up", monkeypatch, -0.05, "rl.rollout_correction.method=tis",
                 "rl.rollout_correction.cap=1.0")
    assert up["rollout/corrected_frac"] == 1.0 and up["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-4)
    mis, _ = _run(shapes_dir, tmp_path, "mis", monkeypatch, 0.05, "rl.rollout_correction.method=mis",
                  "rl.rollout_correction.band=[0.99, 1.01]")
    assert mis["rollout/corrected_frac"] == 1.0 and mis["loss"] == 0.0 and mis["grad_norm"] == 0.0
