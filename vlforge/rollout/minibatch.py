"""GRPO's update plan: the step's kept groups as batches, which sequences each optimizer step of the
update takes on each rank and the loss weight of each part, and the log-probs the update compares
against (the trainer's own before the first update, rl.old_logprobs=trainer, and the reference's
for the KL). recipes/grpo.update runs the plan: per mini-batch, log-probs, policy loss + KL,
backward, step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlforge.data.inline import DataError
from vlforge.train.distributed import World
from vlforge.train.sharding import Root, reshard_all
from vlforge.train.moe import follow
from vlforge.train.trainable import Trainable
from vlforge.model.host_inputs import host_to_device
from vlforge.rollout.groups import Rollout
from vlforge.rl.correction import mismatch_stats, rollout_correction
from vlforge.rollout.logprobs import PackedLayout, route_rows, sequence_logprobs, token_mask


@dataclass
class Batch:
    """One rollout round's kept groups, ready for optimisation."""

    rollout: Rollout
    seqs: list[int]  # sequence indices (of kept groups) in the rollout
    advantages: torch.Tensor  # [N] per sequence of the rollout
    ref_logp: torch.Tensor | None  # [len(seqs), R]
    kept_rows: list[int] | None = None  # seqs' positions among the step's kept sequences of every rank
    old_logp: torch.Tensor | None = None  # [len(seqs), R]: rl.old_logprobs=trainer's, else the rollout's
    is_weight: torch.Tensor | None = None  # [len(seqs), R]: rl.rollout_correction's weights (None: 1)
    kept_mask: torch.Tensor | None = None  # [len(seqs), R]: the loss mask after MIS's rejection

    def loss_mask(self, part: list[int]) -> torch.Tensor:
        """[len(part), R] float: the loss mask of rows `part` (positions in seqs), rollout correction's
        rejected tokens out (they leave the aggregation's denominators too)."""
        if self.kept_mask is not None:
            return self.kept_mask[part].float()
        return self.rollout.loss_mask[[self.seqs[i] for i in part]].float()


def reference_logprobs(t: Trainable, ref_model, batch: Batch, temperature: float, packing: bool = False,
                       replay: bool = False) -> torch.Tensor:
    """`replay` (rollout.router_replay: true, MoE): the reference runs the rollout's experts too, as
    the policy does, so the KL compares the weights and not two routings (0 before the first update).
    The full fine-tuning copy (one process, DDP) is a deepcopy of the policy: its routers carry the
    same hooks; FSDP2's sharded copy gets them from the policy's Routing (Routing.attach)."""
    routes = route_rows(batch.rollout, batch.seqs, packing) if replay else None
    with torch.no_grad(), t.policy.autocast(), follow(t.routing, routes, replay=True):
        if ref_model is None:  # LoRA: the base model is the reference, no second copy
            reshard_all(t.root)  # peft toggles requires_grad: on the sharded parameters, not gathered copies
            with t.model.disable_adapter():
                logp = t.forward(sequence_logprobs, batch.rollout, temperature, seq_index=batch.seqs,
                                 keep_vision=t.world.sharded, packing=packing)[0]
                reshard_all(t.root)
            return logp
        if isinstance(ref_model, Root):  # FSDP2's sharded copy (its root): every rank runs the vision units
            return ref_model(sequence_logprobs, batch.rollout, temperature, seq_index=batch.seqs, packing=packing,
                             keep_vision=True)[0]
        return sequence_logprobs(ref_model, batch.rollout, temperature, seq_index=batch.seqs, packing=packing)[0]


def trainer_logprobs(t: Trainable, batch: Batch, temperature: float, packing: bool = False,
                     replay: bool = False) -> torch.Tensor:
    """The trainer's own log-probs of `batch`'s responses before the step's first update
    (rl.old_logprobs=trainer, verl's recomputed old log-probs): the importance ratio's denominator in
    place of the rollout engine's, whose numerics differ (bf16 weight copies, another attention
    kernel, CUDA graphs) by as much as GSPO's clip band. No gradient; MoE routes as in the update.
    [len(seqs), R]"""
    routes = route_rows(batch.rollout, batch.seqs, packing)
    with torch.no_grad(), t.policy.autocast(), follow(t.routing, routes, replay):
        return t.forward(sequence_logprobs, batch.rollout, temperature, seq_index=batch.seqs,
                         keep_vision=t.world.sharded, packing=packing)[0]


def token_rows(rollout: Rollout, seqs: list[int], packing: bool = False) -> torch.Tensor:
    """[n, P + R] mask of the token rows sequence_logprobs runs for `seqs` (prompt + response):
    the rows an MoE router sees, padding left out of the load-balancing loss and the load metrics.
    Packed: [1, T], the row's tokens (all real)."""
    rows = token_mask(rollout, seqs)  # on the host copies (no sync), as sequence_logprobs lays out its rows
    return host_to_device(PackedLayout.of(rows).pack(rows) if packing else rows, rollout.prompt_ids.device)


def mini_batches(batches: list[Batch], size: int) -> list[list[tuple[Batch, list[int]]]]:
    """Consecutive mini-batches of `size` sequences over all kept groups, across rollout rounds.

    Each mini-batch is a list of parts (batch, positions in batch.seqs): a part's sequences share
    one rollout (its prompts and images), so its log-probs are computed together.
    """
    flat = [(b, i) for b in batches for i in range(len(b.seqs))]
    out = []
    for s in range(0, len(flat), size):
        parts: list[tuple[Batch, list[int]]] = []
        for b, i in flat[s:s + size]:
            if parts and parts[-1][0] is b:
                parts[-1][1].append(i)
            else:
                parts.append((b, [i]))
        out.append(parts)
    return out


def part_weights(masks: list[torch.Tensor], agg: str, world: World = World()) -> list[float]:
    """Weights that make the sum of per-part aggregated losses equal the loss of the concatenated
    mini-batch: parts' shares of its tokens (token-mean) or non-empty sequences (seq-mean-*), the
    mini-batch being every rank's parts; Dr. GRPO's sum over a constant simply adds up."""
    if agg == "seq-mean-token-sum-norm":
        return [1.0] * len(masks)
    units = [float(m.sum()) if agg == "token-mean" else float((m.sum(-1) > 0).sum()) for m in masks]
    total = world.sum(sum(units))
    return [u / total if total > 0 else 0.0 for u in units]


def check_spare(world: World, short: bool) -> None:
    """Every rank stops together when one (`short`: it needs a pad and has no sequence to pad with)
    cannot take part: raising on that rank alone would leave the others waiting in a collective."""
    if world.sum(float(short)) > 0:
        raise DataError("a rank has no sequence of its own this step (every one of its prompts failed to decode, "
                        "data.on_error=skip) to take part in the other ranks' updates"
                        + (" (this rank)" if short else "") + ": run `vlforge data check` and fix or drop those rows")


def rank_mini_batches(batches: list[Batch], mini_batch_size: int, world: World, spare: Batch | None) -> list[list]:
    """This rank's parts of each of the step's mini-batches. One process: mini_batches. Several:
    as many mini-batches as one process makes of every rank's kept sequences, each rank's own
    split evenly over them (ranks hold unequal shares when their prompts' groups were kept
    unequally: dynamic sampling, data.on_error=skip), then padded so that every rank takes part in
    every optimizer step: each mini-batch with at least one part (DDP: one gradient all-reduce per
    step) or, sharded, as many parts as the rank with most (FSDP2: every forward and backward is a
    collective). A pad is (spare, None): one sequence's forward whose loss is multiplied by 0, so
    its gradients are exact zeros."""
    if world.size == 1:
        return mini_batches(batches, mini_batch_size)
    mine = sum(len(b.seqs) for b in batches)
    count = -(-int(world.sum(mine)) // mini_batch_size)  # one process's number of mini-batches
    plan = mini_batches(batches, max(1, -(-mine // count)))
    shapes = world.gather_objects([len(parts) for parts in plan])
    out, short = [], False
    for m in range(count):
        parts = list(plan[m]) if m < len(plan) else []
        need = max(shape[m] if m < len(shape) else 0 for shape in shapes) if world.sharded else 1
        short = short or (len(parts) < need and spare is None)
        out.append(parts + [(spare, None)] * (need - len(parts)))
    check_spare(world, short)
    return out


def logprobs_before_update(t: Trainable, ref_model, batches: list[Batch], spare: Batch | None, temperature: float,
                           kl: bool, recompute: bool, packing: bool, replay: bool) -> list[float]:
    """Set each batch's `old_logp` (`recompute`: rl.old_logprobs=trainer) and `ref_logp` (`kl`), before
    the step's first update. Returns [sum over response tokens of (rollout - trainer) log-prob, their
    count] (zeros without `recompute`). Sharded, each forward is a collective: as many on every rank,
    in one order (the ranks with fewer batches run `spare` for nothing)."""
    world, gap = t.world, [0.0, 0.0]
    if not (kl or recompute):
        return gap
    pads = max(world.gather_objects(len(batches))) - len(batches) if world.sharded else 0
    if world.sharded:  # before any forward: a collective between forwards would cross the others' all-gathers
        check_spare(world, bool(pads) and spare is None)
    for b in [*batches, *[spare] * pads]:
        old = trainer_logprobs(t, b, temperature, packing, replay) if recompute else None
        ref = reference_logprobs(t, ref_model, b, temperature, packing, replay) if kl else None
        if b is not spare:  # [len(seqs), R] each
            b.old_logp, b.ref_logp = old, ref
            if recompute:
                mask = b.rollout.loss_mask[b.seqs].to(old.dtype)
                gap[0] += float(((b.rollout.logprobs[b.seqs] - old) * mask).sum())
                gap[1] += float(mask.sum())
    return gap


def correct_rollouts(batches: list[Batch], world: World, method: str, level: str, cap: float,
                     band: tuple[float, float]) -> dict[str, float]:
    """After logprobs_before_update (old_logp: the trainer's): each batch's rollout-correction weights
    and mask (rl/correction.py; method "none" sets neither), and the step's rollout/trainer mismatch
    over every rank's response tokens: rollout/k3_kl (mean), rollout/log_ratio_abs_mean and _max,
    rollout/corrected_frac (the share of tokens truncated by tis or masked by mis)."""
    sums = dict.fromkeys(("k3_kl_sum", "log_ratio_abs_sum", "tokens", "corrected"), 0.0)
    largest = 0.0
    for b in batches:
        rollout_logp, mask = b.rollout.logprobs[b.seqs], b.rollout.loss_mask[b.seqs]
        stats = mismatch_stats(b.old_logp, rollout_logp, mask)
        for k in ("k3_kl_sum", "log_ratio_abs_sum", "tokens"):
            sums[k] += float(stats[k])
        largest = max(largest, float(stats["log_ratio_abs_max"]))
        if method == "none":
            continue
        b.is_weight, b.kept_mask, corrected = rollout_correction(b.old_logp, rollout_logp, mask, method, level, cap,
                                                                 band)
        sums["corrected"] += float(corrected.sum())
    k3, abs_sum, tokens, corrected = world.sums(*sums.values())
    tokens = max(tokens, 1.0)
    return {"rollout/k3_kl": k3 / tokens, "rollout/log_ratio_abs_mean": abs_sum / tokens,
            "rollout/log_ratio_abs_max": max(world.gather_objects(largest)),
            **({"rollout/corrected_frac": corrected / tokens} if method != "none" else {})}
