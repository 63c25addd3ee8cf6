"""rollout.precision: the weights GRPO's rollouts decode with (docs/grpo.md, FP8 rollouts).

    row = refresh_rollout_weights(model, cfg.rollout)    # before a step's rollouts: {"rollout/fp8_refresh_s": s}
    with rollout_precision(model, cfg.rollout):          # around the rollouts' generate calls
        generate_groups(model, ...)

bf16: the policy's own weights (in the compute dtype: PrecisionPolicy.inference_weights); nothing here
acts. fp8: the engine's prefills and decode steps run the decoder projections on FP8 copies
(generate/fp8.py), made again from the trained weights before every step's rollouts. Made per step,
not per generate call: a step's rollout rounds (dynamic sampling) and a multi-turn rollout's turns
all read the weights of one optimizer step.
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import torch

from vlforge.config import RolloutConfig
from vlforge.generate.fp8 import decoding_in_fp8, fp8_projections


@torch.no_grad()
def refresh_rollout_weights(model, cfg: RolloutConfig) -> dict[str, float]:
    """With rollout.precision=fp8: the model's FP8 copies made again from its current weights (made
    the first time), and the seconds that took as the step's metric rollout/fp8_refresh_s (on CUDA,
    until the copies are written). Call it outside PrecisionPolicy.inference_weights: the copies are
    made from the fp32 masters themselves, not from their bf16 copies."""
    if cfg.precision != "fp8":
        return {}
    start = time.perf_counter()
    copies = fp8_projections(model, made=False)
    if copies is None:
        copies = fp8_projections(model)  # made from the current weights
    else:
        copies.refresh()
    device = copies.groups[0].buffer.qdata.device if copies.groups else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return {"rollout/fp8_refresh_s": time.perf_counter() - start}


def rollout_precision(model, cfg: RolloutConfig):
    """The context the rollouts' generate calls run in: FP8 copies (made now if no refresh made them)
    with rollout.precision=fp8, nothing with bf16."""
    return decoding_in_fp8(model, fp8_projections(model)) if cfg.precision == "fp8" else nullcontext()
