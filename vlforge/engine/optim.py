"""AdamW (torch fp32 or bitsandbytes 8-bit) over per-tier param groups, and the warmup + decay
learning-rate schedule."""

from __future__ import annotations

import importlib.util
import math

import torch

from vlforge.config import ConfigError, OptimConfig

# bitsandbytes' 8-bit optimizers keep a tensor's moments in uint8 only from this many elements
# (its `min_8bit_size` default); smaller tensors (biases, norms) keep fp32 moments.
MIN_8BIT_SIZE = 4096
BLOCK = 256  # values per fp32 absmax scale in bitsandbytes' blockwise 8-bit state


def lr_factor(step: int, total: int, warmup: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of each group's peak lr at optimizer step `step` (0-based). Pure; tested."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "linear":
        decay = 1.0 - progress
    else:
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_ratio + (1.0 - min_ratio) * decay


def optimizer_problem(cfg: OptimConfig, device_type: str, sharded: bool) -> str | None:
    """Why `cfg.name` cannot run here (None: it can). Pure; called before any model loads.

    `sharded`: parameters are FSDP2 DTensors. bitsandbytes (0.50) 8-bit AdamW refuses them: its update
    kernel is a custom op with no DTensor rule ("got mixed torch.Tensor and DTensor"), checked with a
    2-process gloo `fully_shard` run. Running it on the local shards instead would quantize blocks per
    shard, so the state would depend on the world size and could not be resumed on another one."""
    if cfg.name == "adamw":
        return None
    if sharded:
        return (f"optim.name={cfg.name} does not work under FSDP2: bitsandbytes' 8-bit update takes plain "
                "tensors, not FSDP2's sharded (DTensor) parameters. Use optim.name=adamw (sharding already "
                "splits its state across GPUs; distributed.cpu_offload moves it to host memory), or "
                "train on one process (distributed.strategy=none)")
    if cfg.name == "paged_adamw8bit" and device_type != "cuda":
        return (f"optim.name=paged_adamw8bit pages optimizer state between GPU and host memory, which needs "
                f"CUDA; this run is on {device_type}: use optim.name=adamw8bit (or adamw)")
    if device_type not in ("cuda", "cpu"):
        return (f"optim.name={cfg.name}: bitsandbytes has no 8-bit optimizer kernels for {device_type}; "
                "use optim.name=adamw")
    if importlib.util.find_spec("bitsandbytes") is None:
        return f"optim.name={cfg.name} needs bitsandbytes: pip install 'vlforge[quant]' (or use optim.name=adamw)"
    return None


def state_bytes(numel: int, name: str) -> int:
    """Bytes of optimizer state one parameter tensor of `numel` values gets (the step count aside)."""
    if name == "adamw" or numel < MIN_8BIT_SIZE:
        return 8 * numel  # two fp32 moments
    return 2 * numel + 2 * 4 * -(-numel // BLOCK)  # two uint8 moments + their fp32 block scales


class ShardLocalAdamW(torch.optim.AdamW):
    """torch's AdamW whose update runs on the local shards of FSDP2's DTensor parameters.

    AdamW is elementwise, so updating each rank's shard alone is the same update. Through DTensor,
    the fused (or foreach) kernel's list arguments pay DTensor's sharding propagation on the host
    for every parameter at every step (pytorch/pytorch#134191: AdamW CPU-bound under FSDP2), which
    the library offers no switch to skip. The state (moments, step) is created by AdamW itself, so
    it stays DTensors: checkpoints (DCP) and resharding to another world size see the usual
    optimizer. Plain tensors pass through unchanged."""

    def _init_group(self, group, params, grads, *state_lists):  # torch's hook that lists a group's tensors
        from torch.distributed.tensor import DTensor

        has_complex = super()._init_group(group, params, grads, *state_lists)
        for tensors in (params, grads, *state_lists):
            # _local_tensor, not to_local(): a view of the shard's storage, so in-place updates reach
            # the parameter, and no autograd op per tensor (~20 us each)
            tensors[:] = [t._local_tensor if isinstance(t, DTensor) else t for t in tensors]
        return has_complex


def build_optimizer(groups: list[dict], cfg: OptimConfig, device_type: str) -> torch.optim.Optimizer:
    """One optimizer over `groups` (tiers.param_groups: each group's own lr and weight_decay)."""
    if cfg.name == "adamw":
        # fused AdamW on CUDA: one kernel for all params (the peer baseline uses it too).
        fused = device_type == "cuda"
        return ShardLocalAdamW(groups, betas=cfg.betas, eps=cfg.eps, fused=fused)  # lr: per tier group
    from torch.distributed.tensor import DTensor

    # also checked here, not only before loading: a caller that shards without saying so is still refused
    sharded = any(isinstance(p, DTensor) for g in groups for p in g["params"])
    if problem := optimizer_problem(cfg, device_type, sharded):
        raise ConfigError(problem)
    import bitsandbytes as bnb

    cls = bnb.optim.PagedAdamW8bit if cfg.name == "paged_adamw8bit" else bnb.optim.AdamW8bit
    # min_8bit_size stated so state_bytes stays true; lr and weight_decay: per tier group
    return cls(groups, betas=cfg.betas, eps=cfg.eps, min_8bit_size=MIN_8BIT_SIZE)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total_steps, cfg.warmup_steps, cfg.schedule, cfg.min_lr_ratio))
