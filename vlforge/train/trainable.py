"""A model ready to train, built the same way for every recipe: load, plan, wrap, cast, compile.

    t = setup_model(cfg)
    t.model, t.processor, t.plan, t.policy, t.device

SFT and GRPO both start here (and tests and benchmarks), so the order of the transforms (quantized
load -> LoRA/full plan -> FP8 conversion -> precision policy -> checkpointing -> compile) and the
refusals before any weight is loaded live in one place.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from vlforge.config import CompileConfig, ConfigError, FP8Config, GRPOConfig, ModelConfig, RunConfig
from vlforge.data.encode import record_limits
from vlforge.train.compiled import allow_compiled_variants
from vlforge.train.distributed import World, refuse_unsupported
from vlforge.train.sharding import meta_init, outside_state_dict, wrap
from vlforge.train.fp8 import fp8_backend, fp8_layer_plan, token_multiple
from vlforge.train.hardware import bf16_problem, quant_problem
from vlforge.train.losses import loss_impl_problem
from vlforge.train.moe import Routing
from vlforge.train.optim import MASTERS_NEED_ADAMW, optimizer_problem
from vlforge.train.packed_attention import packing_problem
from vlforge.train.checkpoint import saved_master_weights
from vlforge.train.precision import PrecisionPolicy, settle_master_weights
from vlforge.train.runtime import resolve_device
from vlforge.model.load import build_meta_model, host_dtype, load_model, load_on_host
from vlforge.model.presets import MOE_PRESETS, is_moe
from vlforge.model.quant import format_report, keep_trainable, verify
from vlforge.model.tiers import apply_plan, build_plan, unwrap
from vlforge.model.varlen import use_vision_varlen


@dataclass
class Trainable:
    """A model ready to train: the (possibly peft-wrapped) model, its processor, plan and policy."""

    model: torch.nn.Module
    processor: object
    plan: list
    policy: PrecisionPolicy
    device: torch.device
    fp8_plan: dict = field(default_factory=dict)  # linear name -> fp8.Decision (empty without FP8)
    world: World = field(default_factory=World)  # this process's rank in the run (one process: rank 0 of 1)
    root: torch.nn.Module | None = None  # sharded: the FSDP2 root unit (a train/sharding.Root) the step calls
    routing: Routing | None = None  # MoE: router hooks for the aux loss and expert-load metrics (train/moe.py)
    activation_memory_budget: float | None = None  # compile.activation_memory_budget (compiled layers)
    compiled: tuple[str, ...] = ()  # what torch.compile wraps: "decoder layers", "vision blocks" (compile.enabled*)
    cuda_graphs: bool = False  # compile.cuda_graphs: the compiled decoder layers replay as CUDA graphs
    cuda_graphs_vision: bool = False  # compile.cuda_graphs_vision: the compiled vision blocks too
    vision_shapes: set = field(default_factory=set)  # image layouts the vision graphs were recorded for
    # what activation checkpointing recomputes, settled before the first step (train/recompute.py)
    recompute: object | None = None
    masters_note: str | None = None  # precision.master_weights=auto's choice and why (settle_master_weights)

    def forward(self, fn, *args, **kwargs):
        """`fn(model, *args)`, entered through the FSDP2 root unit when the run is sharded (train/sharding.Root).
        With an activation memory budget the forward runs under it: compiled layers are compiled
        (forward and backward graphs partitioned) at their first forward, which reads it then."""
        with memory_budget(self.activation_memory_budget):
            return self.root(fn, *args, **kwargs) if self.root is not None else fn(self.model, *args, **kwargs)

    @property
    def token_multiple(self) -> int:
        """Pad batches to this many tokens per row: FP8 GEMMs want aligned row counts; CUDA graphs
        are recorded once per row length, so rows then come in steps of CUDA_GRAPH_ROW_MULTIPLE."""
        return max(token_multiple(self.fp8_plan), CUDA_GRAPH_ROW_MULTIPLE if self.cuda_graphs else 1)


# compile.cuda_graphs_vision: after this many different image layouts (patches per image in a
# micro-batch) a run warns that its data's image sizes vary (each records the tower's graphs again)
VISION_SHAPES_WARN = 8

# compile.cuda_graphs: a packed row's length rounded up to this, so that a run's rows come in few
# lengths (each records one graph per layer, forward and backward, kept for the run). At the 2B
# recipe's batch of 8 (~4,300 tokens a row) 256 adds ~3% filler tokens and leaves ~10-20 lengths.
CUDA_GRAPH_ROW_MULTIPLE = 256


def memory_budget(budget: float | None):
    """torch's activation memory budget for what compiles inside (AOTAutograd's min-cut partitioner
    keeps at most this fraction of the activations for backward and recomputes the cheapest of
    the rest). A private torch config (torch._functorch.config), but the knob torch itself
    documents for this; patched per forward, not set process-wide."""
    if budget is None:
        return contextlib.nullcontext()
    import torch._functorch.config as functorch_config

    return functorch_config.patch(activation_memory_budget=budget)


def checkpoint_selected_blocks(model: torch.nn.Module, every: int) -> int:
    """Selective checkpointing: of the blocks transformers checkpoints (each language decoder layer
    and vision block is a GradientCheckpointingLayer, which recomputes while its own
    `gradient_checkpointing` flag is set), keep the flag on 1 of every `every`, the first of each
    group, counted per stack (0: on none). Returns how many blocks are checkpointed. A compiled
    block reads its flag inside its graph: a change recompiles it once (a guard)."""
    core = unwrap(model)
    count = 0
    for blocks in (core.model.language_model.layers, core.model.visual.blocks):
        for i, block in enumerate(blocks):
            block.gradient_checkpointing = bool(every) and i % every == 0
            count += block.gradient_checkpointing
    return count


def compile_decoder_layers(model: torch.nn.Module, vision: bool = False, cuda_graphs: bool = False,
                           cuda_graphs_vision: bool = False) -> int:
    """torch.compile each language-model decoder layer in place (parameter names unchanged), and with
    `vision` each vision block; returns the number compiled. `cuda_graphs` (`cuda_graphs_vision`): the
    decoder layers (the vision blocks) in torch's reduce-overhead mode (CUDA graph trees: each block's
    forward and backward recorded per input shape, then replayed; the caller marks each micro-batch's
    start, `cuda_graph_step_begin`)."""
    core = unwrap(model).model
    allow_compiled_variants()
    for layer in core.language_model.layers:
        layer.compile(mode="reduce-overhead" if cuda_graphs else None)
    for block in core.visual.blocks if vision else []:
        block.compile(mode="reduce-overhead" if cuda_graphs_vision else None)
    return len(core.language_model.layers) + (len(core.visual.blocks) if vision else 0)


def cuda_graph_step_begin(t: Trainable, micro: list[dict], i: int) -> str | None:
    """Before micro-batch `i`'s forward when blocks replay as CUDA graphs: a new generation for the
    graph trees (the last micro-batch's outputs may be overwritten now). With several micro-batches
    a step, the parameters of the graphed blocks the step reaches get their gradient buffers first:
    autograd would otherwise keep the first backward's graph output as `.grad` and the next replay
    would overwrite it (torch's trees then accumulate wrongly: pytorch#169545), while an existing
    buffer is added to in place. (Parameters the step does not reach, the vision blocks on text-only
    micro-batches, keep no gradient, as without graphs.) Returns a warning, once, when the vision
    graphs have met VISION_SHAPES_WARN image layouts."""
    if not t.cuda_graphs:
        return None
    if i == 0 and len(micro) > 1:
        core = unwrap(t.model).model
        vision = t.cuda_graphs_vision and any(b.get("pixel_values") is not None
                                              or b.get("pixel_values_videos") is not None for b in micro)
        for block in [*core.language_model.layers, *(core.visual.blocks if vision else [])]:
            for p in block.parameters():
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
    torch.compiler.cudagraph_mark_step_begin()
    grids = [micro[i][k] for k in ("image_grid_thw", "video_grid_thw") if micro[i].get(k) is not None]
    if not t.cuda_graphs_vision or not grids or len(t.vision_shapes) >= VISION_SHAPES_WARN:
        return None
    # each image's (video's) patches: the tower's shapes and bounds
    t.vision_shapes.add(tuple(tuple(grid.prod(-1).tolist()) for grid in grids))
    if len(t.vision_shapes) < VISION_SHAPES_WARN:
        return None
    return (f"warning: compile.cuda_graphs_vision: the vision tower has met {VISION_SHAPES_WARN} different image "
            "layouts (patches per image) in a micro-batch; each records its CUDA graphs again (a step several "
            "times slower). For data whose image sizes vary, turn compile.cuda_graphs_vision off")


def cuda_graphs_problem(cfg: RunConfig, device: torch.device, strategy: str = "none") -> str | None:
    """Why compile.cuda_graphs cannot run here, from the config and the device (before loading;
    `vlforge doctor --config` asks the same). Graphs are recorded per row length, so the rows must be
    packed (few lengths); the blocks' kernels must run without hooks between them."""
    if not cfg.compile.cuda_graphs:
        return None
    if isinstance(cfg, GRPOConfig):  # its update's rows change length with every rollout, and rollouts run between
        return "compile.cuda_graphs is built for SFT's packed rows, not GRPO's update: turn it off"
    if cfg.data.packing is False:
        return ("compile.cuda_graphs is built for packed rows (few row lengths, each recorded once): set "
                "data.packing=true or auto, or turn compile.cuda_graphs off")
    where = ("device " + str(device) if device.type != "cuda" else f"distributed.strategy={strategy}"
             if strategy != "none" else "quant (QLoRA's 4-bit layers)" if cfg.quant.enabled else
             f"the MoE model {cfg.model.preset} (its router's hooks)" if cfg.model.preset in MOE_PRESETS else None)
    if where:
        return (f"compile.cuda_graphs runs on one CUDA GPU with a dense model's plain layers, not with {where}: "
                "turn compile.cuda_graphs off")
    if cfg.data.packing == "auto" and (problem := packing_problem(device, cfg.model.attention.implementation,
                                                                  cfg.precision.mode)):
        return (f"compile.cuda_graphs is built for packed rows, and data.packing=auto pads here ({problem}): set "
                "data.packing=true, or turn compile.cuda_graphs off")
    return None


def vision_attention_for_training(core, model_cfg: ModelConfig, compile_cfg: CompileConfig, layers_compiled: bool) -> bool:
    """Settle `model.attention.vision: auto` and `compile.vision: auto` for a training run;
    returns whether the vision blocks compile. Measured on one H200 (2B full SFT with compiled decoder
    layers, two calls in opposite orders, docs/benchmarks-log.md, 2026-12-03, "The additive step mask"): compiled vision
    blocks on the one-call varlen attention were the fastest (1.05-1.06x transformers' per-image
    loop), but eager vision blocks trained 4-9% faster on the loop than on the varlen call. So auto
    compiles the blocks where the decoder layers compile, and a trainable tower left eager goes back
    to the loop. Inference keeps varlen (the prefill's tower alone was 1.20x faster on it)."""
    varlen = model_cfg.attention.vision != "sdpa" and use_vision_varlen(core)
    compile_blocks = compile_cfg.vision is True or (compile_cfg.vision == "auto" and layers_compiled and varlen)
    trainable = any(p.requires_grad for block in core.model.visual.blocks for p in block.parameters())
    if model_cfg.attention.vision == "auto" and varlen and trainable and not compile_blocks:
        core.model.visual.config._attn_implementation = "sdpa"
    return compile_blocks


def measured_setup(cfg: RunConfig, strategy: str, moe: bool) -> bool:
    """Whether compiled layers were measured faster for this kind of run (default_compile): a dense
    model on one process without quant, with or without activation checkpointing."""
    return not (cfg.quant.enabled or strategy != "none" or moe)


def default_compile(compile_cfg: CompileConfig, fp8: FP8Config, device: torch.device, measured_setup: bool = True) -> bool:
    """What `compile.enabled` means for a training step: true, false, or auto = compile the
    decoder layers where that was measured faster: on CUDA (one H200, docs/benchmarks.md: 2B full
    1.16x at 8.6 GB less memory, 8B LoRA ~1.2x; torchao FP8 needs it for its casts to fuse), with
    activation checkpointing too (one H100, docs/benchmarks.md, compile: 8B LoRA with every block
    recomputed 1.57x eager's tokens/s), for a `measured_setup` (a dense model on one process without
    quant: compile under FSDP2, QLoRA's 4-bit layers or the MoE router hooks is not measured yet),
    not with TransformerEngine's layers (measured eager only), and not on CPU, where compiling costs
    more than a short run gains. (GRPO passes `compile.enabled is True` instead: its training
    forward's shapes change with every rollout's response lengths.)"""
    if compile_cfg.enabled == "auto":
        if fp8.enabled:  # torchao's casts pay only fused (the rule before any bf16 measurement)
            return fp8.backend == "torchao"
        return device.type == "cuda" and measured_setup
    return bool(compile_cfg.enabled)


def refuse_bad_combinations(cfg: RunConfig, device: torch.device) -> None:
    """Everything that can be refused from the config and the device alone, before loading weights."""
    if cfg.precision.mode == "bf16" and (problem := bf16_problem(device)):
        raise ConfigError(problem)
    if problem := optimizer_problem(cfg.optim, device.type):
        raise ConfigError(problem)
    if cfg.precision.master_weights == "optimizer" and cfg.optim.name != "adamw":
        raise ConfigError(MASTERS_NEED_ADAMW.format(name=cfg.optim.name))
    if problem := loss_impl_problem(cfg.loss, device):  # else it would fail at the first step, after loading
        raise ConfigError(problem)
    if cfg.quant.enabled and (problem := quant_problem(cfg.quant, device)):
        raise ConfigError(problem)


def setup_model(cfg: RunConfig, compile_blocks: bool | None = None, world: World | None = None,
                resume_from: Path | None = None) -> Trainable:
    """Load, plan, wrap and cast the model; shard it over `world` (FSDP2) when the run is
    distributed. `compile_blocks` compiles the decoder layers; None: what `compile.enabled`
    means for a training step (default_compile). `resume_from`: the checkpoint the run resumes,
    whose master-weight form precision.master_weights=auto keeps (settled here into the returned
    policy's config; `cfg` is left as given)."""
    world = world or World(device=resolve_device(cfg.train.device))
    device = world.device
    policy = PrecisionPolicy(cfg.precision, device.type)
    refuse_bad_combinations(cfg, device)
    refuse_unsupported(cfg, world)
    if problem := cuda_graphs_problem(cfg, device, world.strategy):
        raise ConfigError(problem)
    fp8 = fp8_backend(cfg.precision.fp8, device) if cfg.precision.fp8.enabled else None  # fails before loading
    # Full fine-tuning loads straight into the master dtype; LoRA loads the frozen base in the
    # compute dtype (peft creates the adapters in fp32). policy.apply then settles every tensor.
    load_dtype = policy.master_dtype if cfg.tiers.method == "full" else policy.compute_dtype
    # QLoRA: no peft prepare_model_for_kbit_training here, it would upcast every non-quantized
    # weight (the whole vision tower) to fp32; policy.apply below leaves the packed 4-bit weights
    # alone and keeps the rest in their storage dtypes, and non-reentrant checkpointing needs no
    # input that requires grad.
    model, processor, plan, source = _load_planned(cfg, load_dtype, world)
    # auto's masters are fp32 either way, so the load above did not depend on it; the cast below does
    precision, masters = settle_master_weights(cfg, device.type, world.strategy, is_moe(unwrap(model).config),
                                               saved_master_weights(resume_from) if resume_from else None)
    if masters is not None:
        if world.main:
            print(masters)
        refuse_bad_combinations(dataclasses.replace(cfg, precision=precision), device)  # a resumed form, say
        policy = PrecisionPolicy(precision, device.type)
    fp8_plan = {}
    if fp8 is not None:
        fp8_plan = fp8_layer_plan(unwrap(model), cfg.precision.fp8)
        fp8.convert(unwrap(model), fp8_plan)
    policy.apply(model)
    if cfg.activation_checkpointing.enabled is True:  # auto: the recipe decides from its data (train/recompute.py)
        checkpoint_activations(model, cfg.activation_checkpointing.every)
    compiled_parts, cuda_graphs = _compile(model, cfg, device, world, compile_blocks)
    # sharded last: FSDP2 takes the parameters in their storage dtypes (fp32 masters) and gathers
    # them in the compute dtype; `t.model` stays the (peft / HF) model, its parameters now sharded
    root = wrap(model, world, cfg.distributed, policy.compute_dtype, policy.master_dtype, source,
                computes=policy.computes(model))
    del source  # rank 0's host copy of the whole model
    model.train()
    routing = Routing.of(model, cfg.loss.router_aux_loss_coef)
    record_limits(processor, cfg.data)  # its checkpoints are then served at the run's image and video limits
    return Trainable(model, processor, plan, policy, device, fp8_plan, world, root, routing,
                     cfg.compile.activation_memory_budget, compiled_parts, cuda_graphs,
                     cuda_graphs and cfg.compile.cuda_graphs_vision, masters_note=masters)


def _load_planned(cfg: RunConfig, load_dtype: torch.dtype, world: World):
    """(model, processor, plan, source): the model loaded with its trainable plan applied. `source`
    is sharded loading's rank-0 copy of the full weights, which fill every rank's shards in `wrap`
    (None on one process)."""
    if meta_init(cfg.distributed, world):
        return _meta_model(cfg, load_dtype, world)
    plans = []

    def lora(base: nn.Module) -> nn.Module:  # before load_model quantizes any MoE experts (model/quant.py)
        plans.append(build_plan(base, cfg.tiers))
        return apply_plan(base, plans[0])

    model, processor = load_model(cfg.model, dtype=load_dtype, device=world.device, quant=cfg.quant, wrap=lora)
    if cfg.quant.enabled:
        print(format_report(verify(model, cfg.quant)))
        keep_trainable(model)  # evals and rollouts switch to eval mode mid-run
    return model, processor, plans[0], None


def checkpoint_activations(model: nn.Module, every: int) -> None:
    """Non-reentrant activation checkpointing of the decoder layers (every `every`-th with every > 1)."""
    core = unwrap(model)
    if hasattr(core, "activation_checkpointing_enable"):  # the name in transformers >= 5.2x
        core.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        core.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # transformers also hooks the input embeddings to make their output require grad, which only
    # reentrant checkpointing needs. The hook's requires_grad_() is a graph break for dynamo
    # (torch 2.11), inside the compiled rollout decode step, where mark_dynamic then failed.
    core.disable_input_require_grads()
    if every > 1:
        checkpoint_selected_blocks(model, every)


def _compile(model: nn.Module, cfg: RunConfig, device: torch.device, world: World,
             compile_blocks: bool | None) -> tuple[tuple[str, ...], bool]:
    """Compile the decoder layers (and vision blocks), as CUDA graphs where asked: (what is
    compiled, for Trainable.compiled; whether the decoder layers replay as CUDA graphs)."""
    measured = measured_setup(cfg, world.strategy, is_moe(unwrap(model).config))
    compiled = default_compile(cfg.compile, cfg.precision.fp8, device, measured) if compile_blocks is None else compile_blocks
    vision_compiled = vision_attention_for_training(unwrap(model), cfg.model, cfg.compile, compiled)
    cuda_graphs = cfg.compile.cuda_graphs and compiled
    if cfg.compile.cuda_graphs_vision and not vision_compiled:
        raise ConfigError("compile.cuda_graphs_vision replays the compiled vision blocks, and this run compiles "
                          "none (they compile with model.attention.vision varlen/auto on a GPU with "
                          "compile.vision auto/true): turn compile.cuda_graphs_vision off")
    if cfg.compile.cuda_graphs and is_moe(unwrap(model).config):
        raise ConfigError("compile.cuda_graphs is built for dense models: the MoE router's hooks run between a "
                          "layer's kernels; turn compile.cuda_graphs off")
    if compiled:
        compile_decoder_layers(model, vision=vision_compiled, cuda_graphs=cuda_graphs,
                               cuda_graphs_vision=cfg.compile.cuda_graphs_vision)
    elif cfg.compile.activation_memory_budget is not None:  # config requires compile=true: a caller said no
        raise ConfigError("compile.activation_memory_budget acts on compiled layers, and this run compiles none")
    compiled_parts = ("decoder layers", "vision blocks") if compiled and vision_compiled else \
        ("decoder layers",) if compiled else ()
    if cuda_graphs:
        vision_graphs = cfg.compile.cuda_graphs_vision
        compiled_parts = ("decoder layers (CUDA graphs)",
                          *(("vision blocks (CUDA graphs)",) if vision_graphs else compiled_parts[1:]))
    return compiled_parts, cuda_graphs


def _meta_model(cfg: RunConfig, load_dtype: torch.dtype, world: World):
    """(model, processor, plan, source) for sharded loading: the model with its trainable plan
    built on the meta device on every rank, and on rank 0 `source`, the weights a one-process
    run starts from, as (state dict, buffers) in host memory (model.load.host_dtype: a bf16
    checkpoint stays bf16 there under fp32 masters).

    Rank 0 loads the model on the CPU and applies the same plan to it, where peft draws the
    LoRA adapters from the CPU generator as it does on one process (it creates them on the CPU
    whatever the base's device), so they travel with the state dict and every run starts from
    one process's adapters. The meta model's plan runs under fork_rng (peft's meta adapters
    would draw from it too), and rank 0's generator state is then everyone's: each rank leaves
    setup_model with the state a one-process run has."""
    with torch.random.fork_rng(devices=[]):
        model, processor = build_meta_model(cfg.model, dtype=load_dtype, device=world.device)
        plan = build_plan(model, cfg.tiers)
        model = apply_plan(model, plan)
    source = None
    if world.main:
        full = apply_plan(load_on_host(cfg.model, host_dtype(cfg.model, load_dtype, cfg.tiers.method == "full")), plan)
        source = (full.state_dict(), outside_state_dict(full))
    torch.set_rng_state(world.broadcast(torch.get_rng_state()))
    return model, processor, plan, source
