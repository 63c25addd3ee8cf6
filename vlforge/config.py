"""Typed recipe configs: dataclasses, YAML files as instances of them, dotted CLI overrides.

    cfg = load_config(SFTConfig, "configs/demo-sft.yaml", ["tiers.language.lr=1e-3", "train.max_steps=10"])

Unknown keys are errors that name the key, where it came from, and the nearest valid key.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A config problem the user must fix: the message says where and what to do."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


class _OutOfRange(ConfigError):
    """A field outside its range, named relative to its section: `_build` prefixes the section's
    path, so a section used in several places (tiers.language, tiers.vision) names the full key."""


def _range(section: Any, key: str, *, ge: float | None = None, gt: float | None = None,
           le: float | None = None, lt: float | None = None, why: str = "") -> None:
    """Check a numeric field (each element of a tuple; null passes: the type says if it may be null).

    Floats must also be finite: an inf learning rate or clip norm trains into NaN weights."""
    value = getattr(section, key)
    for v in value if isinstance(value, tuple) else (value,):
        if v is None:
            continue
        ok = (isinstance(v, int) or math.isfinite(v)) and not (
            (ge is not None and v < ge) or (gt is not None and v <= gt)
            or (le is not None and v > le) or (lt is not None and v >= lt))
        if not ok:
            raise _OutOfRange(f"{key} must be {_rule(ge, gt, le, lt)}, got {value!r}" + (f": {why}" if why else ""))


def _rule(ge, gt, le, lt) -> str:
    if (ge is not None or gt is not None) and (le is not None or lt is not None):
        lo = f"[{ge:g}" if ge is not None else f"({gt:g}"
        hi = f"{le:g}]" if le is not None else f"{lt:g})"
        return f"in {lo}, {hi}"
    for op, bound in ((">=", ge), (">", gt), ("<=", le), ("<", lt)):
        if bound is not None:
            return f"{op} {bound:g}"
    return "a finite number"


# ----------------------------------------------------------------------------- sections


@dataclass
class ModelConfig:
    path: str | None = None  # local HF-format Qwen3-VL directory (never downloaded); wins over preset
    # tiny | qwen3vl-2b | -4b | -8b | -32b | tiny-moe | qwen3vl-30b-a3b | qwen3vl-235b-a22b (random weights)
    preset: str | None = None
    # flex_attention (MoE models only in transformers 5.17-5.24): torch's flex_attention, a
    # block-sparse document mask for data.packing; flash_attention_2 needs the flash-attn package
    # (varlen kernels when packed); sdpa packs rows through train/packed_attention.py (each
    # sample's own causal attention: torch's varlen_attn on CUDA), eager through a dense mask
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2", "flex_attention"] = "sdpa"
    # data.packing with sdpa: per_sample (above), or mask = transformers' dense block-diagonal
    # mask over the whole row (the previous path, measured slower than padding; for comparisons)
    packed_attention: Literal["per_sample", "mask"] = "per_sample"
    # the vision tower under sdpa: varlen = every image of a forward in one call (model/varlen.py:
    # torch's varlen_attn on CUDA, exact per-image SDPA elsewhere), sdpa = transformers' own loop,
    # one SDPA call per image in every block; auto = varlen but for a trainable vision tower whose
    # blocks run eager, where the loop measured faster (train/trainable.vision_attention_for_training)
    vision_attention: Literal["auto", "varlen", "sdpa"] = "auto"
    # MoE models: transformers' expert kernels; auto = grouped_mm (grouped GEMM) on CUDA, eager
    # (the reference loop over experts) elsewhere (model/load.experts_implementation)
    experts_implementation: Literal["auto", "eager", "grouped_mm", "batched_mm"] = "auto"
    seed: int = 0  # initialisation seed for presets

    def __post_init__(self):
        _range(self, "seed", ge=0)


# the keys data.columns may map a set's columns onto (data/layouts.py reads them)
COLUMN_KEYS = ("image", "images", "video", "videos", "text", "prompt", "answer", "system", "messages",
               "conversations", "task", "fps")


@dataclass
class DataConfig:
    train: str | None = None  # JSONL file
    val: str | None = None  # JSONL file for periodic eval
    max_length: int = 2048  # tokens per sample, image tokens included
    too_long: Literal["drop", "truncate", "fail"] = "drop"  # truncate only ever cuts answer tokens
    on_error: Literal["fail", "skip"] = "fail"  # bad rows: stop with file:line, or skip and count
    min_pixels: int = 32 * 32  # image resolution limits, passed to the Qwen3-VL image processor
    max_pixels: int = 1024 * 1024
    # Decompression-bomb guard: an image file with more pixels is refused from its header, before
    # decoding. PIL itself refuses more than 2 x Image.MAX_IMAGE_PIXELS = 178,956,970: the ceiling.
    max_image_pixels: int = 178_956_970
    # Videos (a list of frames, or a file): a file is sampled at video_fps frames per second (at least
    # 4 frames, as Qwen3-VL's video processor does), and any video cut to video_max_frames frames spread
    # evenly over it. Every 2 frames make one temporal patch; the frames are resized so that all of a
    # video's frames together hold video_min_pixels..video_max_pixels pixels (transformers' video
    # processor's size): the defaults are its class defaults, at most 768 x 32 x 32 pixels = 384 tokens a
    # video (released Qwen3-VL checkpoints ship 25,165,824 pixels and 768 frames). Recorded in the
    # processor the run's checkpoints save (data/encode.record_limits): inference reads videos alike.
    video_fps: float = 2.0
    video_max_frames: int = 64
    video_min_pixels: int = 128 * 32 * 32
    video_max_pixels: int = 768 * 32 * 32
    num_workers: int | Literal["auto"] = "auto"  # DataLoader workers; auto: train.runtime.resolve_num_workers
    # Padding-free packing: a micro-batch's samples concatenated into one row, attention kept inside
    # each sample (block-diagonal, from per-sample position ids) and M-RoPE computed per sample.
    # See docs/packing.md. auto = on where a packed row runs torch's varlen flash kernel (CUDA sm80+,
    # bf16/fp16, model.attn_implementation=sdpa with packed_attention=per_sample: train/packed_attention.
    # packing_pays), measured at least as fast as padding there (docs/benchmarks.md); off elsewhere (CPU,
    # fp32, eager, flex_attention, flash_attention_2, packed_attention=mask: doctor --config says which)
    packing: bool | Literal["auto"] = "auto"
    # Micro-batches by a token budget instead of train.batch_size samples: packed, the row's total
    # tokens; padded, rows x the longest row. Must fit one sample of data.max_length.
    max_tokens_per_batch: int | None = None
    # Which reader (docs/data.md): auto = by the path (.jsonl, .json, .parquet, a folder of parquet
    # shards or a `datasets` save_to_disk folder); a row's layout (native, ShareGPT/LLaVA, OpenAI
    # messages) is told by its keys
    format: Literal["auto", "jsonl", "json", "parquet", "arrow"] = "auto"
    # {our key: the set's column}, for sets that name them otherwise, e.g. {prompt: problem}
    columns: dict = field(default_factory=dict)
    # Read data.train lazily (rows read when a batch needs them; lengths measured then, not up front:
    # too-long rows are dropped as they come, no token-budget batches); data.val is read whole
    stream: bool = False
    # streaming parquet: the row groups shuffled together (each epoch permutes the groups, then the
    # rows of every `stream_window` consecutive groups): a reader holds that many groups at a time
    stream_window: int = 8

    def __post_init__(self):
        _require(self.max_length >= 8, f"data.max_length must be >= 8, got {self.max_length}")
        bad = [k for k, v in self.columns.items() if k not in COLUMN_KEYS or not isinstance(v, str)]
        _require(not bad, f"data.columns: {bad[0] if bad else ''!r} is not one of {', '.join(COLUMN_KEYS)} "
                          "(each maps one of these keys to the set's column name, a string)")
        _require(not (self.stream and self.max_tokens_per_batch),
                 "data.stream=true reads lengths as rows come, and data.max_tokens_per_batch needs every length "
                 "up front: use train.batch_size with data.stream, or data.stream=false")
        _require(self.stream_window >= 1, f"data.stream_window must be >= 1, got {self.stream_window}")
        _require(self.max_tokens_per_batch is None or self.max_tokens_per_batch >= self.max_length,
                 f"data.max_tokens_per_batch={self.max_tokens_per_batch} is below data.max_length={self.max_length}: "
                 "a sample of the longest allowed length would fit no batch; raise it or lower data.max_length")
        _require(0 < self.min_pixels <= self.max_pixels, "data.min_pixels must be > 0 and <= data.max_pixels")
        _require(0 < self.max_image_pixels <= 178_956_970,
                 f"data.max_image_pixels must be in 1..178956970 (PIL refuses larger images), got {self.max_image_pixels}")
        _require(self.num_workers == "auto" or self.num_workers >= 0, "data.num_workers must be >= 0 or auto")
        _require(self.video_fps > 0, f"data.video_fps must be > 0, got {self.video_fps}")
        _require(self.video_max_frames >= 2, f"data.video_max_frames must be >= 2 (one temporal patch), "
                                             f"got {self.video_max_frames}")
        _require(0 < self.video_min_pixels <= self.video_max_pixels,
                 "data.video_min_pixels must be > 0 and <= data.video_max_pixels")


@dataclass
class LossConfig:
    """How the lm_head + cross-entropy (SFT loss) is computed; train/losses.py. All keep fp32 math."""

    # auto = chunked: ours, [chunk_size, V] logits at a time in forward and backward (on the H200 at
    # least as fast as liger: 2B full 1.03x in one call, inside the ~7% spread between calls; 8B LoRA
    # 1.13x across two calls; docs/benchmarks.md; and no extra dependency); liger: liger-kernel's
    # fused linear cross-entropy (`vlforge[liger]`, CUDA); plain: every supervised position's logits
    # at once (the reference the others are tested against)
    impl: Literal["auto", "liger", "chunked", "plain"] = "auto"
    chunk_size: int = 1024  # label positions per chunk (chunked): 1024 x 151,936 fp32 logits = 0.6 GB

    def __post_init__(self):
        _range(self, "chunk_size", ge=1)


@dataclass
class TierConfig:
    """One trainable group. LoRA: r/alpha/dropout apply; full: the whole group trains at `lr`."""

    train: bool = True
    lr: float = 1e-4
    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    mlp: bool = False  # also adapt the MLP projections (language and vision tiers)
    # MoE models, language tier: LoRA on the fused 3-D expert weights (LoRA only; full trains them anyway)
    experts: bool = False
    # MoE models, language tier: train the router (mlp.gate) fully; frozen by default (model/tiers.py: why)
    router: bool = False
    last_n_blocks: int | None = 2  # vision tier only; null = every block (+ patch embedding when full)

    def __post_init__(self):
        _range(self, "lr", ge=0)
        _range(self, "r", ge=1)
        _range(self, "alpha", gt=0, why="LoRA scales its update by alpha / r")
        _range(self, "dropout", ge=0, lt=1)
        _range(self, "last_n_blocks", ge=1)  # or null


def _language() -> TierConfig:
    return TierConfig(lr=2e-4, r=8, alpha=16, dropout=0.1)


def _projector() -> TierConfig:
    return TierConfig(lr=5e-4, r=32, alpha=64, dropout=0.05)


def _vision() -> TierConfig:
    return TierConfig(train=False, lr=1e-5, r=4, alpha=8, dropout=0.1, last_n_blocks=2)


@dataclass
class TiersConfig:
    method: Literal["lora", "full"] = "lora"
    # MoE expert LoRA (tiers.language.experts): fused = applied as activations in the experts'
    # own grouped GEMM, no folded weight copy (model/moe_lora.py); peft = peft's ParamWrapper,
    # which folds the update into a copy of every layer's experts each forward (and has no dropout)
    expert_lora: Literal["fused", "peft"] = "fused"
    language: TierConfig = field(default_factory=_language)
    projector: TierConfig = field(default_factory=_projector)
    vision: TierConfig = field(default_factory=_vision)


@dataclass
class ModuleOverride:
    """Per-module precision: modules whose name matches `pattern` (re.search) get these dtypes.

    e.g. {pattern: 'norm', storage: fp32, compute: fp32} keeps every norm's weight and arithmetic in
    fp32; {pattern: '^model\\.visual\\.', compute: bf16} keeps the vision tower in bf16 whatever
    the rest does. Later entries win over earlier ones.
    """

    pattern: str
    compute: Literal["bf16", "fp16", "fp32"] | None = None  # autocast dtype inside the module
    storage: Literal["bf16", "fp16", "fp32"] | None = None  # dtype of its frozen weights

    def __post_init__(self):
        import re

        try:
            re.compile(self.pattern)
        except re.error as e:
            raise ConfigError(f"precision.overrides: pattern {self.pattern!r} is not a valid regex: {e}") from None
        _require(self.compute or self.storage, f"precision.overrides: {self.pattern!r} sets neither compute nor storage")


@dataclass
class LossScaleConfig:
    """Dynamic loss scaling (fp16 only; bf16 and FP8 need none)."""

    init_scale: float = 2.0**16
    growth_factor: float = 2.0  # scale *= growth_factor after growth_interval finite steps in a row
    backoff_factor: float = 0.5  # scale *= backoff_factor on a step with inf/nan gradients (step skipped)
    growth_interval: int = 2000

    def __post_init__(self):
        _range(self, "init_scale", gt=0)
        _range(self, "growth_factor", gt=1)
        _range(self, "backoff_factor", gt=0, lt=1)
        _range(self, "growth_interval", ge=1)


@dataclass
class TERecipeConfig:
    """A TransformerEngine FP8 recipe (used when precision.fp8.backend=te)."""

    recipe: Literal["delayed", "current", "block"] = "delayed"  # DelayedScaling | Float8CurrentScaling | Float8BlockScaling
    fp8_format: Literal["HYBRID", "E4M3"] = "HYBRID"  # HYBRID: E4M3 forward, E5M2 gradients
    margin: int = 0  # delayed scaling: scale = (fp8_max / amax) / 2**margin
    amax_history_len: int = 16
    amax_compute_algo: Literal["max", "most_recent"] = "max"

    def __post_init__(self):
        _range(self, "margin", ge=0)
        _range(self, "amax_history_len", ge=1)


@dataclass
class FP8Config:
    """FP8 training of eligible nn.Linear layers (GPU with compute capability >= 8.9 only)."""

    enabled: bool = False
    backend: Literal["torchao", "te"] = "torchao"
    recipe: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] = "tensorwise"  # torchao recipes
    # Candidates: linears whose name matches an include regex and no exclude regex. By default the
    # language model's decoder layers only: lm_head, the vision tower and the projector stay bf16.
    include: list[str] = field(default_factory=lambda: [r"^model\.language_model\.layers\."])
    exclude: list[str] = field(default_factory=list)
    # Skip layers too small to gain (torchao's published H100 thresholds per recipe); dims that
    # are not multiples of 16 are always skipped (an FP8 tensor-core requirement).
    skip_small: bool = True
    te: TERecipeConfig = field(default_factory=TERecipeConfig)  # language-model layers
    te_vision: TERecipeConfig = field(default_factory=TERecipeConfig)  # vision-tower layers, if included

    def __post_init__(self):
        import re

        for key in ("include", "exclude"):
            for pattern in getattr(self, key):
                try:
                    re.compile(pattern)
                except re.error as e:
                    raise ConfigError(f"precision.fp8.{key}: {pattern!r} is not a valid regex: {e}") from None


@dataclass
class PrecisionConfig:
    """The one precision policy; train/precision.py applies it. See docs/precision.md."""

    # Compute dtype (autocast). Norms, softmax, losses, log-probs and advantages are fp32 regardless.
    mode: Literal["bf16", "fp16", "fp32"] = "bf16"
    # Trainable weights + optimizer state: fp32 master weights, or kept in the compute dtype
    # (halves weight/optimizer memory; updates smaller than bf16's resolution are lost), or
    # `optimizer`: fp32 masters kept by the optimizer while the model's linear weights are bf16
    # working copies it rewrites in the same pass (bf16 only, one process): no per-step weight
    # casts; the same forward and gradients as fp32 (train/optim.MasterWeightAdamW).
    master_weights: Literal["fp32", "compute", "optimizer"] = "fp32"
    overrides: list[ModuleOverride] = field(default_factory=list)
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    fp8: FP8Config = field(default_factory=FP8Config)
    gradient_checkpointing: bool = False
    # Selective checkpointing per block: with gradient_checkpointing, recompute 1 of every N decoder
    # layers and vision blocks in backward (1: all of them; 2: every other one, keeping the other half's
    # activations for half the recomputation).
    checkpoint_every: int = 1
    # Compiled layers only (precision.compile): the fraction (0, 1] of the activations torch's
    # min-cut partitioner may keep for backward; it recomputes the cheapest of the rest (torch's
    # activation memory budget; null = its default, 1: keep what it would). A memory knob finer than
    # whole-layer checkpointing, chosen op by op.
    activation_memory_budget: float | None = None
    # torch.compile each decoder layer; auto = on where measured faster (train/trainable.default_compile),
    # and when FP8 (torchao) runs on a GPU, where its casts must be fused to pay off.
    compile: bool | Literal["auto"] = "auto"
    # With compiled decoder layers: also torch.compile each vision block (its attention one varlen
    # call with model.vision_attention varlen/auto, so no host loop splits the graph); auto = on
    # with compiled decoder layers and the varlen vision attention (measured faster: 2B full SFT)
    compile_vision: bool | Literal["auto"] = "auto"
    # SFT with packed rows on one CUDA GPU: replay each compiled decoder layer's forward and backward
    # as CUDA graphs (torch.compile's reduce-overhead mode), which takes the host's kernel launches off
    # a step that waits for them. Rows are padded up to a multiple of 256 tokens so that few row
    # lengths, each recorded once, recur (~3% more tokens at 2B and batch 8); evaluation runs eager.
    # Measured (one H200, docs/benchmarks.md): 2B full 1.05-1.08x, 8B three-tier LoRA 0.98x (GPU-bound);
    # off by default: the gain is small and a run with many row lengths holds many recordings.
    cuda_graphs: bool = False
    # With cuda_graphs: the compiled vision blocks as CUDA graphs too (2B full: another 1.04x). For
    # data whose images share one size: the tower's input is not padded, so every new total of image
    # patches in a micro-batch records its graphs again (a slow step); the run warns when it sees many.
    cuda_graphs_vision: bool = False

    def __post_init__(self):
        _require(not (self.fp8.enabled and self.mode == "fp16"),
                 "precision.fp8.enabled with precision.mode=fp16 is not supported: FP8 layers keep their "
                 "non-FP8 parts in bf16; use precision.mode=bf16")
        _require(not (self.mode == "fp16" and self.master_weights == "compute"),
                 "precision.mode=fp16 needs precision.master_weights=fp32: loss scaling unscales fp32 master "
                 "gradients (fp16 weights would also lose most updates); or use precision.mode=bf16")
        _require(not (self.master_weights == "optimizer" and self.mode != "bf16"),
                 f"precision.master_weights=optimizer keeps bf16 working copies of fp32 masters: it needs "
                 f"precision.mode=bf16 (this config has {self.mode}); use master_weights=fp32")
        _range(self, "checkpoint_every", ge=1, why="1 of every N blocks is recomputed")
        _require(self.checkpoint_every == 1 or self.gradient_checkpointing,
                 f"precision.checkpoint_every={self.checkpoint_every} selects the blocks gradient checkpointing "
                 "recomputes: set precision.gradient_checkpointing=true too")
        _range(self, "activation_memory_budget", gt=0, le=1, why="a fraction of the activations kept for backward")
        # compile=true, not auto: auto compiles only measured setups (and GRPO never), which is known only
        # once the model is loaded; a budget must be refused before that, not after minutes of loading
        _require(self.activation_memory_budget is None or self.compile is True,
                 "precision.activation_memory_budget acts on compiled layers (torch's partitioner): set "
                 "precision.compile=true, or use gradient_checkpointing / checkpoint_every")
        _require(self.compile_vision is not True or self.compile is True,
                 "precision.compile_vision compiles the vision blocks along with the decoder layers: set "
                 "precision.compile=true too")
        _require(not self.cuda_graphs or self.compile is True,
                 "precision.cuda_graphs replays the compiled decoder layers as CUDA graphs: set precision.compile=true")
        _require(not self.cuda_graphs_vision or self.cuda_graphs,
                 "precision.cuda_graphs_vision graphs the vision blocks along with the decoder layers: set "
                 "precision.cuda_graphs=true too")
        _require(not (self.cuda_graphs_vision and self.compile_vision is False),
                 "precision.cuda_graphs_vision replays the compiled vision blocks: set precision.compile_vision "
                 "auto or true")
        _require(not (self.cuda_graphs and (self.gradient_checkpointing or self.fp8.enabled)),
                 "precision.cuda_graphs is built and measured for non-FP8 layers without recomputation: turn off "
                 "precision.gradient_checkpointing and precision.fp8.enabled, or precision.cuda_graphs")
        for o in self.overrides:
            _require(o.compute != "fp16" or self.mode == "fp16",
                     f"precision.overrides: {o.pattern!r} computes in fp16 but precision.mode={self.mode} has no "
                     "loss scaling, so its small gradients would underflow; use bf16 or fp32 there")


@dataclass
class OptimConfig:
    # AdamW keeps two moments per trainable parameter. `adamw` (torch, fused on CUDA) keeps them in
    # fp32: 8 bytes/param, 70 GB for an 8.8B full fine-tune on top of its fp32 weights and grads.
    # `adamw8bit` (bitsandbytes) keeps them in uint8 with one fp32 scale per 256 values: ~2
    # bytes/param (tensors under 4096 values, i.e. biases and norms, stay fp32). `paged_adamw8bit`
    # also lets CUDA page that state out to host memory under GPU memory pressure (CUDA only).
    # Both 8-bit ones need `pip install 'vlforge[quant]'`. Under FSDP2 they step each rank's shards,
    # with uint8 moments where a tensor's rows are whole 256-value blocks (train/optim.sharded_8bit).
    name: Literal["adamw", "adamw8bit", "paged_adamw8bit"] = "adamw"
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0  # final lr as a fraction of the peak
    max_grad_norm: float | None = 1.0  # null disables clipping

    def __post_init__(self):
        _range(self, "weight_decay", ge=0)
        _range(self, "betas", ge=0, lt=1, why="AdamW's moment decay rates")
        _range(self, "eps", gt=0)
        _range(self, "warmup_steps", ge=0)
        _range(self, "min_lr_ratio", ge=0, le=1)
        _range(self, "max_grad_norm", gt=0, why="a norm <= 0 would flip or zero the update; null disables clipping")


@dataclass
class TrainConfig:
    output_dir: str = "runs/sft"
    batch_size: int = 8  # samples per micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step
    max_steps: int | None = None  # optimizer steps; null = epochs * steps per epoch
    epochs: int = 1
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda | cuda:N | mps
    save_every: int = 0  # optimizer steps between checkpoints; 0 = only at the end
    keep_last: int = 2
    resume: Literal["auto", "never"] | str = "never"  # auto | never | path to a checkpoint-STEP dir
    overwrite: bool = False
    # MoE models: x the router load-balancing loss (train/moe.py), added to the training loss.
    # SFT default 0.001: the coefficient Qwen3-VL-30B-A3B / 235B-A22B ship in config.json, i.e. what
    # their training balanced with. GRPO defaults to 0: the aux gradient sits outside the clipped policy
    # objective, tied to no reward, and moves routing (rollout/trainer agreement) from the start's
    # balance; the load is logged, so a drift shows and the key can be set then.
    router_aux_loss_coef: float = 0.001

    def __post_init__(self):
        _range(self, "router_aux_loss_coef", ge=0)
        for key in ("batch_size", "grad_accum", "epochs", "keep_last"):
            _range(self, key, ge=1)
        _range(self, "max_steps", ge=1)  # or null
        _range(self, "save_every", ge=0)
        _range(self, "seed", ge=0)
        if not re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", self.device):
            raise _OutOfRange(f"device: {self.device!r} is not one of auto, cpu, cuda, cuda:N, mps")


@dataclass
class DistributedConfig:
    """Training on several processes (torchrun: FSDP2 or DDP), and FSDP2 on one. train/distributed.py applies it.

    One process per GPU: `torchrun --nproc_per_node N -m vlforge sft CONFIG`. Mixed precision comes
    from the `precision` section (FSDP2 gathers parameters in the compute dtype, keeps fp32 master
    weights sharded, and reduces gradients in fp32).
    """

    # auto: FSDP2 under torchrun (world size > 1), none on one process; fsdp2 also on one process
    # (what cpu_offload needs); ddp: a full replica per process (models whose training state fits one GPU)
    strategy: Literal["auto", "none", "fsdp2", "ddp"] = "auto"
    reshard_after_forward: bool = True  # FSDP2: free gathered weights after forward (memory) or keep them (speed)
    cpu_offload: bool = False  # FSDP2: sharded parameters, gradients and optimizer state live in host memory
    # FSDP2: consecutive decoder layers (and vision blocks) gathered as one unit; auto: 4 on one process
    # (fewer units, less of FSDP2's per-unit host work: measured 0.93x of no sharding against 0.82x
    # with 1, eager 2B on an H200), 1 with several processes (per-layer overlap and memory, not measured)
    layers_per_unit: int | Literal["auto"] = "auto"
    timeout_s: int = 600  # a collective waiting longer than this ends the run (a rank died or hangs)
    # FSDP2: every rank builds the model on the meta device and rank 0 loads the weights in host
    # memory and sends each rank its shards, so no GPU ever holds the whole model; auto: with
    # more than one process or with cpu_offload (false: each process loads the whole model first)
    meta_init: bool | Literal["auto"] = "auto"

    def __post_init__(self):
        _range(self, "timeout_s", ge=10)
        if self.layers_per_unit != "auto":
            _range(self, "layers_per_unit", ge=1)
        if self.cpu_offload and self.strategy not in ("auto", "fsdp2"):
            raise _OutOfRange("cpu_offload needs strategy fsdp2 (or auto under torchrun)")


@dataclass
class EvalConfig:
    every: int = 0  # optimizer steps between evals; 0 = only at the end
    max_samples: int | None = 256  # val samples used for generation accuracy
    batch_size: int = 16
    max_new_tokens: int = 16
    at_start: bool = False  # also evaluate before the first step

    def __post_init__(self):
        _range(self, "every", ge=0)
        for key in ("max_samples", "batch_size", "max_new_tokens"):  # max_samples may be null: all
            _range(self, key, ge=1)


@dataclass
class LogConfig:
    every: int = 1
    tensorboard: bool = False
    progress: bool = True
    # samples/ in the run directory (train/samples.py, `vlforge view`): GRPO groups every
    # samples_every steps (0: none), samples_per_step of them; samples_eval probes per evaluation;
    # the folder stops growing at samples_max_mb
    samples_every: int = 1
    samples_per_step: int = 2
    samples_eval: int = 32
    samples_max_mb: float = 100.0
    # trackers (train/trackers.py), rank 0 only: wandb (WANDB_MODE=offline: no network) and MLflow
    # (mlflow_uri, default a SQLite store, output_dir/mlflow.db); project: wandb's project, MLflow's
    # experiment; run_name: default the output directory's name
    wandb: bool = False
    mlflow: bool = False
    project: str = "vlforge"
    run_name: str | None = None
    mlflow_uri: str | None = None

    def __post_init__(self):
        _range(self, "every", ge=1)
        for key in ("samples_every", "samples_per_step", "samples_eval"):
            _range(self, key, ge=0)
        _range(self, "samples_max_mb", ge=0)


EXPERT_METHODS_WHY = (
    "MoE expert weights are quantized by bitsandbytes' parametrization, in NF4 only (int8 and fp8 experts are not "
    "built); auto: nf4 when quant.language is nf4, else none (bf16)")


@dataclass
class QuantConfig:
    """Per-module weight quantization (model/quant.py): QLoRA training and quantized deployment."""

    language: Literal["none", "nf4", "int8", "fp8"] = "none"
    vision: Literal["none", "nf4", "int8", "fp8"] = "none"
    projector: Literal["none", "nf4", "int8", "fp8"] = "none"
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


@dataclass
class HealthConfig:
    """Gradient-health monitor: per-group grad norms, inf/nan steps skipped, loss-spike warnings."""

    max_bad_steps: int = 10  # abort after this many consecutive steps with inf/nan gradients
    spike_factor: float = 3.0  # warn when a step's loss exceeds spike_factor x the recent median
    spike_window: int = 20  # steps in that median (no warnings before the window has filled)
    # ... and exceeds it by this many nats: with small batches a few hard samples multiply the loss
    # many times over (healthy demo runs: 0.002 -> 0.2, 0.19 -> 0.99); instabilities add nats
    spike_min_rise: float = 1.0

    def __post_init__(self):
        _range(self, "max_bad_steps", ge=1)
        _range(self, "spike_factor", gt=1)
        _range(self, "spike_window", ge=2)
        _range(self, "spike_min_rise", ge=0)


@dataclass
class RunConfig:
    """The sections every training recipe has; SFTConfig and GRPOConfig add their own."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    tiers: TiersConfig = field(default_factory=TiersConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)


@dataclass
class SFTConfig(RunConfig):
    """`vlforge sft`: the shared sections only."""


@dataclass
class RolloutConfig:
    group_size: int = 8  # G responses per prompt
    prompts_per_step: int = 8  # B prompts per optimizer step (before dynamic-sampling refills)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 256  # the response length cap
    # vlforge: generate/ (static KV slots, CUDA-graph decode); hf: the plain decode loop on
    # transformers' DynamicCache, kept for comparison
    engine: Literal["vlforge", "hf"] = "vlforge"
    # torch.compile the decode step (vlforge engine on CUDA): once per run, then ~1.9x faster
    # decoding (docs/benchmarks.md); off: CUDA graphs of the eager layers
    compile: bool = True
    # Keep the engine's KV slots (and decode CUDA graphs) from one step's rollouts to the next, or
    # free them once the rollouts are done so the update can use that memory: layers x 2 x slots x
    # KV length x KV heads x head dim x 2 bytes (8B, 64 slots x 1024 tokens: 9.7 GB). Freeing costs,
    # every step, the allocation and, on one GPU, capturing each decode graph again (one per slot /
    # KV-length bucket reached; docs/benchmarks.md: 3 graphs in 1.7 s with eager layers, 0.3 s for a
    # compiled step's). The compiled step itself is kept and does not recompile for new buffers of
    # another length (their length is a dynamic dimension; tested). Several processes capture no
    # graphs, so there freeing costs only the allocation. Kept by default: the buffers serve every
    # step; free them when the update runs out of memory.
    keep_kv: bool = True
    # Decode slots (vlforge engine): 0 = every sample of a round at once (the KV memory of all of
    # them); N = at most N samples decode together and the others wait, a prompt's G samples
    # joining as soon as G slots are free (continuous batching: a group of short answers frees its
    # slots for the next prompt, and the KV slots' memory is N rows). Same tokens either way (each
    # sample's randomness is its own row's, generate/sampling.py). At least group_size.
    max_slots: int = 0
    # MoE models (docs/moe.md): the rollout records every token's top-k experts per layer and the
    # trainer logs moe/route_flip (how often its own choice differs); true: the trainer's forwards
    # (and the KL reference's) also use the recorded experts ("router replay", R3); record: measure only.
    # Off by default: replay makes the trainer run experts its router would not pick (and routes its
    # gradient through them); turn it on when moe/route_flip and the ratio's spread say the mismatch matters
    router_replay: bool | Literal["record"] = False
    # Multi-turn tool rollouts (rollout/multiturn.py, README "Tools in GRPO"): tools the model may call,
    # builtins (calculator) or path/to/file.py:function (type hints + a docstring with Args: its schema).
    # The chat template lists them in the prompt; an assistant turn with <tool_call> blocks gets their
    # results back as a tool message and the rollout continues. Results and headers are read, not trained.
    tools: list[str] = field(default_factory=list)
    tool_turns: int = 4  # assistant turns whose tool calls run, at most; a later turn's calls end the response
    tool_result_tokens: int = 256  # each tool result's text cut to this many tokens
    # each tool result's text cut to this many characters first, where the call returns (a note the model
    # reads first, and a warning): a tool that returns megabytes costs neither memory nor tokenizer time
    tool_result_chars: int = 65536
    # a tool's returned images are resized to at most this many pixels (256 tokens at Qwen3-VL's 32x32
    # pixels a token; data.min_pixels..max_pixels apply to the prompt's images): their tokens count
    # toward max_new_tokens, and an image at data.max_pixels (1024 tokens) would rarely fit
    tool_image_max_pixels: int = 256 * 32 * 32
    tool_timeout_s: float = 30.0  # a round of tool calls (all sequences' at once) waits this long for them
    # 0: each call on a thread of the trainer's process; N > 0: in up to N worker processes, where a
    # call past tool_timeout_s is stopped (for tools that may hang, hold the GIL or crash)
    tool_processes: int = 0

    def __post_init__(self):
        if self.tools and self.engine == "hf":
            raise ConfigError("rollout.tools needs rollout.engine=vlforge (multi-turn rollouts run on the engine)")
        if self.tools and self.router_replay is not False:
            raise ConfigError(f"rollout.tools with rollout.router_replay={self.router_replay}: the experts of a "
                              "multi-turn rollout's later turns are not recorded; remove one of the two")
        _range(self, "tool_turns", ge=1)
        _range(self, "tool_result_tokens", ge=1)
        _range(self, "tool_result_chars", ge=1)
        _range(self, "tool_image_max_pixels", ge=1024)
        _range(self, "tool_timeout_s", gt=0)
        _range(self, "tool_processes", ge=0)
        if self.router_replay is not False and self.engine == "hf":
            raise ConfigError(f"rollout.router_replay={self.router_replay} needs rollout.engine=vlforge "
                              "(the plain hf decode loop records no routes)")
        _range(self, "group_size", ge=2, why="advantages compare responses within a group")
        _range(self, "prompts_per_step", ge=1)
        _range(self, "temperature", ge=0, why="0 = greedy")
        _range(self, "top_p", gt=0, le=1)
        _range(self, "top_k", ge=0, why="0 = off")
        _range(self, "max_new_tokens", ge=1)
        _range(self, "max_slots", ge=0, why="0 = every sample at once")
        if self.max_slots and self.engine == "hf":
            raise ConfigError(f"rollout.max_slots={self.max_slots} needs rollout.engine=vlforge (the plain hf "
                              "decode loop runs every sample at once)")
        if 0 < self.max_slots < self.group_size:
            raise ConfigError(f"rollout.max_slots={self.max_slots} is below rollout.group_size={self.group_size}: "
                              "a prompt's samples decode together (they share its prefill); raise it or set 0")


@dataclass
class RewardConfig:
    name: str = "exact_match"  # builtin (exact_match, choice, numeric, format) or path/to/file.py:function
    weight: float = 1.0  # may be negative: a penalty
    kwargs: dict = field(default_factory=dict)

    def __post_init__(self):
        _range(self, "weight")


# Each policy loss's (clip_low, clip_high) when the config leaves them null: PPO's usual 0.2; GSPO's paper
# (v2, section 5.1); CISPO without lower truncation, as MiniMax-M1
LOSS_CLIP_RANGES = {"ppo": (0.2, 0.2), "gspo": (3e-4, 4e-4), "cispo": (1.0, 0.2)}


@dataclass
class RLConfig:
    rewards: list[RewardConfig] = field(default_factory=lambda: [RewardConfig()])
    # Outcome advantages (rl/core.outcome_advantages): grpo (rewards centred on the group's mean,
    # scaled by adv_scale), rloo (the mean of the group's other responses as baseline), reinforce++
    # (rewards whitened over the batch), reinforce++-baseline (centred on the group, then whitened)
    advantage: Literal["grpo", "rloo", "reinforce++", "reinforce++-baseline"] = "grpo"
    adv_scale: Literal["group", "batch", "none"] = "group"  # grpo's: group std, batch std, none (Dr. GRPO)
    # The policy-gradient loss (rl/core.policy_loss): ppo (the clipped surrogate of GRPO; DAPO with
    # clip_high > clip_low; Dr. GRPO with adv_scale none and agg seq-mean-token-sum-norm), gspo (one
    # importance ratio a sequence), cispo (a truncated, detached importance weight on every token's
    # log-prob gradient: clipped tokens still learn)
    policy_loss: Literal["ppo", "gspo", "cispo"] = "ppo"
    # The ratio's bounds [1 - clip_low, 1 + clip_high]; null: each loss's own (ppo 0.2 / 0.2; gspo
    # 3e-4 / 4e-4, the paper's; cispo 1 / 0.2: no lower truncation, as MiniMax-M1)
    clip_low: float | None = None
    clip_high: float | None = None
    dual_clip: float | None = None  # ppo only
    # The ratio's old log-probs: rollout (the rollout engine's, free) or trainer (one more no-grad forward
    # a step, as the KL reference's, verl's recompute: for a clip band as narrow as gspo's, where the
    # engine's and the trainer's numerics already differ by about as much)
    old_logprobs: Literal["rollout", "trainer"] = "rollout"
    # auto: seq-mean-token-mean with gspo (its objective: a mean over sequences), else token-mean
    agg: Literal["auto", "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = "auto"
    kl_beta: float = 0.0  # 0: no KL term and no reference forward
    kl_kind: Literal["k1", "k2", "k3"] = "k3"
    epochs: int = 1  # mu: optimisation passes over each rollout batch
    mini_batch_size: int = 16  # sequences per optimizer step within a pass
    dynamic_sampling: bool = False  # drop groups whose rewards are all equal, refill with new prompts
    max_sampling_tries: int = 3  # rollout rounds per step when dynamic sampling
    overlong_penalty: float = 0.0  # subtracted from the reward of responses cut at max_new_tokens
    # The update's log-prob forwards on real tokens only: a mini-batch part's prompts (no left
    # padding) and responses (no right padding) packed into one row, M-RoPE and attention per
    # sequence (docs/packing.md). auto = on where attention runs per sample without a dense mask
    # (model.attn_implementation=sdpa with packed_attention=per_sample); off for eager / flex / mask
    packing: bool | Literal["auto"] = "auto"

    def __post_init__(self):
        for key in ("epochs", "mini_batch_size", "max_sampling_tries"):
            _range(self, key, ge=1)
        _require(bool(self.rewards), "rl.rewards needs at least one reward function")
        _range(self, "kl_beta", ge=0)
        if self.policy_loss == "cispo":  # a weight, not a ratio PPO's max() acts on: 0 is a valid lower bound
            _range(self, "clip_low", ge=0, le=1, why="the importance weight's lower bound is 1 - clip_low")
        else:
            _range(self, "clip_low", ge=0, lt=1, why="the ratio's lower bound is 1 - clip_low")
        _range(self, "clip_high", ge=0)
        _range(self, "dual_clip", gt=1)  # or null
        _require(self.dual_clip is None or self.policy_loss == "ppo",
                 f"rl.dual_clip bounds PPO's clipped surrogate; rl.policy_loss={self.policy_loss} has none: remove it")
        _require(self.adv_scale == "group" or self.advantage == "grpo",
                 f"rl.adv_scale={self.adv_scale} scales GRPO's advantages; rl.advantage={self.advantage} has its own "
                 "scaling: remove rl.adv_scale")
        _range(self, "overlong_penalty", ge=0, why="it is subtracted from the reward")

    # The loss's settings with null / auto resolved (the config keeps them as written: a partial `rl`
    # section is merged over these defaults, so they must not be resolved when the section is built)
    @property
    def clip_range(self) -> tuple[float, float]:
        """(clip_low, clip_high), each null taking rl.policy_loss's own (LOSS_CLIP_RANGES)."""
        low, high = LOSS_CLIP_RANGES[self.policy_loss]
        return (low if self.clip_low is None else self.clip_low, high if self.clip_high is None else self.clip_high)

    @property
    def aggregation(self) -> str:
        """rl.agg with auto resolved: seq-mean-token-mean for gspo, else token-mean."""
        if self.agg != "auto":
            return self.agg
        return "seq-mean-token-mean" if self.policy_loss == "gspo" else "token-mean"


@dataclass
class GRPOConfig(RunConfig):
    """`vlforge grpo`: the shared sections (another default output_dir and length) + rollout and rl."""

    train: TrainConfig = field(default_factory=lambda: TrainConfig(output_dir="runs/grpo", max_steps=100,
                                                                   router_aux_loss_coef=0.0))
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    rl: RLConfig = field(default_factory=RLConfig)


# ----------------------------------------------------------------------------- loading


def _suggest(key: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f"did you mean '{close[0]}'? " if close else ""
    return f"{hint}valid keys: {', '.join(valid)}"


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[-1] if errors else f"{where}: cannot be null")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{where}: {value!r} is not one of {list(args)}")
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping of keys, got {value!r}")
        return _build(tp, value, where)
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{where}: expected a list of {len(args)} values, got {value!r}")
        return tuple(_coerce(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return [_coerce(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        _string_keys(value, where)
        return dict(value)
    if tp is float and isinstance(value, str):  # YAML 1.1 reads "1e-4" as a string
        try:
            value = float(value)
        except ValueError:
            pass
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):  # .inf / .nan: no setting means "infinitely much"
            raise ConfigError(f"{where}: must be a finite number, got {value}")
        return float(value)
    if tp is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if isinstance(tp, type) and isinstance(value, tp) and not (tp is int and isinstance(value, bool)):
        return value
    if value is None:
        raise ConfigError(f"{where}: cannot be null")
    raise ConfigError(f"{where}: expected {getattr(tp, '__name__', tp)}, got {value!r}")


def _string_keys(data: dict, where: str) -> None:
    for key in data:
        if not isinstance(key, str):
            raise ConfigError(f"{where + ': ' if where else ''}key {key!r} is not a name; keys must be strings "
                              "(quote it in YAML if it is meant as one)")


def _build(cls: type, data: dict, where: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    _string_keys(data, where)
    kwargs = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else key
        if key not in names:
            raise ConfigError(f"unknown key '{path}': {_suggest(key, names)}")
        fld = next(f for f in dataclasses.fields(cls) if f.name == key)
        if isinstance(value, dict) and fld.default_factory is not dataclasses.MISSING:
            default = fld.default_factory()
            if dataclasses.is_dataclass(default):  # a partial section keeps this field's own defaults
                unknown = [k for k in value if k not in {f.name for f in dataclasses.fields(default)}]
                if not unknown:
                    value = _merge(to_dict(default), value)
        try:
            kwargs[key] = _coerce(value, hints[key], path)
        except ConfigError as e:  # a key whose only valid values are few says why (quant.experts)
            raise ConfigError(f"{e}: {fld.metadata['why']}" if "why" in fld.metadata else str(e)) from None
    try:
        return cls(**kwargs)  # __post_init__ range checks raise ConfigError naming their key
    except _OutOfRange as e:
        raise ConfigError(f"{where}.{e}" if where else str(e)) from None


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override '{dotted}': '{k}' is not a section")
    node[keys[-1]] = value


def parse_overrides(overrides: list[str]) -> dict:
    tree: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' must look like key.sub=value (e.g. tiers.language.lr=1e-4)")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else None
        except yaml.YAMLError as e:
            raise ConfigError(f"override '{item}': the value is not valid YAML ({getattr(e, 'problem', e)}); "
                              "quote it if it is meant as text") from None
        _set_dotted(tree, key.strip(), value)
    return tree


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _read_file(path: str | Path | None) -> dict:
    """The YAML file's mapping, or {} without a file."""
    if path is None:
        return {}
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} not found")
    raw = path.read_bytes()
    try:
        data = yaml.safe_load(raw.decode("utf-8")) or {}
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 text (byte {e.start}: {e.reason}); save the file as UTF-8") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return data


def load_config(cls: type, path: str | Path | None = None, overrides: list[str] | None = None):
    """Build `cls` from defaults <- YAML file <- dotted overrides. Raises ConfigError on any bad key."""
    return _build_named(cls, _read_file(path), path, overrides or [])


def _build_named(cls: type, file_tree: dict, path: str | Path | None, overrides: list[str]):
    tree = _merge(file_tree, parse_overrides(overrides))  # a malformed override names itself
    try:
        return _build(cls, tree, "")
    except ConfigError as e:
        raise ConfigError(_blame(cls, file_tree, path, overrides, str(e))) from None


def _blame(cls: type, file_tree: dict, path: str | Path | None, overrides: list[str], message: str) -> str:
    """The error named after whoever gave the bad value: the file when it fails alike on its own,
    else the overrides without which this error is gone (two that conflict are both named). Found
    by building again without them (only on an error: a few dataclass builds) rather than by
    tracking each value's origin through _build, which every check would have to carry."""
    def same_error(kept: list[str]) -> bool:
        try:
            _build(cls, _merge(file_tree, parse_overrides(kept)), "")
        except ConfigError as e:
            return str(e) == message
        return False

    if not overrides or same_error([]):
        return f"{path}: {message}" if path else message
    culprits = [o for i, o in enumerate(overrides) if not same_error(overrides[:i] + overrides[i + 1:])] or overrides
    return f"override{'s' if len(culprits) > 1 else ''} {', '.join(repr(o) for o in culprits)}: {message}"


GRPO_ONLY_SECTIONS = ("rl", "rollout")


def recipe_class(data: dict) -> type:
    """SFTConfig or GRPOConfig for a config tree: GRPO's is the one with an `rl` or `rollout` section."""
    return GRPOConfig if any(k in data for k in GRPO_ONLY_SECTIONS) else SFTConfig


def load_recipe_config(path: str | Path | None, overrides: list[str] | None = None) -> SFTConfig | GRPOConfig:
    """load_config with the class picked by recipe_class (for commands that take either kind of run,
    e.g. a run's config.yaml: dump_config writes every section, so GRPO runs always have `rl`)."""
    file_tree = _read_file(path)
    cls = recipe_class(_merge(file_tree, parse_overrides(overrides or [])))
    return _build_named(cls, file_tree, path, overrides or [])


def resolve_paths(cfg: Any) -> Any:
    """A copy of `cfg` with relative file paths made absolute (against the current directory), for
    the run's config.yaml: its checkpoints then export/infer/serve from any working directory."""
    def absolute(p: str | None) -> str | None:
        return os.path.abspath(p) if p else p

    cfg = copy.deepcopy(cfg)
    cfg.model.path = absolute(cfg.model.path)
    cfg.data.train, cfg.data.val = absolute(cfg.data.train), absolute(cfg.data.val)
    for reward in getattr(getattr(cfg, "rl", None), "rewards", []):
        file, sep, fn = reward.name.rpartition(":")
        if sep and file.endswith(".py"):  # path/to/file.py:function (load_reward expands ~); builtins are names
            reward.name = f"{absolute(os.path.expanduser(file))}:{fn}"
        if (reward.name == "judge" and reward.kwargs.get("model") not in (None, "tiny")
                and not reward.kwargs.get("endpoint")):  # a local judge's model directory (an endpoint's: a name)
            reward.kwargs = {**reward.kwargs, "model": absolute(os.path.expanduser(str(reward.kwargs["model"])))}
    return cfg


def dump_config(cfg: Any) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
