"""FP8 training for the linears where it pays, behind one interface with two backends.

    plan = fp8_layer_plan(model, cfg.precision.fp8)        # name -> Decision; pure logic, meta models too
    backend = fp8_backend(cfg.precision.fp8, device)        # raises before any model is loaded if FP8 can't run
    backend.convert(model, plan)                            # after peft wrapping: swaps each base linear

Which linears: those whose name matches `include` and no `exclude` (default: the language model's
decoder layers, so lm_head, the vision tower and the projector stay bf16), whose dims are multiples
of 16 (FP8 tensor cores need it), and, with `skip_small`, large enough to gain. The size rules are
torchao's published H100 thresholds (torchao/float8/float8_linear_utils.py `_auto_filter_for_*`,
from the benchmark tables in torchao/float8/README.md): below them the cast overhead eats the gain.

Backends:
- torchao (default): `convert_to_float8_training` swaps nn.Linear for Float8Linear (dynamic
  scaling, recipe tensorwise | rowwise | rowwise_with_gw_hp). Its casts are separate kernels
  unless torch.compile fuses them, so the recipe compiles the decoder blocks (compile.enabled=auto).
- te: NVIDIA TransformerEngine, only if importable: te.Linear with the weights copied, run under
  `te.autocast(recipe=...)` per module group (the language model and the vision tower may use
  different recipes: precision.fp8.te / te_vision). TE's FP8 GEMMs refuse inputs whose row count
  (batch x tokens, or vision patches) is not a multiple of 8, so each swapped layer pads its rows
  to a multiple of 16 and slices them off again: the vision tower's patch counts and a rollout's
  decode steps (one row per sequence) work unpadded, and batches collated to `token_multiple`
  skip the copy. Delayed scaling's scales and amax histories carry from step to step:
  `fp8_state` / `load_fp8_state` put them in checkpoints so a resume is exact.

LoRA: the frozen base linear inside peft's LoRA layer is converted; the adapters stay in high
precision. torchao still computes the (discarded) FP8 weight gradient of a frozen base layer, so
FP8 gains less for LoRA than for full fine-tuning.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import re
import sys
from dataclasses import dataclass

import torch
from torch import nn

from vlforge.config import ConfigError, FP8Config, TERecipeConfig
from vlforge.train.hardware import fp8_problem
from vlforge.model.tiers import canonical_name


@dataclass(frozen=True)
class Decision:
    convert: bool
    reason: str  # why it is (not) converted, shown by `vlforge sft --plan`


def too_small(recipe: str, out_features: int, in_features: int) -> bool:
    """torchao's size thresholds (N = out_features, K = in_features) below which FP8 is slower."""
    n, k = out_features, in_features
    if recipe == "tensorwise":
        return k <= 4096 and n <= 1024
    # rowwise and rowwise_with_gw_hp share the rowwise kernel's thresholds
    return n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048)


def decide(name: str, out_features: int, in_features: int, cfg: FP8Config) -> Decision:
    """Whether one linear layer runs in FP8, and why. Pure: names and shapes only."""
    if not any(re.search(p, name) for p in cfg.include):
        return Decision(False, "not included (precision.fp8.include)")
    if hit := next((p for p in cfg.exclude if re.search(p, name)), None):
        return Decision(False, f"excluded by {hit!r}")
    if cfg.backend == "te" and not name.startswith(tuple(f"{root}." for root in TEBackend.GROUP_ROOTS.values())):
        return Decision(False, "outside the language model and vision tower (no TE autocast group)")
    if out_features % 16 or in_features % 16:
        return Decision(False, f"dims {out_features}x{in_features} not multiples of 16")
    if cfg.skip_small and too_small(cfg.recipe, out_features, in_features):
        return Decision(False, f"too small to gain ({out_features}x{in_features}, {cfg.recipe} thresholds)")
    return Decision(True, f"fp8 ({cfg.backend} {cfg.recipe if cfg.backend == 'torchao' else _te_group(name)})")


def fp8_layer_plan(model: nn.Module, cfg: FP8Config) -> dict[str, Decision]:
    """Decision for every nn.Linear of the (unwrapped) model; peft's adapter linears are not candidates."""
    plan = {}
    for name, module in model.named_modules():
        # plain linears only: bitsandbytes' quantized layers subclass nn.Linear but hold packed weights
        if type(module) is nn.Linear and "lora_" not in name:
            plan[canonical_name(name)] = decide(canonical_name(name), module.out_features, module.in_features, cfg)
    return plan


def summarize(plan: dict[str, Decision]) -> dict:
    """Counts of converted and skipped layers by reason (for logs, --plan and benchmarks)."""
    by_reason: dict[str, int] = {}
    for d in plan.values():
        key = d.reason if not d.convert else "converted"
        by_reason[key] = by_reason.get(key, 0) + 1
    return {"converted": sum(d.convert for d in plan.values()), "total_linears": len(plan), "by_reason": by_reason}


def _te_group(name: str) -> str:
    return "vision" if name.startswith("model.visual.") else "language"


# FP8 GEMMs want every dim a multiple of 16 (TE itself asserts rows % 8 and columns % 16).
FP8_ALIGNMENT = 16


def token_multiple(fp8_plan: dict[str, Decision]) -> int:
    """Pad each batch row to this many tokens wherever a model with this plan runs (training,
    eval, rollout prompts), so FP8 GEMMs see aligned row counts: 16 when any layer is converted,
    else 1. Both backends want the same multiple. Both also stay correct on unaligned batches
    (torchao pads its weight-gradient GEMM, our te.Linear pads its rows), so this only saves copies.
    """
    return FP8_ALIGNMENT if any(d.convert for d in fp8_plan.values()) else 1


# ----------------------------------------------------------------------------- backends


def te_problem() -> str | None:
    """Why TransformerEngine's PyTorch part cannot be used here (None when it imports)."""
    try:
        importlib.import_module("transformer_engine.pytorch")
    except Exception as e:  # noqa: BLE001 - a broken build raises more than ImportError
        return f"{type(e).__name__}: {e}".splitlines()[0][:300]
    return None


def _missing_library(cfg: FP8Config) -> str | None:
    if cfg.backend == "torchao":
        try:
            importlib.import_module("torchao.float8")
        except ImportError:
            return 'precision.fp8.backend=torchao needs torchao: pip install "vlforge[fp8]"'
    elif problem := te_problem():
        return (f"precision.fp8.backend=te needs NVIDIA TransformerEngine ({problem}): "
                "pip install --no-build-isolation 'transformer_engine[pytorch]' (or \"vlforge[te]\"), "
                "built against your torch and CUDA (bench/gpu_te.sh shows how); or use precision.fp8.backend=torchao")
    return None


def fp8_backend(cfg: FP8Config, device: torch.device):
    """The configured backend, or a ConfigError saying why FP8 cannot run here and what would."""
    problem = fp8_problem(device) or _missing_library(cfg)
    if problem:
        raise ConfigError(problem)
    return TorchaoBackend(cfg) if cfg.backend == "torchao" else TEBackend(cfg)


def _set_submodule(root: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, new)


class TorchaoBackend:
    def __init__(self, cfg: FP8Config):
        self.cfg = cfg

    def convert(self, model: nn.Module, plan: dict[str, Decision]) -> int:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig.from_recipe_name(self.cfg.recipe)
        # Token counts are not always multiples of 16 (the weight-gradient GEMM's inner dim):
        # torchao pads them only when they are not, so aligned batches pay nothing.
        config = dataclasses.replace(config, pad_inner_dim=True)
        chosen = {n for n, d in plan.items() if d.convert}
        converted = []

        def wanted(module: nn.Module, fqn: str) -> bool:
            ok = isinstance(module, nn.Linear) and canonical_name(fqn) in chosen and "lora_" not in fqn
            if ok:
                converted.append(fqn)
            return ok

        convert_to_float8_training(model, config=config, module_filter_fn=wanted)
        return len(converted)


def te_recipe(rc: TERecipeConfig):
    """A TransformerEngine recipe object from our config (names as in TE >= 2.x)."""
    from transformer_engine.common import recipe

    fmt = getattr(recipe.Format, rc.fp8_format)
    if rc.recipe == "delayed":
        return recipe.DelayedScaling(fp8_format=fmt, margin=rc.margin, amax_history_len=rc.amax_history_len,
                                     amax_compute_algo=rc.amax_compute_algo)
    if rc.recipe == "current":
        return recipe.Float8CurrentScaling(fp8_format=fmt)
    return recipe.Float8BlockScaling(fp8_format=fmt)  # Hopper, CUDA >= 12.9


def te_autocast(fp8_recipe):
    """`te.autocast(recipe=...)`; older TE only has the now-deprecated `fp8_autocast(fp8_recipe=...)`."""
    import transformer_engine.pytorch as te

    if hasattr(te, "autocast"):
        return te.autocast(enabled=True, recipe=fp8_recipe)
    return te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe)


@functools.cache
def te_linear_class() -> type:
    """te.Linear that pads its input rows to FP8_ALIGNMENT inside an FP8 autocast.

    TE raises on FP8 inputs whose leading dims multiply to a non-multiple of 8. Zero rows change
    neither the amax (so not the scales) nor the weight gradient, and are sliced off the output.
    """
    import transformer_engine.pytorch as te
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    class PaddedLinear(te.Linear):
        def forward(self, inp: torch.Tensor, *args, **kwargs):
            rows = inp.numel() // inp.shape[-1]
            pad = -rows % FP8_ALIGNMENT
            if not pad or not FP8GlobalStateManager.is_fp8_enabled():
                return super().forward(inp, *args, **kwargs)
            flat = torch.nn.functional.pad(inp.reshape(rows, inp.shape[-1]), (0, 0, 0, pad))
            out = super().forward(flat, *args, **kwargs)
            return out[:rows].reshape(*inp.shape[:-1], out.shape[-1])

    PaddedLinear.__qualname__ = PaddedLinear.__name__ = "TELinear"
    return PaddedLinear


def te_linear_from(module: nn.Linear) -> nn.Module:
    """A te_linear_class() layer with `module`'s weights, dtype, device and requires_grad."""
    new = te_linear_class()(module.in_features, module.out_features, bias=module.bias is not None,
                            params_dtype=module.weight.dtype, device=module.weight.device)
    for name in ("weight", "bias"):
        if (old := getattr(module, name)) is not None:
            with torch.no_grad():
                getattr(new, name).copy_(old)
            getattr(new, name).requires_grad_(old.requires_grad)
    return new


def _te_modules(model: nn.Module):
    # a model holding TE modules has imported TE: never import it just to look (seconds, CUDA libraries)
    if "transformer_engine.pytorch" not in sys.modules:
        return
    from transformer_engine.pytorch.module.base import TransformerEngineBaseModule

    for name, module in model.named_modules():
        if isinstance(module, TransformerEngineBaseModule):
            yield canonical_name(name), module


def fp8_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Delayed scaling's per-module state, the part that carries from step to step: each TE
    module's forward/backward scales and amax histories, as plain CPU tensors named
    `<module>.scale_fwd` etc. (so torch.load(weights_only=True) reads them; TE's own extra state is
    a pickle that TE >= 2.20 refuses to load by default). Empty without delayed-scaling TE layers."""
    state = {}
    for name, module in _te_modules(model):
        meta = module.fp8_meta
        if "scaling_fwd" not in meta or not meta["recipe"].delayed():
            continue  # never ran in FP8, or a recipe whose scales come from the current tensor
        for way in ("fwd", "bwd"):
            state[f"{name}.scale_{way}"] = meta[f"scaling_{way}"].scale.detach().cpu().clone()
            state[f"{name}.amax_history_{way}"] = meta[f"scaling_{way}"].amax_history.detach().cpu().clone()
    return state


def load_fp8_state(model: nn.Module, state: dict[str, torch.Tensor]) -> int:
    """Restore `fp8_state` into a model converted the same way (TEBackend.convert records each
    layer's recipe); returns how many modules. The next FP8 forward keeps these tensors."""
    modules = dict(_te_modules(model))
    names = sorted({key.rsplit(".", 1)[0] for key in state})
    if unknown := [n for n in names if n not in modules]:
        raise RuntimeError(f"FP8 state does not match this model's TE layers (e.g. {unknown[:3]}): "
                           "resume with the same precision.fp8 settings the checkpoint was trained with")
    for name in names:
        module = modules[name]
        meta = module.fp8_meta
        meta.setdefault("num_gemms", 1)  # one GEMM per te.Linear; TE sets it at the first FP8 forward
        module.init_fp8_meta_tensors(meta["recipe"])  # what TE's set_extra_state does, minus the pickle
        with torch.no_grad():
            for way in ("fwd", "bwd"):
                meta[f"scaling_{way}"].scale.copy_(state[f"{name}.scale_{way}"])
                meta[f"scaling_{way}"].amax_history.copy_(state[f"{name}.amax_history_{way}"])
    return len(names)


class TEBackend:
    """Swap eligible linears for te.Linear; run each module group under its own FP8 recipe."""

    GROUP_ROOTS = {"language": "model.language_model", "vision": "model.visual"}

    def __init__(self, cfg: FP8Config):
        self.cfg = cfg

    def convert(self, model: nn.Module, plan: dict[str, Decision]) -> int:
        chosen = {n for n, d in plan.items() if d.convert}
        recipes = {"language": te_recipe(self.cfg.te), "vision": te_recipe(self.cfg.te_vision)}
        converted = 0
        for fqn, module in list(model.named_modules()):
            if not (isinstance(module, nn.Linear) and canonical_name(fqn) in chosen and "lora_" not in fqn):
                continue
            new = te_linear_from(module)
            # the group's recipe, so load_fp8_state can rebuild delayed-scaling state before any forward
            new.fp8_meta["recipe"] = recipes[_te_group(canonical_name(fqn))]
            _set_submodule(model, fqn, new)
            converted += 1
        groups = {_te_group(n) for n in chosen}
        for group in groups:
            root = model.get_submodule(self.GROUP_ROOTS[group])
            forward = root.forward

            @functools.wraps(forward)
            def forward_in_fp8(*args, _forward=forward, _recipe=recipes[group], **kwargs):
                with te_autocast(_recipe):
                    return _forward(*args, **kwargs)

            root.forward = forward_in_fp8
        return converted
