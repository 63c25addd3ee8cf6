"""Sampling on the GPU with no host round-trip: temperature, top-k, top-p, greedy, and the noise.

Shapes: S decode slots (rows), V vocabulary.

The noise of a row's token at step t is one uniform number u = hash(row key, t), and the token is
the inverse CDF of the (filtered) temperature-scaled distribution at u, in vocabulary order. So
a response's tokens depend on (seed, its global row, step) only: not on the other rows, the
batch layout, the slot it sits in or the process that samples it; it needs no torch.Generator
(CUDA-graph capturable; per-request seeds for free). One uniform per row instead of a
Gumbel draw per (row, vocabulary entry) also saves [S, V] random numbers per step.

torch has no counter-based RNG taking per-row keys (torch.Generator is one stream per device), so
the hash is written here: lowbias32 (Chris Wellons' 32-bit integer mix) on int64 tensors holding
32-bit values. u has 23 bits (strictly below 1), so probabilities below ~1.2e-7 of a row's total
are not resolved.
"""

from __future__ import annotations

import torch

M32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9


def mix32(x):
    """lowbias32 on a Python int or an int64 tensor of values < 2**32 (products wrap; & keeps 32 bits)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def row_key(seed: int, row: int) -> int:
    """The noise key of global row `row` of a generation seeded `seed` (any Python int)."""
    seed &= (1 << 64) - 1
    return mix32(mix32(mix32(seed & M32) ^ (seed >> 32)) ^ (row & M32))


def uniform(key_S: torch.Tensor, step_S: torch.Tensor) -> torch.Tensor:
    """u in (0, 1), fp32, a function of (key, step) only."""
    return unit_interval(mix32(key_S ^ mix32((step_S * GOLDEN) & M32)))


def unit_interval(h_S: torch.Tensor) -> torch.Tensor:
    """32-bit hashes -> fp32 in (0, 1) from their top 23 bits: (2**23 - 1) + 0.5 is exact in fp32, so
    u <= 1 - 2**-24 < 1 (with 24 bits the top value rounded to 2**24, u = 1.0, and the draw fell on
    the row's last possible token)."""
    return ((h_S >> 9).float() + 0.5) * (1.0 / (1 << 23))


def drop_mask(x_SV: torch.Tensor, top_k_S: torch.Tensor, top_p_S: torch.Tensor) -> torch.Tensor:
    """True where top-k then top-p removes a token (as generate.forward.filter_logits, per row).

    Rows with top_k 0 and top_p 1 drop nothing (top-p is applied only where top_p < 1, so fp32
    rounding of the cumulative sum never trims an unfiltered row's tail)."""
    V = x_SV.shape[-1]
    sorted_SV, order_SV = x_SV.sort(-1, descending=True)
    k_S = torch.where(top_k_S > 0, top_k_S, V).clamp(max=V)
    # the k-th largest value as a masked max, not sorted_SV.gather(1, k_S - 1): the same value, and no
    # load at an index read from another tensor, which torch 2.11's inductor failed to generate code for
    # here with the slot count dynamic (an H100, 2026-12-08: the compiled filter step ran eager)
    at_k_SV = torch.arange(V, device=x_SV.device)[None, :] == (k_S - 1)[:, None]
    kth_S1 = sorted_SV.masked_fill(~at_k_SV, float("-inf")).amax(-1, keepdim=True)
    below_k = sorted_SV < kth_S1
    probs = sorted_SV.masked_fill(below_k, float("-inf")).softmax(-1)
    beyond_p = (probs.cumsum(-1) - probs > top_p_S[:, None]) & (top_p_S < 1)[:, None]
    drop_sorted = below_k | beyond_p
    return torch.empty_like(drop_sorted).scatter_(1, order_SV, drop_sorted)


def block_size(V: int) -> int:
    """Vocabulary entries per block of the two-level inverse CDF: a power of two dividing V, so the
    [S, V] logits are viewed as [S, V / B, B] without a padded copy (Qwen3's 151,936 = 1,187 x 128)."""
    return next((b for b in (512, 256, 128, 64, 32) if V % b == 0 and V // b >= 8), V)


def inverse_cdf(x_SV: torch.Tensor, u_S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(token [S], logsumexp of x [S]): the first token whose cumulative probability under
    softmax(x) exceeds u, in vocabulary order (entries of zero fp32 probability, -inf ones among
    them, are never drawn).

    Two levels instead of a cumulative sum over V per row (a scan kernel that was 5% of an H200
    decode step at 64 rows): the probability mass of each block of B entries from one logsumexp
    over the [S, V/B, B] view, the block by an inverse CDF over V/B masses, then the token by one
    over that block's B entries. Scaled by each level's own total, so fp32 rounding of the sums
    never sends u past a row's last possible token (and a clamp to it makes sure)."""
    S, V = x_SV.shape
    B = block_size(V)
    x_SNB = x_SV.view(S, V // B, B)
    block_lse_SN = torch.logsumexp(x_SNB, -1)
    lse_S = torch.logsumexp(block_lse_SN, -1)
    mass_SN = (block_lse_SN - lse_S[:, None]).exp()
    cdf_SN = mass_SN.cumsum(-1)
    target_S = u_S * cdf_SN[:, -1]
    block_S = _first_above(cdf_SN, target_S, mass_SN > 0)
    before_S = torch.where(block_S > 0, cdf_SN.gather(1, (block_S - 1).clamp(min=0)[:, None])[:, 0], 0.0)
    mass_S = cdf_SN.gather(1, block_S[:, None])[:, 0] - before_S
    # where u falls inside its block (a block's mass below the rounding of the sum before it can
    # only be reached through _first_above's clamp: the floor keeps 0/0 from making a NaN there)
    fraction_S = ((target_S - before_S) / mass_S.clamp(min=torch.finfo(torch.float32).tiny)).clamp(0.0, 1.0)
    inner_SB = x_SNB.gather(1, block_S[:, None, None].expand(-1, 1, B))[:, 0]
    inner_p_SB = (inner_SB - lse_S[:, None]).exp()
    inner_cdf_SB = inner_p_SB.cumsum(-1)
    within_S = _first_above(inner_cdf_SB, fraction_S * inner_cdf_SB[:, -1], inner_p_SB > 0)
    return block_S * B + within_S, lse_S


def _first_above(cdf_SK: torch.Tensor, target_S: torch.Tensor, possible_SK: torch.Tensor) -> torch.Tensor:
    """The first k with cdf > target, at most the last k that is possible (has fp32 probability > 0)."""
    K = cdf_SK.shape[-1]
    first_S = torch.searchsorted(cdf_SK, target_S[:, None].contiguous(), right=True)[:, 0]
    last_S = (possible_SK * torch.arange(1, K + 1, device=cdf_SK.device)).amax(-1) - 1
    return torch.minimum(first_S, last_S.clamp(min=0))


def sample(logits_SV: torch.Tensor, temperature_S: torch.Tensor, top_k_S: torch.Tensor, top_p_S: torch.Tensor,
           key_S: torch.Tensor, step_S: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [S], log-probs [S]) from fp32 logits (banned tokens already -inf).

    mode: "greedy" (argmax for every row), "sample" (rows with temperature 0 take the argmax),
    "filter" (as sample, with per-row top-k/top-p). Log-probs are log_softmax(logits / T) at the
    token before top-k/top-p (T = 1e-6 for greedy rows, as the rollout path always did), computed
    as x - logsumexp(x): no [S, V] log-softmax is kept.
    """
    greedy_S = temperature_S <= 0
    x_SV = logits_SV / torch.where(greedy_S, 1e-6, temperature_S)[:, None]
    best_S = logits_SV.argmax(-1)
    if mode == "greedy":
        tok_S, lse_S = best_S, torch.logsumexp(x_SV, -1)
    else:
        u_S = uniform(key_S, step_S)
        if mode == "filter":
            tok_S, _ = inverse_cdf(x_SV.masked_fill(drop_mask(x_SV, top_k_S, top_p_S), float("-inf")), u_S)
            lse_S = torch.logsumexp(x_SV, -1)
        else:
            tok_S, lse_S = inverse_cdf(x_SV, u_S)
        tok_S = torch.where(greedy_S, best_S, tok_S)
    logp_S = x_SV.gather(1, tok_S[:, None])[:, 0] - lse_S
    return tok_S, logp_S
