"""AdamW over per-tier param groups and the warmup + decay learning-rate schedule."""

from __future__ import annotations

import math

import torch

from vlforge.config import OptimConfig


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


def build_optimizer(groups: list[dict], cfg: OptimConfig, device_type: str) -> torch.optim.Optimizer:
    # fused AdamW on CUDA: one kernel for all params (the peer baseline uses it too).
    fused = device_type == "cuda"
    return torch.optim.AdamW(groups, betas=cfg.betas, eps=cfg.eps, fused=fused)  # lr: per tier group


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total_steps, cfg.warmup_steps, cfg.schedule, cfg.min_lr_ratio))
