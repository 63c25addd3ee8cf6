"""The training sections (train/ applies them): the loss, precision (dtypes and FP8), compile and
CUDA graphs, activation checkpointing, the optimizer, the step loop, distribution, evaluation,
logging and the gradient-health monitor."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from .load import ConfigError, _OutOfRange, _range, _require


@dataclass
class LossConfig:
    """How the training loss is computed: the lm_head + cross-entropy (train/losses.py; all keep fp32
    math) and, on MoE models, the router load-balancing term added to it."""

    # auto = chunked: ours, [chunk_size, V] logits at a time in forward and backward (on the H200 at
    # least as fast as liger: 2B full 1.03x in one call, inside the ~7% spread between calls; 8B LoRA
    # 1.13x across two calls; docs/benchmarks.md; and no extra dependency); liger: liger-kernel's
    # fused linear cross-entropy (`vlforge[liger]`, CUDA); plain: every supervised position's logits
    # at once (the reference the others are tested against)
    impl: Literal["auto", "liger", "chunked", "plain"] = "auto"
    chunk_size: int = 1024  # label positions per chunk (chunked): 1024 x 151,936 fp32 logits = 0.6 GB
    # MoE models: x the router load-balancing loss (train/moe.py), added to the training loss.
    # SFT default 0.001: the coefficient Qwen3-VL-30B-A3B / 235B-A22B ship in config.json, i.e. what
    # their training balanced with. GRPO defaults to 0: the aux gradient sits outside the clipped policy
    # objective, tied to no reward, and moves routing (rollout/trainer agreement) from the start's
    # balance; the load is logged, so a drift shows and the key can be set then.
    router_aux_loss_coef: float = 0.001

    def __post_init__(self):
        _range(self, "chunk_size", ge=1)
        _range(self, "router_aux_loss_coef", ge=0)


@dataclass
class ModuleOverride:
    """Per-module precision: modules whose name matches `pattern` (re.search) get these dtypes.

    e.g. {pattern: 'norm', storage: fp32, compute: fp32} keeps every norm's weight and arithmetic in
    fp32; {pattern: '^model\\.visual\\.', compute: bf16} keeps the vision tower in bf16 whatever
    the rest does. Later entries win over earlier ones.
    """

    pattern: str  # a regex searched in each module's name (e.g. 'norm', '^model\\.visual\\.')
    compute: Literal["bf16", "fp16", "fp32"] | None = None  # autocast dtype inside the module
    storage: Literal["bf16", "fp16", "fp32"] | None = None  # dtype of its frozen weights

    def __post_init__(self):
        try:
            re.compile(self.pattern)
        except re.error as e:
            raise ConfigError(f"precision.overrides: pattern {self.pattern!r} is not a valid regex: {e}") from None
        _require(self.compute or self.storage, f"precision.overrides: {self.pattern!r} sets neither compute nor storage")


@dataclass
class LossScaleConfig:
    """Dynamic loss scaling (fp16 only; bf16 and FP8 need none)."""

    init_scale: float = 2.0**16  # the first scale; halves on each overflowing step until it fits
    growth_factor: float = 2.0  # scale *= growth_factor after growth_interval finite steps in a row
    backoff_factor: float = 0.5  # scale *= backoff_factor on a step with inf/nan gradients (step skipped)
    growth_interval: int = 2000  # finite steps in a row before the scale grows again

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
    amax_history_len: int = 16  # delayed scaling: steps of amax history the scale is taken from
    amax_compute_algo: Literal["max", "most_recent"] = "max"  # delayed scaling: the history's max, or its last

    def __post_init__(self):
        _range(self, "margin", ge=0)
        _range(self, "amax_history_len", ge=1)


@dataclass
class FP8Config:
    """FP8 training of eligible nn.Linear layers (GPU with compute capability >= 8.9 only)."""

    enabled: bool = False  # FP8 matmuls on (docs/precision.md: where they pay)
    # torchao: torch.compile-fused casts on plain nn.Linear; te: TransformerEngine's own layers
    backend: Literal["torchao", "te"] = "torchao"
    recipe: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] = "tensorwise"  # torchao recipes
    # Candidates: linears whose name matches an include regex and no exclude regex. By default the
    # language model's decoder layers only: lm_head, the vision tower and the projector stay bf16.
    include: list[str] = field(default_factory=lambda: [r"^model\.language_model\.layers\."])
    exclude: list[str] = field(default_factory=list)  # regexes of linears kept out of FP8 (wins over include)
    # Skip layers too small to gain (torchao's published H100 thresholds per recipe); dims that
    # are not multiples of 16 are always skipped (an FP8 tensor-core requirement).
    skip_small: bool = True
    te: TERecipeConfig = field(default_factory=TERecipeConfig)  # language-model layers
    te_vision: TERecipeConfig = field(default_factory=TERecipeConfig)  # vision-tower layers, if included

    def __post_init__(self):
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
    # casts; the same forward and gradients as fp32 (train/optim.MasterWeightAdamW). auto: optimizer
    # where measured faster (SFT full fine-tuning of a dense model, bf16, AdamW, one CUDA process:
    # ~6% a step, docs/benchmarks.md), else fp32; a resumed run keeps the
    # form its checkpoint was saved in (train/precision.settle_master_weights; config.yaml records it).
    master_weights: Literal["auto", "fp32", "compute", "optimizer"] = "auto"
    # per-module exceptions to `mode` (norms in fp32, say); later entries win
    overrides: list[ModuleOverride] = field(default_factory=list)
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)  # fp16's dynamic loss scaling
    fp8: FP8Config = field(default_factory=FP8Config)  # FP8 matmuls for eligible linears

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
        for o in self.overrides:
            _require(o.compute != "fp16" or self.mode == "fp16",
                     f"precision.overrides: {o.pattern!r} computes in fp16 but precision.mode={self.mode} has no "
                     "loss scaling, so its small gradients would underflow; use bf16 or fp32 there")


@dataclass
class CompileConfig:
    """torch.compile of the training forward's blocks and, with it, CUDA graphs and torch's
    partitioner's activation budget (train/trainable.py). See docs/training.md and docs/precision.md."""

    # torch.compile each decoder layer; auto = on where measured faster (train/trainable.default_compile),
    # and when FP8 (torchao) runs on a GPU, where its casts must be fused to pay off.
    enabled: bool | Literal["auto"] = "auto"
    # With compiled decoder layers: also torch.compile each vision block (its attention one varlen
    # call with model.attention.vision varlen/auto, so no host loop splits the graph); auto = on
    # with compiled decoder layers and the varlen vision attention (measured faster: 2B full SFT)
    vision: bool | Literal["auto"] = "auto"
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
    # Compiled layers only: the fraction (0, 1] of the activations torch's min-cut partitioner may
    # keep for backward; it recomputes the cheapest of the rest (torch's activation memory budget;
    # null = its default, 1: keep what it would). A memory knob finer than whole-layer activation
    # checkpointing, chosen op by op.
    activation_memory_budget: float | None = None

    def __post_init__(self):
        _range(self, "activation_memory_budget", gt=0, le=1, why="a fraction of the activations kept for backward")
        # enabled=true, not auto: auto compiles only measured setups (and GRPO never), which is known only
        # once the model is loaded; a budget must be refused before that, not after minutes of loading
        _require(self.activation_memory_budget is None or self.enabled is True,
                 "compile.activation_memory_budget acts on compiled layers (torch's partitioner): set "
                 "compile.enabled=true, or use activation_checkpointing.enabled / .every")
        _require(self.vision is not True or self.enabled is True,
                 "compile.vision compiles the vision blocks along with the decoder layers: set "
                 "compile.enabled=true too")
        _require(not self.cuda_graphs or self.enabled is True,
                 "compile.cuda_graphs replays the compiled decoder layers as CUDA graphs: set compile.enabled=true")
        _require(not self.cuda_graphs_vision or self.cuda_graphs,
                 "compile.cuda_graphs_vision graphs the vision blocks along with the decoder layers: set "
                 "compile.cuda_graphs=true too")
        _require(not (self.cuda_graphs_vision and self.vision is False),
                 "compile.cuda_graphs_vision replays the compiled vision blocks: set compile.vision auto or true")


@dataclass
class ActivationCheckpointingConfig:
    """Recompute blocks' activations in backward instead of keeping them (train/trainable.py):
    memory for compute. See docs/training.md (memory) and `vlforge doctor --config` for the estimate."""

    # recompute decoder layers and vision blocks in backward: true, false, or auto = chosen before the
    # first step from the run's memory estimate (--plan's, with activations for the run's longest
    # micro-batch) against the GPU's free memory less a margin: nothing, 1 of every N blocks, or every
    # block, the least recomputation that fits; a step that still runs out of memory is redone one notch
    # further (train/recompute.py; one process). Nothing on a CPU. docs/training.md (memory) says why.
    enabled: bool | Literal["auto"] = "auto"
    # Selective checkpointing per block: with enabled=true, recompute 1 of every N decoder layers and
    # vision blocks in backward (1: all of them; 2: every other one, keeping the other half's
    # activations for half the recomputation). auto chooses N itself.
    every: int = 1

    def __post_init__(self):
        _range(self, "every", ge=1, why="1 of every N blocks is recomputed")
        _require(self.every == 1 or self.enabled is True,
                 f"activation_checkpointing.every={self.every} selects the blocks activation checkpointing "
                 f"recomputes: set activation_checkpointing.enabled=true too (enabled={self.enabled}"
                 + (" chooses every itself)" if self.enabled == "auto" else ")"))


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
    weight_decay: float = 0.0  # AdamW's decoupled weight decay (0: none, the usual for LoRA)
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW's moment decay rates (beta1, beta2)
    eps: float = 1e-8  # AdamW's denominator term, keeps steps finite where the second moment is ~0
    schedule: Literal["cosine", "linear", "constant"] = "cosine"  # the lr after warmup, down to min_lr_ratio
    warmup_steps: int = 0  # optimizer steps of linear lr warmup from 0 (Adam's early moments are noisy)
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
    output_dir: str = "runs/sft"  # the run directory: config.yaml, metrics, checkpoints (docs/training.md)
    batch_size: int = 8  # samples per micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step
    max_steps: int | None = None  # optimizer steps; null = epochs * steps per epoch
    epochs: int = 1  # passes over data.train when max_steps is null
    seed: int = 0  # data order, dropout and LoRA initialisation (resume continues the streams exactly)
    device: str = "auto"  # auto | cpu | cuda | cuda:N | mps
    save_every: int = 0  # optimizer steps between checkpoints; 0 = only at the end
    keep_last: int = 2  # checkpoints kept; older ones are deleted once a newer one is written
    resume: Literal["auto", "never"] | str = "never"  # auto | never | path to a checkpoint-STEP dir
    overwrite: bool = False  # start over in an output_dir that holds another run (else refused, to keep it)

    def __post_init__(self):
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
    batch_size: int = 16  # prompts answered together in generation
    max_new_tokens: int = 16  # the answer's length cap (single-turn; GRPO with tools: rollout.max_new_tokens)
    at_start: bool = False  # also evaluate before the first step

    def __post_init__(self):
        _range(self, "every", ge=0)
        for key in ("max_samples", "batch_size", "max_new_tokens"):  # max_samples may be null: all
            _range(self, key, ge=1)


@dataclass
class LogConfig:
    every: int = 1  # optimizer steps between metrics lines (metrics.jsonl and the console)
    tensorboard: bool = False  # also write TensorBoard events to output_dir/tensorboard
    progress: bool = True  # a progress bar on the console (off in tests and piped logs)
    # samples/ in the run directory (train/samples.py, `vlforge view`): GRPO groups every
    # samples_every steps (0: none), samples_per_step of them; samples_eval probes per evaluation;
    # the folder stops growing at samples_max_mb
    samples_every: int = 1
    samples_per_step: int = 2  # GRPO groups written each samples_every steps
    samples_eval: int = 32  # evaluation probes written per evaluation
    samples_max_mb: float = 100.0  # samples/ stops growing at this size
    # trackers (train/trackers.py), rank 0 only: wandb (WANDB_MODE=offline: no network) and MLflow
    # (mlflow_uri, default a SQLite store, output_dir/mlflow.db); project: wandb's project, MLflow's
    # experiment; run_name: default the output directory's name
    wandb: bool = False  # log to Weights & Biases (WANDB_MODE=offline: no network)
    mlflow: bool = False  # log to MLflow (mlflow_uri; default a SQLite store in output_dir)
    project: str = "vlforge"  # wandb's project, MLflow's experiment
    run_name: str | None = None  # the trackers' run name; null: the output directory's name
    mlflow_uri: str | None = None  # MLflow's tracking URI; null: output_dir/mlflow.db

    def __post_init__(self):
        _range(self, "every", ge=1)
        for key in ("samples_every", "samples_per_step", "samples_eval"):
            _range(self, key, ge=0)
        _range(self, "samples_max_mb", ge=0)


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
