"""The precision policy: the one place that decides dtypes (config section `precision`).

    mode   trainable params (master)            frozen params   compute (autocast)   loss scaling
    bf16   fp32 (or bf16: master_weights=compute)   bf16          bf16                 none (bf16 has fp32's range)
           (master_weights=optimizer: linear weights bf16, their fp32 masters in the optimizer)
    fp16   fp32                                  fp16            fp16                 dynamic (GradScaler)
    fp32   fp32                                  fp32            fp32                 none

On top of the mode:
- `precision.overrides`: per-module regexes that change a module's frozen-weight storage and/or
  its compute dtype (e.g. norms in fp32, the vision tower in bf16 while the rest is fp16);
- `precision.fp8` (train/fp8.py): eligible linears run their matmuls in FP8; their weights keep
  the storage above, everything around them keeps the autocast dtype.

Norms, softmax, the loss and log-probs run in fp32 whatever the mode: Qwen3-VL's RMSNorm upcasts
internally, autocast keeps layer_norm/softmax/log_softmax in fp32, `train/losses.py` and the
rollout upcast logits explicitly, and rewards/advantages are fp32 tensors. Optimizer state
lives with the master weights. Recipes ask this object; nothing else casts parameters.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
from collections import Counter

import torch
from torch import nn
from torch.utils._pytree import tree_map

from vlforge.config import ConfigError, PrecisionConfig, QuantConfig
from vlforge.generate.fused import FUSABLE
from vlforge.model.load import DTYPES
from vlforge.model.tiers import canonical_name, fsdp_sharded

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


def linear_only_weights(model: nn.Module,
                         policy: "PrecisionPolicy") -> dict[nn.Parameter, list[tuple[nn.Module, str]]]:
    """Parameter -> its (owner, name) pairs, for parameters every owner of which is exactly an
    nn.Linear computing in the policy's compute dtype."""
    owners: dict[nn.Parameter, list[tuple[nn.Module, str, bool]]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        linear = type(module) is nn.Linear and policy.module_compute(module_name) == policy.compute_dtype
        for name, p in module.named_parameters(recurse=False):
            owners.setdefault(p, []).append((module, name, linear))
    return {p: [(m, n) for m, n, _ in uses] for p, uses in owners.items() if all(linear for *_, linear in uses)}


class PrecisionPolicy:
    def __init__(self, cfg: PrecisionConfig, device_type: str):
        self.cfg = cfg
        self.mode = cfg.mode
        self.device_type = device_type  # "cpu" | "cuda"
        self.compute_dtype = DTYPES[cfg.mode]
        self.master_dtype = self.compute_dtype if cfg.master_weights == "compute" else torch.float32
        # master_weights=optimizer: trainable linear weights are stored in the compute dtype, and
        # `apply` keeps their fp32 values here for the optimizer (take_masters). auto, until
        # settle_master_weights resolves it, counts as fp32 masters (both forms load fp32 weights)
        self.masters_in_optimizer = cfg.master_weights == "optimizer"
        self._masters: dict[nn.Parameter, torch.Tensor] = {}
        self._overrides = [(re.compile(o.pattern), o) for o in cfg.overrides]

    @property
    def uses_loss_scaling(self) -> bool:
        return self.mode == "fp16"

    # ------------------------------------------------------------------ per-module resolution

    def module_compute(self, name: str) -> torch.dtype:
        """The dtype a module's arithmetic runs in (before FP8, which train/fp8.py layers on top):
        the last override with a compute dtype that matches the module's own name, else that of its
        nearest ancestor with one (apply's wrapper runs an fp32 module's whole forward with autocast
        off and fp32 inputs, a half one in a nested autocast: what is inside computes so too), else
        the compute dtype."""
        parts = canonical_name(name).split(".")
        for end in range(len(parts), 0, -1):  # the module itself, then each ancestor
            prefix, dtype = ".".join(parts[:end]), None
            for pattern, o in self._overrides:
                if o.compute and pattern.search(prefix):
                    dtype = DTYPES[o.compute]
            if dtype is not None:
                return dtype
        return self.compute_dtype

    def frozen_storage(self, name: str) -> torch.dtype:
        """dtype of a frozen parameter owned by module `name` (a trainable one uses master_dtype)."""
        dtype, compute = self.compute_dtype, self.module_compute(name)
        for pattern, o in self._overrides:
            if o.storage and pattern.search(canonical_name(name)):
                dtype = DTYPES[o.storage]
        # an fp32-compute module runs with autocast off, so its weights must be fp32 too
        return torch.float32 if compute == torch.float32 else dtype

    def param_dtype(self, module_name: str, trainable: bool) -> torch.dtype:
        if trainable:  # an fp32-compute module runs with autocast off: its own weights must be fp32
            return torch.float32 if self.module_compute(module_name) == torch.float32 else self.master_dtype
        return self.frozen_storage(module_name)

    # ------------------------------------------------------------------ applying

    def apply(self, model: nn.Module) -> None:
        """Cast parameters in place to their storage dtypes and install per-module compute overrides."""
        self.check_patterns(model)
        wrapped: list[tuple[str, torch.dtype]] = []  # pre-order: ancestors come first
        for module_name, module in model.named_modules():
            for p in module.parameters(recurse=False):
                want = self.param_dtype(module_name, p.requires_grad)
                if p.is_floating_point() and p.dtype != want:
                    p.data = p.data.to(want)
            if not (self._overrides and module_name) or isinstance(module, (nn.ModuleList, nn.ModuleDict)):
                continue  # containers have no forward of their own to wrap
            compute = self.module_compute(module_name)
            inherited = next((d for prefix, d in reversed(wrapped) if module_name.startswith(prefix + ".")),
                             self.compute_dtype)
            if compute != inherited and not hasattr(module, "_vlforge_compute"):
                _run_forward_in(module, compute, self.device_type)
                module._vlforge_compute = compute  # never wrap twice (apply on a model twice)
                wrapped.append((module_name, compute))
        if self.masters_in_optimizer:
            self._working_copies(model)

    def _working_copies(self, model: nn.Module) -> None:
        """master_weights=optimizer: each trainable weight used only by plain nn.Linear layers that
        compute in the compute dtype (what autocast would cast it to at every use) is stored in
        that dtype; its fp32 value is kept for the optimizer. Embeddings (their fp32 output is the
        residual stream, and a tied lm_head shares them), norms and FP8's linears keep fp32."""
        for p in linear_only_weights(model, self):
            if p.requires_grad and p.dtype == torch.float32 and p not in self._masters:
                self._masters[p] = p.data
                p.data = p.data.to(self.compute_dtype)

    def take_masters(self) -> dict[nn.Parameter, torch.Tensor] | None:
        """The fp32 masters of the working copies `apply` made (the optimizer takes them; None when
        master_weights is not `optimizer`)."""
        if not self.masters_in_optimizer:
            return None
        masters, self._masters = self._masters, {}
        return masters

    def check_patterns(self, model: nn.Module) -> None:
        """An override whose pattern matches no module of `model` is a ConfigError: a typo would
        otherwise change nothing, silently."""
        names = [canonical_name(n) for n, _ in model.named_modules() if n]
        for i, (pattern, o) in enumerate(self._overrides):
            if not any(pattern.search(n) for n in names):
                raise ConfigError(f"precision.overrides[{i}].pattern {o.pattern!r} matches no module of this model; "
                                  "names look like 'model.language_model.layers.0.self_attn.q_proj', "
                                  "'model.visual.blocks.0.attn.qkv', 'model.visual.merger', 'lm_head'")

    def computes(self, model: nn.Module) -> dict[nn.Module, torch.dtype]:
        """Every module of `model` (after `apply`) -> the dtype its arithmetic runs in: that of the
        nearest module `apply` wrapped in an override (itself or an ancestor), else the compute dtype.
        What FSDP2 must gather a module's weights in (train/distributed.py)."""
        out: dict[nn.Module, torch.dtype] = {}
        by_name: dict[str, torch.dtype] = {}
        for name, module in model.named_modules():  # pre-order: a parent before its children
            parent = by_name.get(name.rpartition(".")[0], self.compute_dtype) if name else self.compute_dtype
            by_name[name] = out[module] = getattr(module, "_vlforge_compute", parent)
        return out

    def autocast(self):
        if self.mode == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.compute_dtype)

    @contextlib.contextmanager
    def inference_weights(self, model: nn.Module):
        """Inside: the master-dtype (fp32) weights of plain nn.Linear layers stored in the compute
        dtype, for generation under `autocast()` (GRPO rollouts); outside: the masters again.

        The owners' parameter entries point at the copies, the master Parameter objects are not
        touched: assigning a master's .data another dtype would give it a new gradient-accumulation
        node, and DDP's all-reduce hooks, registered on the old one, would silently stop firing
        (found in review, reproduced with 2 gloo processes).
        Autocast already runs those layers on weights cast to the compute dtype, so the results are
        the same bits; what changes is that a decode step reads 2-byte weights once instead of
        reading the 4-byte masters and writing and reading a cast of every weight (~4x the traffic,
        at every step of a captured CUDA graph, where autocast's weight-cast cache is off). The copies
        are kept (one refresh per entry; 2 bytes per weight, ~3 GB at 2B): their addresses stay, so
        the engine's graphs captured inside stay valid across GRPO steps (a graph captured over
        copies freed afterwards would read freed memory: hence not for SFT's eval). Only weights
        whose every user is exactly an nn.Linear (not FP8's subclasses; not a weight tied to the
        embedding, whose fp32 output is the fp32 residual stream); modules with an fp32 compute
        override keep theirs. A model sharded by FSDP2 is left alone (its gathers are in the
        compute dtype already). With master_weights=optimizer the trainable weights are in the compute
        dtype already and get copies all the same: frozen copies are what generate/fused.py may fuse
        into one q/k/v and one gate/up GEMM (the trained weights themselves it leaves alone)."""
        swapped = []  # (owner, name, master): the owners' entries are swapped, never a master's .data
        try:
            if self.master_dtype != self.compute_dtype and not fsdp_sharded(model):
                for p, uses in linear_only_weights(model, self).items():
                    if p.dtype != self.master_dtype and not (self.masters_in_optimizer and p.requires_grad):
                        continue
                    copy = getattr(p, "_inference_copy", None)  # kept on the master: it lives as long
                    if copy is None or copy.shape != p.shape or copy.device != p.device:
                        copy = p._inference_copy = nn.Parameter(torch.empty_like(p, dtype=self.compute_dtype),
                                                                requires_grad=False)
                        setattr(copy, FUSABLE, True)  # ours: the engine may make it a view of a fused buffer
                    copy.data.copy_(p.detach())
                    for module, name in uses:
                        swapped.append((module, name, p))
                        module._parameters[name] = copy
            yield
        finally:
            for module, name, master in swapped:
                module._parameters[name] = master

    def grad_scaler(self) -> torch.amp.GradScaler:
        """Dynamic loss scaling for fp16; a disabled scaler (a no-op) for bf16/fp32/FP8."""
        cfg = self.cfg.loss_scale
        return torch.amp.GradScaler(self.device_type, enabled=self.uses_loss_scaling, init_scale=cfg.init_scale,
                                    growth_factor=cfg.growth_factor, backoff_factor=cfg.backoff_factor,
                                    growth_interval=cfg.growth_interval)

    # ------------------------------------------------------------------ reporting

    def table(self, model: nn.Module, trainable: set[str], lora: set[str] = frozenset(),
              fp8_layers: dict[str, str] | None = None, quantized: dict[str, str] | None = None) -> list[dict]:
        """Each parameter-owning module's storage and compute dtype, grouped over layer indices.

        `trainable`: names of modules whose own weights train (full tiers); `lora`: modules that
        get LoRA adapters (master dtype); `fp8_layers`: module name -> FP8 description for
        converted linears; `quantized`: module name -> quant method (its weight's storage).
        Works on a meta-device model.
        """
        fp8_layers, quantized = fp8_layers or {}, quantized or {}
        counts: Counter = Counter()
        copies = linear_only_weights(model, self) if self.masters_in_optimizer else {}
        for name, module in model.named_modules():
            params = list(module.parameters(recurse=False))
            if not params or "lora_" in name:
                continue
            name = canonical_name(name)
            working = name not in fp8_layers and all(p in copies for p in params)  # _working_copies' choice
            storage = quantized.get(name) or NAMES[self.param_dtype(name, name in trainable)]
            if working and name in trainable:
                storage = f"{NAMES[self.compute_dtype]} + {storage} master in the optimizer"
            if name in lora:  # peft's adapters are nn.Linear layers: working copies too under master_weights=optimizer
                storage += (f" + LoRA {NAMES[self.compute_dtype]} + {NAMES[self.master_dtype]} master in the optimizer"
                            if self.masters_in_optimizer and self.module_compute(name) == self.compute_dtype
                            else f" + LoRA {NAMES[self.master_dtype]}")
            compute = fp8_layers.get(name) or NAMES[self.module_compute(name)]
            counts[(re.sub(r"\.\d+(?=\.|$)", ".*", name), storage, compute)] += 1
        return [{"modules": m, "count": n, "storage": s, "compute": c} for (m, s, c), n in counts.items()]


def format_precision_plan(p: dict) -> str:
    header = ("modules", "n", "storage", "compute")
    cells = [header] + [(r["modules"], str(r["count"]), r["storage"], r["compute"]) for r in p["table"]]
    widths = [max(len(c[i]) for c in cells) for i in range(4)]
    lines = [f"precision: compute {p['mode']}, master weights {p['master_weights']} "
             "(norms, softmax, loss and log-probs in fp32)"]
    if "master_weights_auto" in p:
        lines.append(f"{p['master_weights_auto']}, on CUDA")
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    if "fp8" in p:
        f = p["fp8"]
        lines.append(f"fp8: {f['converted']} of {f['total_linears']} linears converted; skipped: "
                     + "; ".join(f"{n} {why}" for why, n in f["by_reason"].items() if why != "converted"))
    return "\n".join(lines)


def auto_master_weights(cfg, device_type: str, strategy: str, moe: bool) -> tuple[str, str]:
    """What precision.master_weights=auto means for a run: (fp32 | optimizer, why). `optimizer` only
    where it was measured faster (SFT full fine-tuning of a dense model on one CUDA process, bf16,
    AdamW, no quant or FP8: median step ~6% shorter, H100, docs/benchmarks.md);
    GRPO, LoRA, MoE and sharded runs are not measured, so they keep fp32 masters."""
    p = cfg.precision
    if hasattr(cfg, "rollout"):
        return "fp32", "GRPO (optimizer-held masters are measured on SFT only)"
    refusals = [(cfg.tiers.method != "full", f"tiers.method={cfg.tiers.method} (measured on full fine-tuning)"),
                (p.mode != "bf16", f"precision.mode={p.mode} (bf16 working copies need bf16)"),
                (cfg.optim.name != "adamw", f"optim.name={cfg.optim.name} (the masters live in AdamW's update)"),
                (device_type != "cuda", f"a {device_type} device (measured on CUDA)"),
                (strategy != "none", f"distributed.strategy={strategy} (one process only)"),
                (cfg.quant.enabled or p.fp8.enabled, "quantized or FP8 layers (not measured)"),
                (moe, "a MoE model (not measured)")]
    for refused, why in refusals:
        if refused:
            return "fp32", why
    return "optimizer", ("fp32 masters in AdamW's update, bf16 working weights: ~6% faster a step, 2B full on an "
                         "H100, docs/benchmarks.md; with gradient accumulation 4 bytes a weight more, for fp32 "
                         "gradient sums")


def settle_master_weights(cfg, device_type: str, strategy: str, moe: bool,
                          saved: str | None) -> tuple[PrecisionConfig, str | None]:
    """precision.master_weights=auto resolved: (the precision config the run applies, the line it prints
    and writes atop its config.yaml; None when the setting was explicit). `saved`: the form the
    checkpoint a run resumes was saved in, which it keeps (the optimizer state's layout differs).
    The caller's config is left as given."""
    if cfg.precision.master_weights != "auto":
        return cfg.precision, None
    if saved == "optimizer" and strategy != "none":
        raise ConfigError(f"the checkpoint this run resumes keeps its fp32 master weights in its optimizer state "
                          f"(precision.master_weights=optimizer), which trains on one process, not "
                          f"distributed.strategy={strategy}: resume it on one process, or `vlforge export` it and "
                          "start a new run from the export")
    if saved is not None:
        choice, why = saved, "the form of the checkpoint this run resumes"
    else:
        choice, why = auto_master_weights(cfg, device_type, strategy, moe)
    return dataclasses.replace(cfg.precision, master_weights=choice), \
        f"precision.master_weights auto: {choice} ({why})"


def precision_plan(model: nn.Module, plan: list, cfg: PrecisionConfig, quant: QuantConfig | None = None) -> dict:
    """What `--plan` shows: each module group's storage/compute dtype and the FP8 layer decisions.

    `model` is the plain (not yet peft-wrapped, possibly meta-device) model and `plan` its tier plan.
    """
    from vlforge.train.fp8 import fp8_layer_plan, summarize
    from vlforge.model.quant import quant_plan

    full_roots = [e.module for e in plan if e.kind == "full"]
    trainable = {name for name, _ in model.named_modules()
                 if any(name == r or name.startswith(r + ".") for r in full_roots)}
    decisions = fp8_layer_plan(model, cfg.fp8) if cfg.fp8.enabled else {}
    fp8_layers = {name: d.reason for name, d in decisions.items() if d.convert}
    policy = PrecisionPolicy(cfg, "cpu")
    policy.check_patterns(model)
    out = {"mode": cfg.mode, "master_weights": NAMES[policy.master_dtype] + (" (in the optimizer)" if
                                                                          policy.masters_in_optimizer else ""),
           "table": policy.table(model, trainable, {e.owner for e in plan if e.kind == "lora"}, fp8_layers,
                                 quantized={n: m for n, m in quant_plan(model, quant).items() if m != "none"}
                                 if quant is not None and quant.enabled else None)}
    if decisions:
        out["fp8"] = summarize(decisions)
    return out
