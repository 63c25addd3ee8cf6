"""The model's sections: which model (`model`, its attention under `model.attention`), which of its
tiers train and how (`tiers`), and which weights are quantized (`quant`). model/load.py,
model/tiers.py and model/quant.py apply them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .load import ConfigError, _range, _require

# The presets known to be dense (model/presets.py: PRESETS minus MOE_PRESETS; tests/test_config.py
# keeps the two in step): a run's config.yaml leaves out MoE-only keys for these. A model.path is
# not opened to tell (config.yaml is written from the config alone), so its MoE keys stay.
DENSE_PRESETS = ("tiny", "qwen3vl-2b", "qwen3vl-4b", "qwen3vl-8b", "qwen3vl-32b")


@dataclass
class AttentionConfig:
    """Which attention kernels the model runs; docs/packing.md tells how packed rows use them."""

    # flex_attention (MoE models only in transformers 5.17-5.24): torch's flex_attention, a
    # block-sparse document mask for data.packing; flash_attention_2 needs the flash-attn package
    # (varlen kernels when packed); sdpa packs rows through train/packed_attention.py (each
    # sample's own causal attention: torch's varlen_attn on CUDA), eager through a dense mask
    implementation: Literal["sdpa", "eager", "flash_attention_2", "flex_attention"] = "sdpa"
    # the vision tower under sdpa: varlen = every image of a forward in one call (model/varlen.py:
    # torch's varlen_attn on CUDA, exact per-image SDPA elsewhere), sdpa = transformers' own loop,
    # one SDPA call per image in every block; auto = varlen but for a trainable vision tower whose
    # blocks run eager, where the loop measured faster (train/trainable.vision_attention_for_training)
    vision: Literal["auto", "varlen", "sdpa"] = "auto"


@dataclass
class ModelConfig:
    path: str | None = None  # local HF-format Qwen3-VL directory (never downloaded); wins over preset
    # tiny | qwen3vl-2b | -4b | -8b | -32b | tiny-moe | qwen3vl-30b-a3b | qwen3vl-235b-a22b (random weights)
    preset: str | None = None
    # the language model's and the vision tower's attention kernels
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    # MoE models: transformers' expert kernels; auto = grouped_mm (grouped GEMM) on CUDA, eager
    # (the reference loop over experts) elsewhere (model/load.experts_implementation)
    experts_implementation: Literal["auto", "eager", "grouped_mm", "batched_mm"] = "auto"
    seed: int = 0  # initialisation seed for presets (their weights are random; a model.path's are loaded)

    def __post_init__(self):
        _range(self, "seed", ge=0)

    @property
    def dense(self) -> bool:
        """Known dense from the config alone (a dense preset, no path); False when unknown."""
        return self.path is None and self.preset in DENSE_PRESETS


def _check_tier(tier) -> None:
    """The ranges every tier shares (each tier class adds its own)."""
    _range(tier, "lr", ge=0)
    _range(tier, "r", ge=1)
    _range(tier, "alpha", gt=0, why="LoRA scales its update by alpha / r")
    _range(tier, "dropout", ge=0, lt=1)


@dataclass
class LanguageTier:
    """The language model's decoder layers (and, full, its embeddings, norm and lm_head).
    LoRA: r/alpha/dropout apply; full: the whole group trains at `lr`."""

    train: bool = True  # train this tier (false: frozen, no adapters)
    lr: float = 2e-4  # its peak learning rate (optim.schedule shapes it)
    r: int = 8  # LoRA rank of its adapters
    alpha: float = 16.0  # LoRA scale: the update is multiplied by alpha / r
    dropout: float = 0.1  # LoRA dropout on the adapters' input (training only)
    mlp: bool = False  # also adapt the MLP projections, not only attention's q/k/v/o (LoRA)
    # MoE models: LoRA on the fused 3-D expert weights (LoRA only; full trains them anyway)
    experts: bool = False
    # MoE models: train the router (mlp.gate) fully; frozen by default (model/tiers.py: why)
    router: bool = False

    def __post_init__(self):
        _check_tier(self)


@dataclass
class ProjectorTier:
    """The merger that maps vision features into the language model (and its deepstack mergers).
    LoRA: r/alpha/dropout apply; full: the whole group trains at `lr`."""

    train: bool = True  # train this tier (false: frozen, no adapters)
    lr: float = 5e-4  # its peak learning rate: new to the task, it moves most
    r: int = 32  # LoRA rank of its adapters
    alpha: float = 64.0  # LoRA scale: the update is multiplied by alpha / r
    dropout: float = 0.05  # LoRA dropout on the adapters' input (training only)

    def __post_init__(self):
        _check_tier(self)


@dataclass
class VisionTier:
    """The vision tower's blocks, frozen by default (pretrained features; training them needs a low lr).
    LoRA: r/alpha/dropout apply; full: the chosen blocks train at `lr`."""

    train: bool = False  # train this tier (false: frozen, no adapters)
    lr: float = 1e-5  # its peak learning rate: low, so the pretrained features are not washed out
    r: int = 4  # LoRA rank of its adapters
    alpha: float = 8.0  # LoRA scale: the update is multiplied by alpha / r
    dropout: float = 0.1  # LoRA dropout on the adapters' input (training only)
    mlp: bool = False  # also adapt the blocks' MLP projections, not only attention's qkv/proj (LoRA)
    last_n_blocks: int | None = 2  # the last N blocks train; null = every block (+ patch embedding when full)

    def __post_init__(self):
        _check_tier(self)
        _range(self, "last_n_blocks", ge=1)  # or null


TierConfig = LanguageTier | ProjectorTier | VisionTier  # any one tier (model/tiers.py walks the three)


@dataclass
class TiersConfig:
    # lora: adapters on each trained tier's linears (peft); full: the tier's weights themselves train
    method: Literal["lora", "full"] = "lora"
    # MoE expert LoRA (tiers.language.experts): fused = applied as activations in the experts'
    # own grouped GEMM, no folded weight copy (model/moe_lora.py); peft = peft's ParamWrapper,
    # which folds the update into a copy of every layer's experts each forward (and has no dropout)
    expert_lora: Literal["fused", "peft"] = "fused"
    language: LanguageTier = field(default_factory=LanguageTier)  # the decoder layers
    projector: ProjectorTier = field(default_factory=ProjectorTier)  # vision -> language merger
    vision: VisionTier = field(default_factory=VisionTier)  # the vision tower

    def __post_init__(self):
        _require(not (self.language.experts and self.method == "full"),
                 "tiers.language.experts applies to LoRA: full fine-tuning already trains the experts "
                 "(every language weight); remove it or use tiers.method=lora")


EXPERT_METHODS_WHY = (
    "MoE expert weights are quantized by bitsandbytes' parametrization, in NF4 only (int8 and fp8 experts are not "
    "built); auto: nf4 when quant.language is nf4, else none (bf16)")


@dataclass
class QuantConfig:
    """Per-module weight quantization (model/quant.py): QLoRA training and quantized deployment."""

    language: Literal["none", "nf4", "int8", "fp8"] = "none"  # the language model's linears (QLoRA: nf4)
    vision: Literal["none", "nf4", "int8", "fp8"] = "none"  # the vision tower's linears
    projector: Literal["none", "nf4", "int8", "fp8"] = "none"  # the projector's linears
    allow_4bit_vision: bool = False  # nf4 on the vision tower / projector only when forced
    # MoE models' fused 3-D expert weights (model/quant.quantize_experts): auto follows quant.language
    # where that is nf4 (an MoE's experts are ~95% of its weights: QLoRA without them saves ~2%)
    experts: Literal["auto", "none", "nf4"] = field(default="auto", metadata={"why": EXPERT_METHODS_WHY})

    def __post_init__(self):
        if self.experts not in ("auto", "none", "nf4"):  # a QuantConfig built in Python, past load_config's check
            raise ConfigError(f"quant.experts={self.experts}: {EXPERT_METHODS_WHY}")
        for group in ("vision", "projector"):
            if getattr(self, group) == "nf4" and not self.allow_4bit_vision:
                raise ConfigError(f"quant.{group}=nf4: 4-bit vision weights lose fine visual detail for little "
                                  "memory; keep bf16 (none) or use int8/fp8, or set quant.allow_4bit_vision=true")
        used = {self.language, self.vision, self.projector} - {"none"}
        bnb = used & {"nf4", "int8"}
        if bnb and "fp8" in used:
            raise ConfigError(f"quant: {sorted(used)} mixes bitsandbytes (nf4/int8) and torchao (fp8) methods; "
                              "one backend per model")
        if len(bnb) > 1:
            raise ConfigError("quant: nf4 and int8 cannot be mixed in one model (one bitsandbytes config)")

    @property
    def expert_method(self) -> str:
        """What an MoE model's experts get: `experts`, with auto resolved (nf4 under an nf4 language model)."""
        if self.experts == "auto":
            return "nf4" if self.language == "nf4" else "none"
        return self.experts

    @property
    def enabled(self) -> bool:
        """Anything quantized (the experts count only on MoE models; a dense one has none to quantize)."""
        return any(m != "none" for m in (self.language, self.vision, self.projector, self.expert_method))

    @classmethod
    def from_flag(cls, flag: str | None) -> "QuantConfig":
        """The CLI's `--quant nf4|int8|fp8|none`: the language model only, vision stays bf16."""
        if flag in (None, "none"):
            return cls()
        if flag not in ("nf4", "int8", "fp8"):
            raise ConfigError(f"--quant {flag}: choose nf4, int8, fp8 or none")
        return cls(language=flag)
