"""Gradient health: the end of every optimizer step, shared by the SFT and GRPO recipes.

    health = GradHealth(model, plan, cfg.health)
    ... scaler.scale(loss).backward() ...
    row = health.step(optimizer, scaler, max_grad_norm, loss)   # unscale, measure, clip, step or skip

Per step it records the global grad norm and one per parameter group (the tiers: vision,
projector, language; with LoRA these are the tiers' adapters), skips any step whose gradients or
loss are not finite (with fp16 the loss scaler also backs off), names the groups that went bad,
aborts after `max_bad_steps` bad steps in a row, and (SFT) warns when the loss jumps above
`spike_factor` x its recent median and by at least `spike_min_rise` nats (`LossSpikes`).
Everything it measures goes into the step's metrics row.
"""

from __future__ import annotations

import math
import statistics
import sys
from collections import deque

import torch
from torch import nn
from tqdm import tqdm

from vlforge.config import HealthConfig
from vlforge.model.tiers import tier_of_param


class TrainingDiverged(RuntimeError):
    """Too many consecutive steps with non-finite gradients; the message names the groups."""


def _local_grads(params: list[nn.Parameter]) -> tuple[list[torch.Tensor], object]:
    """The gradients as plain tensors, and the device mesh over whose ranks they sum to the whole
    (None when they are whole already). FSDP2's parameters and gradients are DTensors sharded on
    dim 0 of a 1-D mesh: each element lives on exactly one rank, so squares summed locally and
    all-reduced are the global sum. Working on the local shards keeps the step's norm and clip to
    two foreach kernels and one collective: through DTensor each per-parameter op pays its
    sharding propagation on the host (~25 us a parameter; ~600 parameters of a 2B model made the
    FSDP2 step host-bound). The mesh comes from the parameters, which are DTensors whether or not
    a step gave them a gradient, so every rank takes the same collective path."""
    from torch.distributed.tensor import DTensor, Shard

    sharded = [isinstance(p, DTensor) for p in params]
    if any(sharded) and not all(sharded):
        raise ValueError("a parameter group mixes sharded (FSDP2) and plain parameters: its norm would count "
                         "the plain ones once per rank")
    mesh = None
    if params and sharded[0]:
        mesh = params[0].device_mesh
        if mesh.ndim != 1 or not all(isinstance(pl, Shard) for p in params for pl in p.placements):
            raise ValueError(f"parameters placed {params[0].placements} on a {mesh.ndim}-D mesh: expected FSDP2's "
                             "1-D dim-0 sharding")
    # not to_local(): an autograd op per call, ~20 us each (no graph here)
    grads = [p.grad._local_tensor if s else p.grad for p, s in zip(params, sharded) if p.grad is not None]
    return grads, mesh


def _by_device_and_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """foreach kernels take one device and dtype per call (mixed lists fall back to a loop)."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return list(groups.values())


def grad_norms(groups: dict[str, list[nn.Parameter]]) -> dict[str, float]:
    """L2 norm of each group's gradients, fetched from the device in one transfer. Under FSDP2 the
    gradients are sharded: the groups' squared norms are summed over the ranks in one all-reduce,
    so every rank gets the whole gradient's norms and makes the same skip and clip decision. Under
    DDP they are plain tensors DDP has already averaged over the ranks: the same on every rank
    without a collective. A group without gradients this step (e.g. the vision tower on a
    text-only step) has norm 0."""
    params = [p for ps in groups.values() for p in ps]
    if not params:
        return dict.fromkeys(groups, 0.0)
    device = params[0].device  # the parameters', whether or not this step gave a group gradients
    squares, mesh = [], None
    for ps in groups.values():
        grads, group_mesh = _local_grads(ps)
        mesh = mesh or group_mesh
        total = torch.zeros((), dtype=torch.float32, device=device)
        for same in _by_device_and_dtype(grads):  # each norm in fp32: bf16 gradients' norms would round
            total = total + torch.stack(torch._foreach_norm(same, 2, dtype=torch.float32)).square().sum().to(device)
        squares.append(total)
    squares = torch.stack(squares)
    if mesh is not None and mesh.size() > 1:
        # on the mesh's device: with cpu_offload the shards (and so the squares) are on the CPU, and an
        # NCCL group takes CUDA tensors only
        squares = squares.to(mesh.device_type)
        torch.distributed.all_reduce(squares, group=mesh.get_group())
    return dict(zip(groups, squares.sqrt().tolist()))


def clips_in_optimizer(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler) -> bool:
    """Whether the clip can ride in the optimizer's update: torch's fused Adam/AdamW divides every
    gradient by the tensor in its `grad_scale` attribute inside its one kernel (the hook GradScaler
    uses to unscale fp16 gradients), so the clip costs no pass of its own over the gradients (at 2B
    full fine-tuning ~4 ms a step on an H200, a foreach read and write of 8.5 GB: docs/benchmarks-log.md,
    2026-12-03, "FSDP2 + `cpu_offload`"). Not with the loss scaler on (fp16: GradScaler.step sets grad_scale itself),
    nor for other optimizers (bitsandbytes' 8-bit ones, torch's foreach AdamW ignore or refuse it)."""
    fused = isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) and bool(optimizer.defaults.get("fused"))
    return (fused or getattr(optimizer, "takes_grad_scale", False)) and not scaler.is_enabled()


def clip_to(params: list[nn.Parameter], max_norm: float, total: float) -> None:
    """Scale gradients so their global norm is at most max_norm, given that norm (a Python float:
    the same multiplier on every rank's shards)."""
    coef = max_norm / (total + 1e-6)
    if coef < 1.0:
        for same in _by_device_and_dtype(_local_grads(params)[0]):
            torch._foreach_mul_(same, coef)


class LossSpikes:
    """Loss-spike detector: call it with each finite step loss; returns loss / recent median for
    a spike, else None.

    A spike is a loss above `spike_factor` x the median of the last `spike_window` losses that is
    also at least `spike_min_rise` nats above that median. The ratio alone misleads: with small
    batches the per-batch loss is heavy-tailed, and a few hard samples in a batch lift a median
    of 0.002 to 0.2 (100x) or of 0.2 to 1.0 (healthy runs of the demo recipe did both). A rise of
    under a nat (the targets' geometric-mean probability falling less than e-fold) is that kind
    of noise; instabilities add several nats.
    """

    def __init__(self, cfg: HealthConfig):
        self.cfg = cfg
        self.recent: deque[float] = deque(maxlen=cfg.spike_window)

    def __call__(self, loss: float) -> float | None:
        ratio = None
        if len(self.recent) == self.recent.maxlen:  # no judgement before the window has filled
            median = statistics.median(self.recent)
            # a median <= 0 is no cross-entropy (GRPO-like losses): no scale to compare against
            if median > 0 and loss > self.cfg.spike_factor * median and loss - median >= self.cfg.spike_min_rise:
                ratio = loss / median
        self.recent.append(loss)
        return ratio


class GradHealth:
    def __init__(self, model: nn.Module, plan: list, cfg: HealthConfig, precision_mode: str = "bf16",
                 spikes: bool = True):
        self.cfg = cfg
        self.precision_mode = precision_mode
        self.spikes = spikes  # off for GRPO: a policy-gradient loss is not a positive error that should fall
        self.groups: dict[str, list[nn.Parameter]] = {}
        for name, p in model.named_parameters():
            if p.requires_grad:
                self.groups.setdefault(tier_of_param(name, plan) or "other", []).append(p)
        self.bad_streak = 0
        self.loss_spikes = LossSpikes(cfg)

    def step(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
             max_grad_norm: float | None, loss: float) -> dict:
        """Unscale, measure per-group norms, clip, then step or skip. Returns the step's metrics."""
        if hasattr(optimizer, "fold_held_gradients"):  # fp32 sums of earlier micro-batches (MasterWeightAdamW)
            optimizer.fold_held_gradients()
        scaler.unscale_(optimizer)
        norms = grad_norms(self.groups)
        total = math.sqrt(sum(n * n for n in norms.values()))  # inf/nan propagate
        bad_groups = sorted(g for g, n in norms.items() if not math.isfinite(n))
        finite = math.isfinite(total) and math.isfinite(loss)
        if finite:
            params = [p for ps in self.groups.values() for p in ps]
            clip = bool(max_grad_norm) and max_grad_norm / (total + 1e-6) < 1.0
            if clip and clips_in_optimizer(optimizer, scaler):
                # the update divides each gradient by (total + 1e-6) / max_norm: clip_to's multiplier, inverted
                # (torch.full with a Python scalar is a fill kernel: no host-device copy, no sync)
                optimizer.grad_scale = torch.full((), (total + 1e-6) / max_grad_norm, dtype=torch.float32,
                                                  device=_local_grads(params)[0][0].device)
                try:
                    optimizer.step()
                finally:
                    del optimizer.grad_scale
            else:
                if clip:
                    clip_to(params, max_grad_norm, total)
                scaler.step(optimizer)
        elif scaler.is_enabled():
            scaler.step(optimizer)  # the scaler sees the inf/nan, skips the update and backs off
        scale = scaler.get_scale() if scaler.is_enabled() else None
        scaler.update()
        optimizer.zero_grad(set_to_none=True)  # a skipped step's gradients never reach the weights

        row = {"grad_norm": total, **{f"grad_norm/{g}": n for g, n in norms.items()}, "skipped": not finite}
        if scale is not None:
            row["loss_scale"] = scale
        if finite:
            self.bad_streak = 0
            if self.spikes:
                row.update(self._spike(loss))
        else:
            self.bad_streak += 1
            row["nonfinite_groups"] = bad_groups or ["loss"]
            self._abort_if_diverged(bad_groups, loss)
        return row

    def _spike(self, loss: float) -> dict:
        ratio = self.loss_spikes(loss)
        if ratio is None:
            return {}
        median = loss / ratio
        tqdm.write(f"warning: loss spike {loss:.4g} > {self.cfg.spike_factor:g} x recent median {median:.4g} "
                   f"(+{loss - median:.3g} nats)", file=sys.stderr)
        return {"loss_spike": ratio}

    def _abort_if_diverged(self, bad_groups: list[str], loss: float) -> None:
        what = f"non-finite gradients in {', '.join(bad_groups)}" if bad_groups else f"a non-finite loss ({loss})"
        if self.bad_streak < self.cfg.max_bad_steps:
            tqdm.write(f"warning: step skipped: {what} ({self.bad_streak} in a row)", file=sys.stderr)
            return
        advice = ("lower that group's learning rate, check its data, or train in bf16"
                  if self.precision_mode != "bf16" else "lower that group's learning rate or check the data")
        if self.precision_mode == "fp16":
            advice += "; with fp16 also try a lower precision.loss_scale.init_scale"
        raise TrainingDiverged(f"{self.bad_streak} consecutive steps skipped ({what}; health.max_bad_steps="
                               f"{self.cfg.max_bad_steps}): {advice}. Checkpoints written so far are intact.")
