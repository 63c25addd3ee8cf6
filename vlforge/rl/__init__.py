"""GRPO reinforcement learning: advantage / loss / KL math (``core``) and reward functions (``rewards``).

The names load on first use (PEP 562): the CLI imports ``rewards``' errors at start, and ``core``
would import torch before a `--help`.
"""

import importlib

_CORE = ("ADV_ESTIMATORS", "ADV_SCALES", "AGG_MODES", "KL_KINDS", "POLICY_LOSSES", "agg_loss", "grpo_advantages",
         "outcome_advantages", "kl_penalty", "masked_mean", "policy_loss")
_REWARDS = ("BUILTIN_REWARDS", "CombinedReward", "RewardError", "RewardResult", "RewardSpec", "batched",
            "build_rewards", "choice", "exact_match", "format_reward", "load_reward", "numeric")

__all__ = [*_CORE, *_REWARDS]


def __getattr__(name: str):
    if name in _CORE or name in _REWARDS:
        return getattr(importlib.import_module("vlforge.rl.core" if name in _CORE else "vlforge.rl.rewards"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
