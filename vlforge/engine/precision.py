"""The precision policy: the one place that decides dtypes (config section `precision`).

    mode   trainable params (master)    frozen params   compute (autocast)   loss scaling
    bf16   fp32 (or bf16: master_weights=compute)   bf16   bf16              none (bf16 has fp32's range)
    fp16   fp32 (or fp16)               fp16            fp16                 dynamic (GradScaler)
    fp32   fp32                         fp32            fp32                 none

On top of the mode:
- `precision.overrides`: per-module regexes that change a module's frozen-weight storage and/or
  its compute dtype (e.g. norms in fp32, the vision tower in bf16 while the rest is fp16);
- `precision.fp8` (engine/fp8.py): eligible linears run their matmuls in FP8; their weights keep
  the storage above, everything around them keeps the autocast dtype.

Norms, softmax, the loss and log-probs run in fp32 whatever the mode: Qwen3-VL's RMSNorm upcasts
internally, autocast keeps layer_norm/softmax/log_softmax in fp32, `engine/losses.py` and the
rollout engine upcast logits explicitly, and rewards/advantages are fp32 tensors. Optimizer state
lives with the master weights. Recipes ask this object; nothing else casts parameters.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections import Counter

import torch
from torch import nn
from torch.utils._pytree import tree_map

from vlforge.config import LossScaleConfig, PrecisionConfig

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
NAMES = {v: k for k, v in DTYPES.items()}


def _upcast(x):
    return x.float() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def _run_forward_in(module: nn.Module, dtype: torch.dtype, device_type: str) -> None:
    """Make `module` compute in `dtype` whatever the surrounding autocast says.

    fp32 means autocast off and floating inputs upcast (so the module's own weights must be fp32);
    a half dtype means a nested autocast of that dtype.
    """
    forward = module.forward

    @functools.wraps(forward)
    def forward_in_dtype(*args, **kwargs):
        if dtype == torch.float32:
            args, kwargs = tree_map(_upcast, (args, kwargs))
            with torch.autocast(device_type, enabled=False):
                return forward(*args, **kwargs)
        with torch.autocast(device_type, dtype=dtype):
            return forward(*args, **kwargs)

    module.forward = forward_in_dtype


def _canonical(name: str) -> str:
    """Module name as in the plain HF model (peft's wrapper names removed)."""
    return name.replace(".base_layer", "")


class PrecisionPolicy:
    def __init__(self, cfg: PrecisionConfig, device_type: str):
        self.cfg = cfg
        self.mode = cfg.mode
        self.device_type = device_type  # "cpu" | "cuda"
        self.compute_dtype = DTYPES[cfg.mode]
        self.master_dtype = torch.float32 if cfg.master_weights == "fp32" else self.compute_dtype
        self._overrides = [(re.compile(o.pattern), o) for o in cfg.overrides]

    @property
    def uses_loss_scaling(self) -> bool:
        return self.mode == "fp16"

    # ------------------------------------------------------------------ per-module resolution

    def module_compute(self, name: str) -> torch.dtype:
        """The dtype a module's arithmetic runs in (before FP8, which engine/fp8.py layers on top)."""
        dtype = self.compute_dtype
        for pattern, o in self._overrides:
            if o.compute and pattern.search(_canonical(name)):
                dtype = DTYPES[o.compute]
        return dtype

    def frozen_storage(self, name: str) -> torch.dtype:
        """dtype of a frozen parameter owned by module `name` (a trainable one uses master_dtype)."""
        dtype, compute = self.compute_dtype, self.module_compute(name)
        for pattern, o in self._overrides:
            if o.storage and pattern.search(_canonical(name)):
                dtype = DTYPES[o.storage]
        # an fp32-compute module runs with autocast off, so its weights must be fp32 too
        return torch.float32 if compute == torch.float32 else dtype

    def param_dtype(self, module_name: str, trainable: bool) -> torch.dtype:
        return self.master_dtype if trainable else self.frozen_storage(module_name)

    # ------------------------------------------------------------------ applying

    def apply(self, model: nn.Module) -> None:
        """Cast parameters in place to their storage dtypes and install per-module compute overrides."""
        for module_name, module in model.named_modules():
            for p in module.parameters(recurse=False):
                want = self.param_dtype(module_name, p.requires_grad)
                if p.is_floating_point() and p.dtype != want:
                    p.data = p.data.to(want)
            if self._overrides and module_name:
                compute = self.module_compute(module_name)
                if compute != self.compute_dtype and not getattr(module, "_vlforge_compute", None):
                    _run_forward_in(module, compute, self.device_type)
                    module._vlforge_compute = compute  # never wrap twice (apply on a model twice)

    def autocast(self):
        if self.mode == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.compute_dtype)

    def grad_scaler(self, cfg: LossScaleConfig | None = None) -> torch.amp.GradScaler:
        """Dynamic loss scaling for fp16; a disabled scaler (a no-op) for bf16/fp32/FP8."""
        cfg = cfg or self.cfg.loss_scale
        return torch.amp.GradScaler(self.device_type, enabled=self.uses_loss_scaling, init_scale=cfg.init_scale,
                                    growth_factor=cfg.growth_factor, backoff_factor=cfg.backoff_factor,
                                    growth_interval=cfg.growth_interval)

    # ------------------------------------------------------------------ reporting

    def table(self, model: nn.Module, trainable: set[str], fp8_layers: dict[str, str] | None = None) -> list[dict]:
        """Each parameter-owning module's storage and compute dtype, grouped over layer indices.

        `trainable`: names of modules whose own weights train (full tiers); `fp8_layers`: module
        name -> FP8 description for converted linears. Works on a meta-device model.
        """
        fp8_layers = fp8_layers or {}
        counts: Counter = Counter()
        for name, module in model.named_modules():
            params = list(module.parameters(recurse=False))
            if not params or "lora_" in name:
                continue
            name = _canonical(name)
            storage = NAMES[self.param_dtype(name, name in trainable)]
            compute = fp8_layers.get(name) or NAMES[self.module_compute(name)]
            counts[(re.sub(r"\.\d+(?=\.|$)", ".*", name), storage, compute)] += 1
        return [{"modules": m, "count": n, "storage": s, "compute": c} for (m, s, c), n in counts.items()]


def format_precision_table(rows: list[dict]) -> str:
    header = ("modules", "n", "storage", "compute")
    cells = [header] + [(r["modules"], str(r["count"]), r["storage"], r["compute"]) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells)
