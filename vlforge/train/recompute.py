"""How much activation checkpointing recomputes: `activation_checkpointing.enabled: auto` decided
before the first step from the run's memory, and moved one notch toward more recomputation when a
step still runs out of memory.

    rec = decide_recompute(cfg, t, longest_micro_batch(data.lengths, batch_size, packed, max_tokens), say=print)
    result = redo_on_oom(lambda: train_step(...), t, optimizer, say=print)   # t.recompute is rec

The decision (`choose_recompute`, pure): --plan's per-process estimate (train/memory.py) plus the
activations of the run's longest micro-batch (train/activations.py) at each notch, against the
memory the GPU gives this process (free + what it holds already) less a margin; the least
recomputation that fits. A step that runs out of memory anyway (the estimate's blind spots: the
allocator's fragmentation, workspaces) is dropped and redone one notch further, with the same
micro-batches and RNG state: no data lost, no step counted twice, and the redone step computes
what a run that started at that notch would have.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from vlforge.train.activations import NOTCHES, activation_estimate, describe
from vlforge.train.memory import GB, gpu_total, memory_estimate

# Kept free of the estimate: what it does not count (autocast copies, CUDA and NCCL workspaces, the
# allocator's fragmentation), as a share of the GPU's memory
MARGIN = 0.10


@dataclass
class Recompute:
    """What activation checkpointing does in this run (Trainable.recompute)."""

    every: int  # 0: nothing recomputed; N: 1 of every N blocks (activation_checkpointing.every)
    why: str  # the reason, as printed and written at the top of the run's config.yaml
    auto: bool = False  # chosen by enabled=auto: an out-of-memory step moves it a notch
    moves: list[str] = field(default_factory=list)  # each out-of-memory move, in order
    record: Callable[[], None] | None = None  # rewrites the run's config.yaml (Run.start sets it)

    def note(self) -> str:
        return f"activation_checkpointing: {describe(self.every)} ({self.why})" + "".join(
            f"; then {m}" for m in self.moves)


def next_notch(every: int) -> int | None:
    """The notch after `every` toward more recomputation; None past every block."""
    i = NOTCHES.index(every) if every in NOTCHES else len(NOTCHES) - 1
    return NOTCHES[i + 1] if i + 1 < len(NOTCHES) else None


def longest_micro_batch(lengths: list[int], batch_size: int, packed: bool, max_tokens: int | None) -> int:
    """Tokens of the largest micro-batch the data can form: batch_size of its longest samples,
    padded to the longest (or back to back, packed); at most a token budget. Pure."""
    top = sorted(lengths, reverse=True)[:batch_size]
    tokens = (sum(top) if packed else len(top) * top[0]) if top else 0
    return min(tokens, max_tokens) if max_tokens else tokens


def choose_recompute(needs: dict[int, float], capacity: float, device_total: float, tokens: int) -> Recompute:
    """The least recomputation whose estimate fits: `needs` maps each notch to the run's bytes
    (model, gradients, optimizer state and the activations of a `tokens`-token micro-batch),
    `capacity` the bytes the GPU gives this process, less MARGIN of `device_total`. Pure."""
    room = capacity - MARGIN * device_total
    for every in NOTCHES:
        if needs[every] <= room:
            why = (f"auto: the estimate with {describe(every)}, {needs[every] / GB:.1f} GB for a {tokens:,}-token "
                   f"micro-batch, fits the {capacity / GB:.1f} GB this GPU gives less a {MARGIN:.0%} margin")
            if every:  # and why not less
                less = NOTCHES[NOTCHES.index(every) - 1]
                why += f"; with {describe(less)}, {needs[less] / GB:.1f} GB would not"
            return Recompute(every, why, auto=True)
    return Recompute(1, f"auto: even with every block recomputed the estimate, {needs[1] / GB:.1f} GB for a "
                       f"{tokens:,}-token micro-batch, exceeds the {capacity / GB:.1f} GB this GPU gives less a "
                       f"{MARGIN:.0%} margin: every block, the most it saves (a smaller train.batch_size or "
                       "data.max_tokens_per_batch may fit)", auto=True)


def recompute_needs(model: torch.nn.Module, plan: list, cfg, tokens: int, world_size: int = 1) -> dict[int, float]:
    """Each notch's estimate of a run's bytes per process: `model` the plain (meta-device) model,
    `plan` its tier plan. Pure arithmetic."""
    static = gpu_total(memory_estimate(model, plan, cfg, world_size))
    return {every: static + activation_estimate(model.config, cfg, tokens, every)["total"] for every in NOTCHES}


def fixed_reason(cfg, device: torch.device) -> str | None:
    """Why enabled=auto recomputes nothing here without weighing memory, or None: on a CPU, or
    where recomputation is refused (CUDA graphs, TransformerEngine's layers)."""
    if device.type != "cuda":
        return (f"auto: nothing on {device.type}: activations live in host memory, which is not the limit "
                "there, and recomputation would only add compute")
    if cfg.compile.cuda_graphs:
        return "auto: nothing with compile.cuda_graphs, which records the layers without recomputation"
    if cfg.precision.fp8.enabled and cfg.precision.fp8.backend == "te":
        return "auto: nothing with precision.fp8.backend=te, whose recomputation would run outside te.autocast"
    return None


def decide_recompute(cfg, t, tokens: int, say: Callable[[str], None] = print) -> Recompute:
    """Settle activation checkpointing for the run of Trainable `t` (whose longest micro-batch has
    `tokens` tokens), apply it to the model, say it once, and keep it in t.recompute."""
    ac = cfg.activation_checkpointing
    if ac.enabled is not True and ac.enabled is not False:  # auto
        # estimated with the precision the run settled (master_weights auto: t.policy's, held sums and all)
        settled = dataclasses.replace(cfg, precision=t.policy.cfg)
        # rank 0's choice on every rank: their free memory may differ, their runs should not
        rec = t.world.broadcast(_auto(settled, t, tokens))
        set_recompute(t.model, rec.every)
    else:  # setup_model applied it already
        rec = Recompute(ac.every if ac.enabled else 0, f"activation_checkpointing.enabled={str(ac.enabled).lower()}")
    t.recompute = rec
    say(rec.note())
    return rec


def _auto(cfg, t, tokens: int) -> Recompute:
    if reason := fixed_reason(cfg, t.device):
        # a CPU's torch.OutOfMemoryError (the tests raise one) still moves a notch; refused combinations do not
        return Recompute(0, reason, auto=t.device.type != "cuda")
    from vlforge.model.load import build_meta_model
    from vlforge.model.tiers import build_plan

    meta, _ = build_meta_model(cfg.model)
    needs = recompute_needs(meta, build_plan(meta, cfg.tiers), cfg, tokens, t.world.size)
    free, total = torch.cuda.mem_get_info(t.device)
    return choose_recompute(needs, free + torch.cuda.memory_reserved(t.device), total, tokens)


def set_recompute(model: torch.nn.Module, every: int) -> None:
    """Recompute 1 of every `every` blocks in backward (0: none), whatever was set before."""
    from vlforge.train.trainable import checkpoint_activations, checkpoint_selected_blocks

    if every:
        checkpoint_activations(model, every)
    else:
        checkpoint_selected_blocks(model, 0)


def redo_on_oom(step: Callable[[], dict], t, optimizer, say: Callable[[str], None] = print) -> dict:
    """`step()`; when it raises torch.OutOfMemoryError and t.recompute was chosen (auto) on one
    process: drop the partial step (its gradients, the freed CUDA cache), move one notch toward
    more recomputation and redo it from the same RNG state (the same micro-batches are the
    caller's). Several processes: the other ranks are inside the step's collectives, so it raises."""
    rec = t.recompute
    while True:
        rng = _rng_state(t.device)
        try:
            return step()
        except Exception as e:  # noqa: BLE001 - anything else is raised again at once
            oom = out_of_memory(e)
            auto = oom is not None and rec is not None and rec.auto and t.world.size == 1
            after = next_notch(rec.every) if auto else None
            if after is None:
                raise
            first_line = str(oom).splitlines()[0] if str(oom) else "torch.OutOfMemoryError"
            del oom  # its traceback holds the failed step's frames, and their tensors
        # out of the except clause: the traceback, and the step's tensors its frames hold, are gone
        optimizer.zero_grad(set_to_none=True)
        if t.routing is not None:  # MoE: the expert load counted so far, dropped (not counted twice; a metric only)
            t.routing.step_metrics()
        gc.collect()
        if t.device.type == "cuda":
            torch.cuda.empty_cache()
        set_recompute(t.model, after)
        rec.moves.append(f"out of memory in a step ({first_line[:160]}): {describe(after)}, the step redone")
        rec.every = after
        say(f"activation_checkpointing: {rec.moves[-1]}")
        if rec.record is not None:
            rec.record()
        _set_rng_state(t.device, rng)


def out_of_memory(e: BaseException) -> torch.OutOfMemoryError | None:
    """The torch.OutOfMemoryError `e` is or was raised from: a compiled step's allocation that fails
    while torch.compile compiles or autotunes reaches the caller wrapped (dynamo's BackendCompilerFailed,
    inductor's InductorError, raised `from` it)."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, torch.OutOfMemoryError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def _rng_state(device: torch.device) -> tuple:
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _set_rng_state(device: torch.device, state: tuple) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)
