"""GRPO math as small pure functions: outcome advantages (GRPO, RLOO, REINFORCE++), policy losses
(PPO's clipped surrogate as in GRPO/DAPO, GSPO, CISPO), loss aggregation, KL estimators.

Formulas follow verl ``verl/trainer/ppo/core_algos.py`` (compute_grpo_outcome_advantage,
compute_rloo_outcome_advantage, compute_reinforce_plus_plus_outcome_advantage,
compute_rf_baseline_outcome_advantage, compute_policy_loss_vanilla / _gspo, agg_loss, kl_penalty)
and the papers named per function; deviations are listed per function.

Shape suffixes (torchtitan style), the legend of the whole package:
    B  prompts, one group of responses each
    G  group size (responses per prompt)
    N  responses: B * G in a rollout, or the rows of a loss mini-batch
    T  response tokens per row (padded)

Masks are float or bool, 1 on response tokens that count, 0 on padding/prompt.
"""

from __future__ import annotations

import torch
from torch import Tensor

ADV_SCALES = ("group", "batch", "none")
ADV_ESTIMATORS = ("grpo", "rloo", "reinforce++", "reinforce++-baseline")
POLICY_LOSSES = ("ppo", "gspo", "cispo")
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_KINDS = ("k1", "k2", "k3")


def _safe_div(num: Tensor, den: Tensor) -> Tensor:
    """num / den, giving 0 where den == 0 (and no NaN in the backward either)."""
    return num / torch.where(den == 0, torch.ones_like(den), den)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over entries where ``mask`` is non-zero (mask-weighted for float masks).

    ``dim=None`` reduces everything to a scalar; otherwise reduces ``dim``. An empty mask
    gives 0 rather than NaN (verl's masked_mean adds 1e-8 to the count; we divide exactly).
    """
    mask = mask.to(x.dtype)
    if dim is None:
        return _safe_div((x * mask).sum(), mask.sum())
    return _safe_div((x * mask).sum(dim), mask.sum(dim))


def grpo_advantages(rewards: Tensor, group_size: int, scale: str = "group", eps: float = 1e-6) -> Tensor:
    """Outcome advantages for GRPO, one scalar per response.

    Args:
        rewards: ``r_N`` float [N]; each consecutive block of ``group_size`` is one prompt's group.
        group_size: G, responses per prompt; N must be divisible by G.
        scale: ``"group"``: (r - mean_g) / (std_g + eps), the GRPO paper / verl default;
            ``"batch"``: (r - mean_g) / (std of all N rewards + eps);
            ``"none"``: r - mean_g (Dr. GRPO, verl ``norm_adv_by_std_in_grpo=False``).
        eps: added to the std.

    Returns:
        ``adv_N`` [N], same dtype as ``rewards`` (float32 for integer/bool input), no grad.

    Std is the unbiased one (``torch.std``), as in verl.
    Singleton groups (G == 1): as verl, mean_g = 0 and std_g = 1, so the advantage is the raw
    reward ``r / (1 + eps)`` (REINFORCE without baseline), never NaN. For ``"batch"`` with N == 1
    the batch std is likewise taken as 1.
    Deviation from verl: groups (G >= 2) whose rewards are all equal get an advantage of exactly 0;
    verl computes (r - mean)/(0 + eps), which float rounding of the mean can leave at ~1e-10.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"number of rewards ({rewards.numel()}) must be a positive multiple of group_size ({group_size}): "
            "rewards must hold group_size consecutive responses for every prompt"
        )
    if scale not in ADV_SCALES:
        raise ValueError(f"unknown advantage scale {scale!r}; valid: {', '.join(ADV_SCALES)}")
    r_N = rewards.detach() if rewards.is_floating_point() else rewards.detach().float()
    r_BG = r_N.view(-1, group_size)
    if group_size == 1:  # verl's singleton fallback
        mean_B1, std_B1 = torch.zeros_like(r_BG), torch.ones_like(r_BG)
        centred_BG = r_BG
    else:
        mean_B1 = r_BG.mean(dim=1, keepdim=True)
        std_B1 = r_BG.std(dim=1, keepdim=True)
        all_equal_B1 = (r_BG == r_BG[:, :1]).all(dim=1, keepdim=True)
        centred_BG = torch.where(all_equal_B1, torch.zeros_like(r_BG), r_BG - mean_B1)
    if scale == "group":
        adv_BG = centred_BG / (std_B1 + eps)
    elif scale == "batch":
        std = r_N.std() if r_N.numel() > 1 else r_N.new_ones(())
        adv_BG = centred_BG / (std + eps)
    else:
        adv_BG = centred_BG
    return adv_BG.reshape(-1)


def outcome_advantages(rewards: Tensor, group_size: int, estimator: str = "grpo", scale: str = "group",
                       lengths: Tensor | None = None, eps: float = 1e-6) -> Tensor:
    """Outcome advantages, one scalar per response, by `estimator`:

    - ``"grpo"``: :func:`grpo_advantages` with `scale`.
    - ``"rloo"`` (Ahmadian et al. 2024, "Back to Basics"; verl compute_rloo_outcome_advantage): each
      response's reward minus the mean of the other G - 1 in its group, r_i - (sum_g r - r_i) / (G - 1);
      no std scaling. G == 1: the raw reward (no baseline), as GRPO's singleton.
    - ``"reinforce++"`` (Hu 2025; verl compute_reinforce_plus_plus_outcome_advantage with an outcome
      reward and no KL in the reward): the rewards whitened over the whole batch, no group baseline.
    - ``"reinforce++-baseline"`` (verl compute_rf_baseline_outcome_advantage): r - the group mean,
      then whitened over the whole batch.

    Whitening is verl's ``masked_whiten`` over the batch's response tokens: each response counts
    `lengths[i]` times (its tokens; all 1 without `lengths`), mean and unbiased variance token-weighted,
    (x - mean) / sqrt(var + 1e-8). `scale` applies to ``"grpo"`` only. No grad; float32 for integer input.
    """
    if estimator == "grpo":
        return grpo_advantages(rewards, group_size, scale, eps)
    if estimator not in ADV_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; valid: {', '.join(ADV_ESTIMATORS)}")
    if rewards.dim() != 1 or group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"rewards must be 1-D with a positive multiple of group_size ({group_size}) entries, got "
                         f"shape {tuple(rewards.shape)}")
    r_N = rewards.detach() if rewards.is_floating_point() else rewards.detach().float()
    r_BG = r_N.view(-1, group_size)
    if estimator == "rloo":
        if group_size == 1:
            return r_N.clone()
        others_BG = (r_BG.sum(dim=1, keepdim=True) - r_BG) / (group_size - 1)
        all_equal_B1 = (r_BG == r_BG[:, :1]).all(dim=1, keepdim=True)  # exactly 0, as grpo_advantages
        return torch.where(all_equal_B1, torch.zeros_like(r_BG), r_BG - others_BG).reshape(-1)
    x_N = r_N
    if estimator == "reinforce++-baseline" and group_size > 1:
        x_N = (r_BG - r_BG.mean(dim=1, keepdim=True)).reshape(-1)
    w_N = torch.ones_like(x_N) if lengths is None else lengths.detach().to(x_N)
    if w_N.shape != x_N.shape:
        raise ValueError(f"lengths must be [N] = {tuple(x_N.shape)}, got {tuple(w_N.shape)}")
    return _whiten(x_N, w_N)


def _whiten(x_N: Tensor, w_N: Tensor) -> Tensor:
    """verl's masked_whiten of x broadcast over w_N tokens each: token-weighted mean, unbiased
    (Bessel over the token count) variance, (x - mean) * rsqrt(var + 1e-8). Deviation: all values
    equal give exactly 0 (verl's float rounding of the mean can leave ~1e-4 after the rsqrt)."""
    if bool((x_N == x_N[:1]).all()):
        return torch.zeros_like(x_N)
    total = w_N.sum()
    mean = (w_N * x_N).sum() / total.clamp(min=1e-12)
    var = (w_N * (x_N - mean).square()).sum() / total.clamp(min=1e-12)
    var = var * total / (total - 1) if total > 1 else torch.zeros_like(var)
    return (x_N - mean) * torch.rsqrt(var + 1e-8)


def agg_loss(loss_NT: Tensor, mask_NT: Tensor, agg: str = "token-mean", norm_length: int | None = None) -> Tensor:
    """Reduce a per-token loss matrix to a scalar, as verl's ``agg_loss`` (single process).

    - ``token-mean``: sum(loss*mask) / sum(mask) over the whole micro-batch.
    - ``seq-mean-token-mean``: per row sum(loss*mask)/sum(mask), then mean over non-empty rows.
    - ``seq-mean-token-sum``: per row sum(loss*mask), then mean over non-empty rows.
    - ``seq-mean-token-sum-norm`` (Dr. GRPO): sum(loss*mask) over all rows / ``norm_length``
      (verl's ``loss_scale_factor``; default T = ``mask_NT.shape[-1]``). As in verl there is no
      division by N despite the name; pass a constant (max response length) for a loss scale that
      does not depend on the batch's padding.

    Empty rows (mask all zero) are skipped in the seq means, as in current verl. Where verl would
    divide by zero (no token / no non-empty row at all) we return 0 instead of NaN.
    verl's dp_size / global token-count arguments are left to the caller.
    """
    mask_NT = mask_NT.to(loss_NT.dtype)
    if agg == "token-mean":
        return masked_mean(loss_NT, mask_NT)
    tok_sum_N = (loss_NT * mask_NT).sum(dim=-1)
    ntok_N = mask_NT.sum(dim=-1)
    if agg == "seq-mean-token-sum-norm":
        return tok_sum_N.sum() / (mask_NT.shape[-1] if norm_length is None else norm_length)
    if agg == "seq-mean-token-mean":
        seq_N = _safe_div(tok_sum_N, ntok_N)
    elif agg == "seq-mean-token-sum":
        seq_N = tok_sum_N
    else:
        raise ValueError(f"unknown loss aggregation {agg!r}; valid: {', '.join(AGG_MODES)}")
    return masked_mean(seq_N, ntok_N > 0)


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    agg: str = "token-mean",
    norm_length: int | None = None,
    kind: str = "ppo",
    is_weight: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The policy-gradient loss: by `kind` (rl.policy_loss), PPO/GRPO's clipped surrogate (verl
    ``compute_policy_loss_vanilla``), GSPO's sequence-level one or CISPO's clipped-weight REINFORCE.

    Args:
        logp: ``logp_NT`` current-policy token log-probs (carries the gradient).
        old_logp: ``old_logp_NT`` behaviour-policy log-probs (detached here).
        advantages: ``adv_N`` (broadcast over T) or ``adv_NT`` (detached here).
        mask: ``mask_NT`` float or bool, 1 on response tokens.
        clip_low, clip_high: ratio clipped to [1 - clip_low, 1 + clip_high] (DAPO clip-higher).
        dual_clip: c > 1 enables dual-clip PPO: tokens with A < 0 take min(loss, -A * c).
            Deviation: verl always applies it (``clip_ratio_c`` default 3.0); here None disables it.
        agg, norm_length: see :func:`agg_loss`.
        is_weight: ``w_NT`` rollout-correction weights (rl/correction.py), multiplied into each token's
            loss before aggregation (decoupled PPO, verl ``rollout_is_weights``); None: 1.

    ``"ppo"`` (GRPO, DAPO, Dr. GRPO), per token: ratio = exp(clamp(logp - old_logp, -20, 20));
    loss = max(-A * ratio, -A * clamp(ratio, 1 - clip_low, 1 + clip_high)).

    ``"gspo"`` (Zheng et al. 2025, GSPO-token; verl ``compute_policy_loss_gspo``): the ratio of a row is
    its sequence's, s_i = exp(mean over its tokens of (logp - old_logp)), carried per token as
    s_i * pi(y_t) / sg(pi(y_t)) (clamped at exp(10)), so a token's gradient is s_i grad log pi(y_t);
    then PPO's clipped max with clip_low/clip_high on s_i (the paper: 3e-4 / 4e-4) and, as the
    paper's objective, agg ``seq-mean-token-mean``.

    ``"cispo"`` (MiniMax-M1, 2025): loss = -sg(clamp(ratio, 1 - clip_low, 1 + clip_high)) * A * logp:
    the importance weight is truncated and detached, and every token keeps its gradient (PPO's
    clipped tokens get none). clip_frac is the share of tokens whose weight was truncated.

    Returns:
        ``(loss, stats)``: loss is a scalar with grad. stats holds 0-dim *detached tensors* (no host
        sync; call ``.item()`` when logging): ``clip_frac`` (verl pg_clipfrac: masked fraction of
        tokens where the clipped branch is strictly larger), ``clip_frac_lower`` (pg_clipfrac_lower:
        fraction where dual clip binds; 0 when disabled), ``approx_kl`` (ppo_kl: masked mean of the
        clamped old_logp - logp), ``ratio_mean`` (masked mean of the ratio).
    """
    adv_NT, mask_NT = _policy_loss_inputs(logp, old_logp, advantages, mask, dual_clip, agg, kind)

    log_ratio_NT = torch.clamp(logp - old_logp.detach(), -20.0, 20.0)
    ratio_NT = torch.exp(log_ratio_NT)
    if kind == "cispo":
        weight_NT = torch.clamp(ratio_NT, 1.0 - clip_low, 1.0 + clip_high).detach()
        loss_NT = -adv_NT * weight_NT * logp * (1.0 if is_weight is None else is_weight.detach())
        clip_frac = masked_mean((weight_NT != ratio_NT.detach()).to(logp.dtype), mask_NT)
        return agg_loss(loss_NT, mask_NT, agg, norm_length), _stats(clip_frac, logp.new_zeros(()), log_ratio_NT,
                                                                   ratio_NT, mask_NT)
    if kind == "gspo":
        seq_log_ratio_N = masked_mean(logp.detach() - old_logp.detach(), mask_NT, dim=-1)
        ratio_NT = torch.exp(torch.clamp(logp - logp.detach() + seq_log_ratio_N.unsqueeze(-1), max=10.0))
    unclipped_NT = -adv_NT * ratio_NT
    clipped_NT = -adv_NT * torch.clamp(ratio_NT, 1.0 - clip_low, 1.0 + clip_high)
    loss_NT = torch.maximum(unclipped_NT, clipped_NT)
    clip_frac = masked_mean((clipped_NT > unclipped_NT).to(logp.dtype), mask_NT)
    clip_frac_lower = logp.new_zeros(())
    if dual_clip is not None:
        cap_NT = -adv_NT * dual_clip
        neg_NT = adv_NT < 0
        clip_frac_lower = masked_mean(((loss_NT > cap_NT) & neg_NT).to(logp.dtype), mask_NT)
        loss_NT = torch.where(neg_NT, torch.minimum(loss_NT, cap_NT), loss_NT)
    if is_weight is not None:
        loss_NT = loss_NT * is_weight.detach()
    return agg_loss(loss_NT, mask_NT, agg, norm_length), _stats(clip_frac, clip_frac_lower, log_ratio_NT, ratio_NT,
                                                               mask_NT)


def _policy_loss_inputs(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, dual_clip: float | None,
                        agg: str, kind: str) -> tuple[Tensor, Tensor]:
    """policy_loss's arguments checked (a ValueError naming the bad one): (adv_NT detached, mask_NT)
    in logp's dtype."""
    if logp.shape != old_logp.shape or logp.shape != mask.shape or logp.dim() != 2:
        raise ValueError(
            f"logp, old_logp, mask must all be [N, T]; got {tuple(logp.shape)}, "
            f"{tuple(old_logp.shape)}, {tuple(mask.shape)}"
        )
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None to disable), got {dual_clip}")
    if kind not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {kind!r}; valid: {', '.join(POLICY_LOSSES)}")
    if dual_clip is not None and kind != "ppo":
        raise ValueError(f"dual_clip is PPO's (kind='ppo'), not {kind!r}'s")
    if agg not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation {agg!r}; valid: {', '.join(AGG_MODES)}")
    adv = advantages.detach().to(logp.dtype)
    if adv.shape not in (logp.shape[:1], logp.shape):
        raise ValueError(f"advantages must be [N] or [N, T] with N, T = {tuple(logp.shape)}, got {tuple(adv.shape)}")
    return (adv.unsqueeze(-1).expand_as(logp) if adv.dim() == 1 else adv), mask.to(logp.dtype)


def _stats(clip_frac: Tensor, clip_frac_lower: Tensor, log_ratio_NT: Tensor, ratio_NT: Tensor,
           mask_NT: Tensor) -> dict[str, Tensor]:
    return {
        "clip_frac": clip_frac.detach(),
        "clip_frac_lower": clip_frac_lower.detach(),
        "approx_kl": masked_mean(-log_ratio_NT, mask_NT).detach(),
        "ratio_mean": masked_mean(ratio_NT, mask_NT).detach(),
    }


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: str = "k3") -> Tensor:
    """Per-token KL(pi || pi_ref) estimators (Schulman, "Approximating KL divergence").

    Args:
        logp, ref_logp: ``logp_NT`` policy and reference log-probs of the sampled tokens.
        kind: ``"k1"``: logp - ref_logp; ``"k2"``: 0.5 * (logp - ref_logp)^2;
            ``"k3"`` (verl ``low_var_kl``): d = clamp(ref_logp - logp, -20, 20),
            clamp(exp(d) - d - 1, -10, 10); non-negative.

    Returns:
        ``kl_NT`` unreduced (aggregate with :func:`agg_loss` and a mask).
    """
    if kind == "k1":
        return logp - ref_logp
    if kind == "k2":
        return 0.5 * (logp - ref_logp).square()
    if kind == "k3":
        d_NT = torch.clamp(ref_logp - logp, -20.0, 20.0)
        return torch.clamp(torch.exp(d_NT) - d_NT - 1.0, -10.0, 10.0)
    raise ValueError(f"unknown KL estimator {kind!r}; valid: {', '.join(KL_KINDS)}")
