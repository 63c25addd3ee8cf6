"""What torch.compile keeps per compiled function: shared by the compiled decoder layers and vision
blocks (train/trainable.py) and MasterWeightAdamW's update (train/optim.py)."""

from __future__ import annotations

import torch

# Compiled graphs kept per compiled function (dynamo's recompile_limit, a code object's). torch's
# default, 8, is below the set of variants a training step makes of a decoder layer or vision block:
# weight dtype (frozen blocks stored in bf16 beside trainable fp32 ones) x whether its input requires
# grad x whether the input is a view (the tower's first block gets a reshape) x a static, then a
# dynamic, length; and below MasterWeightAdamW's update, compiled once per param group (and per set
# of tensors with gradients). Past the limit dynamo runs the function eager for every input no graph
# matches: the 2B full step on the mixed-image set hit it on the H200 (docs/benchmarks-log.md,
# 2026-12-04, "Layers several to a compiled region"). The sets are bounded: one compile per variant, once.
COMPILED_VARIANTS = 32


def allow_compiled_variants() -> None:
    config = torch._dynamo.config  # recompile_limit, named cache_size_limit before torch 2.7 (kept as an alias)
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), COMPILED_VARIANTS))
