"""Rollout correction: the rollout engine's log-probs differ from the trainer's (another kernel, a
bf16 or FP8 weight copy, another batch), so the rollout samples from a slightly different policy
than the one the loss's ratio is anchored to. Decoupled PPO (Hilton et al. 2021) weighs each token's
loss by rho = pi_old / pi_rollout, the trainer's recomputed old log-probs (rl.old_logprobs=trainer)
over the rollout's; verl docs/algo/rollout_corr_math.md, sections 3.3-3.4, as formulas:

    token level      log rho_t                      for each response token t
    sequence level   log rho = sum_t log rho_t      (the sequence's product), on each of its tokens
    tis              w = min(rho, cap)              truncated importance sampling; every token kept
    mis              w = rho, kept where lo <= rho <= hi; a token (sequence) outside the band is
                     masked: out of the loss and of its aggregation's denominators (slime's MIS,
                     IS weights apart from the rejection)

The weights are constants (no gradient). log rho is clamped to [-20, 20] before exp, as verl's
safety bound. Shapes as rl/core.py: N rows, T response tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

CORRECTIONS = ("none", "tis", "mis")
LEVELS = ("token", "sequence")
_LOG_BOUND = 20.0  # exp(20) ~ 4.9e8: a finite weight for any ratio (verl's SAFETY_BOUND)


def rollout_correction(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, method: str = "tis",
                       level: str = "token", cap: float = 2.0, band: tuple[float, float] = (0.5, 2.0)
                       ) -> tuple[Tensor, Tensor, Tensor]:
    """(weight_NT, mask_NT, corrected_NT): the importance weight of each token (1 with method "none";
    0 where masked or padding), the loss mask after MIS's rejection (`mask` itself otherwise), both
    detached and in `old_logp`'s dtype, and which response tokens the correction changed (bool: tis
    truncated them, rho > cap; mis masked them). `old_logp`, `rollout_logp`: [N, T] log-probs of the sampled tokens by the
    trainer before the update and by the rollout; `mask`: [N, T] 1 on response tokens."""
    if old_logp.shape != rollout_logp.shape or old_logp.shape != mask.shape or old_logp.dim() != 2:
        raise ValueError(f"old_logp, rollout_logp, mask must all be [N, T]; got {tuple(old_logp.shape)}, "
                         f"{tuple(rollout_logp.shape)}, {tuple(mask.shape)}")
    if method not in CORRECTIONS or level not in LEVELS:
        raise ValueError(f"method one of {CORRECTIONS}, level one of {LEVELS}; got {method!r}, {level!r}")
    mask_NT = mask.to(old_logp.dtype)
    if method == "none":
        return mask_NT.clone(), mask_NT, torch.zeros_like(mask_NT, dtype=torch.bool)
    log_rho_NT = (old_logp.detach() - rollout_logp.detach()) * mask_NT
    if level == "sequence":
        log_rho_NT = log_rho_NT.sum(-1, keepdim=True).expand_as(log_rho_NT)
    rho_NT = torch.exp(log_rho_NT.clamp(-_LOG_BOUND, _LOG_BOUND))
    on_NT = mask_NT > 0
    if method == "tis":
        return torch.clamp(rho_NT, max=cap) * mask_NT, mask_NT, (rho_NT > cap) & on_NT
    inside_NT = (rho_NT >= band[0]) & (rho_NT <= band[1])
    kept_NT = mask_NT * inside_NT.to(mask_NT.dtype)
    return rho_NT * kept_NT, kept_NT, ~inside_NT & on_NT


def mismatch_stats(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """How far the rollout's log-probs are from the trainer's, over the response tokens (0-dim
    detached tensors): `k3_kl_sum` (sum over tokens of rho - log rho - 1, Schulman's k3 estimator of
    KL(rollout || trainer), >= 0), `log_ratio_abs_sum` and `log_ratio_abs_max` (|log rho|), `tokens`."""
    mask_NT = mask.to(old_logp.dtype)
    log_rho_NT = ((old_logp - rollout_logp).detach() * mask_NT).clamp(-_LOG_BOUND, _LOG_BOUND)
    k3_NT = (torch.exp(log_rho_NT) - log_rho_NT - 1.0) * mask_NT
    return {"k3_kl_sum": k3_NT.sum(), "log_ratio_abs_sum": log_rho_NT.abs().sum(),
            "log_ratio_abs_max": log_rho_NT.abs().max() if log_rho_NT.numel() else log_rho_NT.new_zeros(()),
            "tokens": mask_NT.sum()}
