"""GRPO reinforcement learning: advantage / loss / KL math (``core``) and reward functions (``rewards``)."""

from vlforge.rl.core import (
    ADV_SCALES,
    AGG_MODES,
    KL_KINDS,
    agg_loss,
    grpo_advantages,
    kl_penalty,
    masked_mean,
    policy_loss,
)
from vlforge.rl.rewards import (
    BUILTIN_REWARDS,
    CombinedReward,
    RewardError,
    RewardResult,
    RewardSpec,
    build_rewards,
    choice,
    exact_match,
    format_reward,
    load_reward,
    numeric,
)

__all__ = [
    "ADV_SCALES",
    "AGG_MODES",
    "KL_KINDS",
    "agg_loss",
    "grpo_advantages",
    "kl_penalty",
    "masked_mean",
    "policy_loss",
    "BUILTIN_REWARDS",
    "CombinedReward",
    "RewardError",
    "RewardResult",
    "RewardSpec",
    "build_rewards",
    "choice",
    "exact_match",
    "format_reward",
    "load_reward",
    "numeric",
]
