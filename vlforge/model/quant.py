"""Per-module quantization for deployment and QLoRA: the language model quantized, vision in bf16.

    qcfg = QuantConfig(language="nf4")                  # or QuantConfig.from_flag("nf4")
    plan = quant_plan(model, qcfg)                      # name -> method; pure, works on meta models
    kwargs = from_pretrained_kwargs(qcfg, model_config)  # quantization_config for transformers
    report = verify(model, qcfg)                        # every module got exactly its method

Methods per group (language = the decoder layers' linears, vision = the vision tower's blocks,
projector = merger + deepstack mergers):
- `nf4`: bitsandbytes 4-bit NormalFloat, double quantization (the scales quantized too),
  computing in the run's dtype (bf16 by default): QLoRA's format (Dettmers et al. 2023: NF4 beats FP4 at equal bits).
- `int8`: bitsandbytes LLM.int8() (outlier columns in fp16).
- `fp8`: torchao float8 weights + dynamic float8 activations (compute capability >= 8.9).
- `none`: bf16.
lm_head and the embeddings are never quantized (they are the most sensitive layers, and the tied
/ untied embedding logic of transformers expects plain weights). The vision tower and projector
default to bf16; 4-bit there needs `allow_4bit_vision` (small vision GEMMs gain little memory and
lose accuracy on fine visual detail).

Mixture-of-experts models: the fused 3-D expert weights (`mlp.experts.gate_up_proj` / `down_proj`,
~95% of 30B-A3B's weights) are no nn.Linear, and transformers' bitsandbytes integration swaps only
nn.Linear for Linear4bit. `quant.experts` (auto: nf4 when `quant.language` is nf4) quantizes them
with bitsandbytes' own tool for parameters outside nn.Linear, `nn.parametrize.replace_parameter_4bit`:
the same NF4 blocks as Linear4bit (64 values, double-quantized scales), stored packed, and a
parametrization that dequantizes the whole [E, out, in] stack when the experts read it (once per
forward: bitsandbytes caches it for the module's call). So every experts kernel (eager,
grouped_mm, batched_mm) and the fused expert LoRA (model/moe_lora.py) run unchanged on it. A step
routing at most half as many (token, expert) pairs as there are experts (decode) dequantizes only
the routed experts' blocks instead (model/nf4.routed_expert_weights, through moe_lora's forward),
and training dequantizes the stacks again in backward rather than keep them (moe_lora._Redequantized).
The routers stay in the load dtype. `quantize_experts` runs after peft has wrapped the experts
(`load_model(wrap=...)`): peft nests its wrappers in another order on a parametrized module, which
would rename an adapter's saved keys. int8 and fp8 experts are not built.

Quantization goes through transformers' own quantizer integrations (`BitsAndBytesConfig`,
`TorchAoConfig`) at `from_pretrained`, so a quantized model saves and loads with plain transformers.
One backend per model: bitsandbytes methods (nf4, int8) cannot be mixed with torchao's fp8.
"""

from __future__ import annotations

import importlib.util
import re
import types

import torch
import torch.nn.utils.parametrize as P
from torch import nn

from vlforge.config import ConfigError, QuantConfig
from vlforge.model.nf4 import flat_dequantization, nf4_state
from vlforge.model.tiers import canonical_name

GROUP_PATTERNS = {
    "language": re.compile(r"^model\.language_model\.layers\.\d+\."),
    "projector": re.compile(r"^model\.visual\.(merger|deepstack_merger_list\.\d+)\."),
    "vision": re.compile(r"^model\.visual\.blocks\.\d+\."),
}


def group_of(name: str) -> str | None:
    for group, pattern in GROUP_PATTERNS.items():
        if pattern.match(name):
            return group
    return None  # lm_head, embeddings, patch embedding: never quantized


EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")
EXPERT_BLOCKSIZE = 64  # values per NF4 scale: Linear4bit's (and QLoRA's) blocks


def quant_plan(model: nn.Module, cfg: QuantConfig) -> dict[str, str]:
    """Method for every nn.Linear of a (plain or meta) Qwen3-VL model."""
    plan = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            group = group_of(name)
            plan[name] = getattr(cfg, group) if group else "none"
    return plan


def _holds(module: nn.Module, name: str) -> bool:
    """`module` itself owns weight `name` (plain or parametrized), not through a peft wrapper's
    attribute forwarding."""
    return name in module._parameters or P.is_parametrized(module, name)


def expert_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Every fused-experts module of an MoE model by its plain HF name (under peft's wrappers too); {} if dense."""
    return {canonical_name(name): m for name, m in model.named_modules()
            if hasattr(m, "num_experts") and all(_holds(m, w) for w in EXPERT_WEIGHTS)}


def expert_plan(model: nn.Module, cfg: QuantConfig) -> dict[str, str]:
    """Method for every fused expert weight of an MoE model (`module.gate_up_proj` -> quant.experts
    resolved); {} for a dense model."""
    return {f"{name}.{w}": cfg.expert_method for name in expert_modules(model) for w in EXPERT_WEIGHTS}


def quantize_experts(model: nn.Module, device: torch.device) -> int:
    """NF4 for every plain fused expert weight of `model` (in place, one [E, out, in] tensor at a
    time, each moved to `device` and quantized there, so a staged load never holds more than one
    bf16 expert stack on the GPU); returns how many were quantized."""
    from bitsandbytes.nn.parametrize import replace_parameter_4bit

    from vlforge.model.moe_lora import nf4_experts_forward

    n = 0
    for experts in expert_modules(model).values():
        for name in EXPERT_WEIGHTS:
            if P.is_parametrized(experts, name):
                continue
            weight = experts._parameters[name]
            # contiguous: bitsandbytes' CUDA kernels read the bytes in storage order, whatever the strides
            # (its CPU code does not), and transformers' weight conversions can load a checkpoint's expert
            # stacks as transposed views. (On an H100 the staged load's GPU-quantized stacks differed from
            # the CPU load's in 96% of one stack's values: the suspected cause; bitsandbytes' Linear4bit
            # makes its weights contiguous too)
            experts._parameters[name] = nn.Parameter(weight.data.to(device).contiguous(), requires_grad=False)
            del weight
            replace_parameter_4bit(experts, name, compress_statistics=True, quant_type="nf4",
                                   blocksize=EXPERT_BLOCKSIZE)
            parametrization = experts.parametrizations[name][0]
            parametrization.__class__ = flat_dequantization(type(parametrization))
            n += 1
        # decode steps dequantize only the routed experts (an instance attribute: torch's
        # parametrization already swapped the module's class for its own subclass)
        experts.forward = types.MethodType(nf4_experts_forward, experts)
    return n


def expert_state_bytes(model: nn.Module) -> int:
    """Bytes of the experts' NF4 scales (absmax codes, their own scales, the code book): held by
    bitsandbytes' QuantState, outside the module's parameters and buffers."""
    total = 0
    for experts in expert_modules(model).values():
        for name in EXPERT_WEIGHTS:
            if (state := nf4_state(experts, name)) is not None:
                total += sum(t.numel() * t.element_size() for key, t in state.as_dict(packed=True).items()
                             if isinstance(t, torch.Tensor) and not key.startswith("quant_state"))
    return total


def _skip_modules(plan: dict[str, str], keep: str) -> list[str]:
    """Names of linears that must stay unquantized, for transformers' skip lists.

    transformers matches skip entries against module names (exact or as a name component), so
    listing the full names of every linear not quantized with `keep` is exact, never a pattern.
    """
    return sorted(name for name, method in plan.items() if method != keep)


def from_pretrained_kwargs(cfg: QuantConfig, plan: dict[str, str], compute_dtype: torch.dtype = torch.bfloat16) -> dict:
    """`quantization_config=...` for `from_pretrained`, or {} when nothing is quantized.

    `compute_dtype`: what NF4 layers dequantize to for their matmuls (the run's compute dtype).
    """
    used = {m for m in plan.values() if m != "none"}
    if not used:
        return {}
    method = used.pop()
    if used:  # __post_init__ forbids it; a plan from elsewhere must not slip through
        raise ConfigError(f"quant: one method per model load, got {sorted(used | {method})}")
    if method in ("nf4", "int8"):
        if importlib.util.find_spec("bitsandbytes") is None:
            raise ConfigError(f"quant {method} needs bitsandbytes: pip install \"vlforge[quant]\"")
        from transformers import BitsAndBytesConfig

        skip = _skip_modules(plan, method)
        if method == "nf4":
            qc = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                    bnb_4bit_compute_dtype=compute_dtype, llm_int8_skip_modules=skip)
        else:
            qc = BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=skip)
        return {"quantization_config": qc}
    try:
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig
    except ImportError:
        raise ConfigError('quant fp8 needs torchao: pip install "vlforge[fp8]"') from None
    from transformers import TorchAoConfig

    return {"quantization_config": TorchAoConfig(quant_type=Float8DynamicActivationFloat8WeightConfig(),
                                                 modules_to_not_convert=_skip_modules(plan, "fp8"))}


def keep_trainable(model: nn.Module) -> int:
    """Stop bitsandbytes from repacking 4-bit weights for CPU inference; returns layers touched.

    bitsandbytes (0.50) repacks a Linear4bit's weights into an AVX512-BF16 layout at its first
    eval-mode forward on a CPU and does not undo it on train(); from then on the layer's matmul
    has no gradient for its input, so nothing below it learns (found as zero vision/projector
    gradients in CPU QLoRA GRPO after the first rollout). Training runs switch the repacking off.
    """
    touched = 0
    for module in model.modules():
        if getattr(module, "support_avx512bf16_for_cpu", False):
            module.support_avx512bf16_for_cpu = False
            touched += 1
    return touched


def applied_method(module: nn.Module) -> str:
    """What a loaded linear actually is: none | nf4 | int8 | fp8."""
    cls = type(module).__name__
    if cls == "Linear4bit":
        return "nf4" if getattr(module.weight, "quant_type", "nf4") == "nf4" else "fp4"
    if cls == "Linear8bitLt":
        return "int8"
    if "float8" in type(module.weight).__name__.lower():  # torchao's Float8Tensor weight subclass
        return "fp8"
    return "none"


def applied_expert_method(experts: nn.Module, name: str) -> str:
    """What a fused expert weight actually is: nf4 (or fp4) | none (a plain floating tensor)."""
    if (state := nf4_state(experts, name)) is not None:
        return state.quant_type
    if P.is_parametrized(experts, name):
        return "parametrized"
    weight = experts._parameters[name]
    return "none" if type(weight.data) is torch.Tensor and weight.is_floating_point() else type(weight.data).__name__


def verify(model: nn.Module, cfg: QuantConfig) -> dict:
    """Check every linear (and MoE expert weight) got exactly its planned method; returns counts and memory.

    Raises ConfigError naming the first modules that differ: the skip list must be exact.
    """
    core = model.get_base_model() if hasattr(model, "get_base_model") else model
    wrong, counts = [], {}
    for name, module in core.named_modules():
        if not isinstance(module, nn.Linear) or "lora_" in name:
            continue
        name = canonical_name(name)
        group = group_of(name)
        want = getattr(cfg, group) if group else "none"
        got = applied_method(module)
        counts[f"{group or 'other'}:{got}"] = counts.get(f"{group or 'other'}:{got}", 0) + 1
        if got != want:
            wrong.append(f"{name} is {got}, planned {want}")
    for name, experts in expert_modules(core).items():  # fused 3-D experts: NF4-parametrized or plain
        for weight in EXPERT_WEIGHTS:
            got = applied_expert_method(experts, weight)
            counts[f"experts:{got}"] = counts.get(f"experts:{got}", 0) + 1
            if got != cfg.expert_method:
                wrong.append(f"{name}.{weight} is {got}, planned {cfg.expert_method}")
    if wrong:
        raise ConfigError(f"quantization plan not met for {len(wrong)} weights: {'; '.join(wrong[:5])}")
    weights_bytes = sum(t.numel() * t.element_size() for t in list(core.parameters()) + list(core.buffers()))
    weights_bytes += expert_state_bytes(core)
    return {"linears": counts, "weights_gb": weights_bytes / 1e9}


def format_report(report: dict) -> str:
    parts = ", ".join(f"{k} {v}" for k, v in sorted(report["linears"].items()))
    gb = report["weights_gb"]
    size = f"{gb:.2f} GB" if gb >= 0.1 else f"{gb * 1e3:.1f} MB"
    return f"quantization: {parts}; weights {size}"
