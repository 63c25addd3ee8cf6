"""The precision policy: the one place that decides dtypes.

    mode   trainable params (master)  frozen params  compute (autocast)  loss scaling
    bf16   fp32                       bf16           bf16                none (bf16 has fp32's range)
    fp16   fp32                       fp16           fp16                dynamic (GradScaler)
    fp32   fp32                       fp32           fp32                none

Norms, softmax, the loss and log-probs run in fp32 whatever the mode: Qwen3-VL's RMSNorm upcasts
internally, autocast keeps softmax/log_softmax in fp32, and `losses.py` upcasts logits explicitly.
Optimizer state lives with the fp32 trainable params.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class PrecisionPolicy:
    mode: str
    device_type: str  # "cpu" | "cuda"

    @property
    def compute_dtype(self) -> torch.dtype:
        return _DTYPES[self.mode]

    @property
    def frozen_param_dtype(self) -> torch.dtype:
        return _DTYPES[self.mode]

    master_dtype = torch.float32

    @property
    def uses_loss_scaling(self) -> bool:
        return self.mode == "fp16"

    def autocast(self):
        if self.mode == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.compute_dtype)

    def apply(self, model: nn.Module) -> None:
        """Cast in place: trainable params to fp32 master weights, frozen ones to the frozen dtype."""
        for p in model.parameters():
            want = self.master_dtype if p.requires_grad else self.frozen_param_dtype
            if p.dtype != want and p.is_floating_point():
                p.data = p.data.to(want)

    def grad_scaler(self) -> torch.amp.GradScaler:
        return torch.amp.GradScaler(self.device_type, enabled=self.uses_loss_scaling)
