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

Mixture-of-experts models: the fused 3-D expert weights (`mlp.experts.gate_up_proj` / `down_proj`)
and the routers (`mlp.gate`) are not nn.Linear, and both libraries quantize only nn.Linear
through transformers: bitsandbytes swaps Linear for Linear4bit / Linear8bitLt (nothing handles a
3-D weight), and transformers' torchao path converts Linear weights unless an FqnToConfig names
other parameters, which vlforge neither builds nor verifies. So with `quant.language` the
attention (and any dense MLP) is quantized and the experts and routers stay in the load dtype
(bf16): `quant.experts` takes only none (config.EXPERTS_NOT_QUANTIZED), and `verify()` checks every expert weight
is still a plain tensor. For 30B-A3B that is ~1B quantized attention weights beside ~29B bf16
expert weights: weight memory stays close to bf16's.

Quantization goes through transformers' own quantizer integrations (`BitsAndBytesConfig`,
`TorchAoConfig`) at `from_pretrained`, so a quantized model saves and loads with plain transformers.
One backend per model: bitsandbytes methods (nf4, int8) cannot be mixed with torchao's fp8.
"""

from __future__ import annotations

import importlib.util
import re

import torch
from torch import nn

from vlforge.config import ConfigError, QuantConfig
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


EXPERT_PARAM = re.compile(r"^model\.language_model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)$")


def quant_plan(model: nn.Module, cfg: QuantConfig) -> dict[str, str]:
    """Method for every nn.Linear of a (plain or meta) Qwen3-VL model."""
    plan = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            group = group_of(name)
            plan[name] = getattr(cfg, group) if group else "none"
    return plan


def expert_plan(model: nn.Module, cfg: QuantConfig) -> dict[str, str]:
    """Method for every fused expert weight of an MoE model (parameter name -> quant.experts,
    always none: see the module docstring); {} for a dense model."""
    return {canonical_name(name): cfg.experts for name, p in model.named_parameters()
            if EXPERT_PARAM.match(canonical_name(name)) and p.ndim == 3}


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
    planned = expert_plan(core, cfg)
    for name, p in core.named_parameters():  # fused 3-D experts: must stay plain tensors
        name = canonical_name(name)
        if name not in planned:
            continue
        want = planned[name]
        got = "none" if type(p.data) is torch.Tensor and p.dtype in (torch.bfloat16, torch.float16, torch.float32) \
            else type(p.data).__name__
        counts[f"experts:{got}"] = counts.get(f"experts:{got}", 0) + 1
        if got != want:
            wrong.append(f"{name} is {got}, planned {want}")
    if wrong:
        raise ConfigError(f"quantization plan not met for {len(wrong)} weights: {'; '.join(wrong[:5])}")
    weights_bytes = sum(t.numel() * t.element_size() for t in list(core.parameters()) + list(core.buffers()))
    return {"linears": counts, "weights_gb": weights_bytes / 1e9}


def format_report(report: dict) -> str:
    parts = ", ".join(f"{k} {v}" for k, v in sorted(report["linears"].items()))
    gb = report["weights_gb"]
    size = f"{gb:.2f} GB" if gb >= 0.1 else f"{gb * 1e3:.1f} MB"
    return f"quantization: {parts}; weights {size}"
