"""GRPO's metrics row of a step (docs/grpo.md lists its keys): rewards, advantages, lengths, the
groups trained, time and tokens/s, tools' call rates and judges' unparsed replies, every rank's."""

from __future__ import annotations

import torch

from vlforge.rl.judge import ModelJudge
from vlforge.rollout.minibatch import Batch
from vlforge.train.distributed import World


def judge_metrics(rewards, world: World) -> dict:
    """`reward/<key>/unparsed_frac` of each judge reward (rl/judge.py): the share of the step's
    replies, every rank's, that gave no score (and scored 0)."""
    row = {}
    for key, fn in zip(rewards.keys, rewards.fns):
        if isinstance(fn, ModelJudge):
            unparsed, scored = world.sums(*fn.take_counts())
            if scored:
                row[f"reward/{key}/unparsed_frac"] = unparsed / scored
    return row


def step_metrics(stats: dict, batches: list[Batch], train_logs: dict, t_rollout: float, t_train: float,
                 world: World = World(), group_size: int | None = None) -> dict:
    """The step's row; `stats` already hold every rank's rollouts, `batches` this rank's."""
    reward = torch.cat(stats["reward"])
    lengths = torch.cat(stats["lengths"])
    adv = torch.cat([b.advantages[b.seqs].cpu() for b in batches]) if batches else torch.zeros(0)
    adv = torch.cat(world.gather_objects(adv))  # every rank's kept sequences (ranks may hold different counts)
    adv = adv if len(adv) else torch.zeros(1)
    G = group_size or (batches[0].rollout.group_size if batches else 1)
    tokens = world.sum(sum(int(b.rollout.prompt_mask.sum()) * b.rollout.group_size + int(b.rollout.response_mask.sum())
                           for b in batches))
    row = {
        "reward_mean": float(reward.mean()), "reward_std": float(reward.std()) if len(reward) > 1 else 0.0,
        **{f"reward/{k}": sum(v) / len(v) for k, v in stats["per_fn"].items()},
        "accuracy": sum(stats["correct"]) / len(stats["correct"]),
        "adv_mean": float(adv.mean()), "adv_std": float(adv.std()) if len(adv) > 1 else 0.0,
        "adv_max": float(adv.max()), "adv_min": float(adv.min()),
        "response_length_mean": float(lengths.mean()), "response_length_max": float(lengths.max()),
        "truncated_frac": 1.0 - float(torch.cat(stats["finished"]).mean()),
        "zero_var_group_frac": float(torch.cat(stats["zero_var"]).mean()),
        "groups_trained": int(world.sum(sum(len(b.seqs) for b in batches))) // G,
        "time_rollout_s": t_rollout, "time_train_s": t_train,
        "tokens_per_s": tokens / max(t_rollout + t_train, 1e-9),
    }
    tool_stats = stats.get("tools") or {}
    if calls := tool_stats.get("calls"):  # multi-turn tool rollouts (tools.names): every rank's responses
        row["tool/calls_mean"] = sum(calls) / len(calls)
        row["tool/failed_frac"] = sum(tool_stats["failed_calls"]) / max(sum(calls), 1)
        row["tool/turns_mean"] = sum(tool_stats["turns"]) / len(tool_stats["turns"])
        # responses ended because their calls' results (a tool's images, say) would not fit max_new_tokens
        row["tool/unshown_frac"] = sum(tool_stats["unshown"]) / len(tool_stats["unshown"])
    return {**row, **train_logs}
