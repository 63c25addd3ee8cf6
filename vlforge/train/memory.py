"""Per-GPU memory of a training run, estimated from a meta-device model: what `--plan` shows.

    model, _ = build_meta_model(cfg.model); plan = build_plan(model, cfg.tiers)
    est = memory_estimate(model, plan, cfg, world_size=8)      # cfg: a RunConfig; pure arithmetic
    print(format_memory(est))

Counted, per process: parameters in their storage dtypes (fp32 masters of what trains, the frozen
rest in the compute dtype, quantized linears at their packed size), gradients of the trainable
parameters (in their own dtype), optimizer state (AdamW: two moments in the parameter's dtype;
8-bit: optim.state_bytes, which FSDP2 changes for tensors whose rows are not whole 8-bit blocks), each tensor split over the processes under FSDP2 (dim 0, padded as
FSDP2 pads it), and the FSDP2 units gathered for compute. With distributed.cpu_offload the
sharded parameters, gradients and optimizer state live in host memory; only the gathered units
stay on the GPU. MoE models count every expert (all are resident, whichever few a token uses),
and expert LoRA as peft builds it (one rank-r pair per expert). Activations (train/activations.py)
for the longest micro-batch the config allows, at each activation checkpointing notch. Not counted:
the one-process path's autocast copies, CUDA/NCCL workspaces and allocator fragmentation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch.nn as nn

from vlforge.train.activations import NOTCHES, activation_estimate, describe, plan_tokens
from vlforge.train.distributed import planned_strategy

from vlforge.train.sharding import layers_per_unit
from vlforge.train.optim import state_bytes
from vlforge.train.precision import NAMES, PrecisionPolicy, linear_only_weights

GB = 1e9  # decimal gigabytes, as GPU datasheets count them (an H200 has 141 GB)

# Bytes per weight element of a quantized linear: nf4 with double quantization (4 bits + an 8-bit
# absmax per 64 values + an fp32 scale per 256 absmaxes), int8 and fp8 (one byte + a scale per row).
QUANT_BYTES = {"nf4": 0.5 + 1 / 64 + 4 / (64 * 256), "int8": 1.0, "fp8": 1.0}


@dataclass(frozen=True)
class _Tensor:
    unit: str  # the FSDP2 unit it is sharded in (train/sharding.wrap's units)
    shape: tuple[int, ...]
    dtype_bytes: float
    trainable: bool
    nf4_experts: bool = False  # a fused expert stack quantized to NF4 (model/quant.quantize_experts)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def shard_numel(self, world_size: int) -> int:
        """Elements one rank holds: FSDP2 splits dim 0 into world_size equal chunks, the last padded."""
        if not self.shape:
            return 1
        return -(-self.shape[0] // world_size) * math.prod(self.shape[1:])


def _unit(name: str) -> str:
    """The FSDP2 unit of parameter/module `name`, as train/sharding.wrap builds them."""
    parts = name.split(".")
    if name.startswith("model.visual.blocks.") and len(parts) > 3:
        return f"vision block {parts[3]}"
    if name.startswith("model.language_model.layers.") and len(parts) > 3:
        return f"layer {parts[3]}"
    if name.startswith("model.visual."):
        return "vision rest"
    return "root"


def _under(module: str, roots: list[str]) -> bool:
    """`module` is one of `roots` or inside one (a fully trained tier's module)."""
    return any(module == r or module.startswith(r + ".") for r in roots)


def _tensors(model: nn.Module, plan: list, cfg) -> list[_Tensor]:
    """Every parameter of the trained model (LoRA adapters included) with its storage dtype."""
    from vlforge.model.quant import expert_plan, quant_plan
    from vlforge.model.tiers import expert_shape

    policy = PrecisionPolicy(cfg.precision, "cpu")
    full_roots = [e.module for e in plan if e.kind == "full"]
    quantized = {n: m for n, m in quant_plan(model, cfg.quant).items() if m != "none"} if cfg.quant.enabled else {}
    experts = {n: m for n, m in expert_plan(model, cfg.quant).items() if m != "none"}  # NF4-parametrized stacks
    out = []
    for name, p in model.named_parameters():  # tied weights once, as named_parameters gives them
        module = name.rpartition(".")[0]
        trainable = _under(module, full_roots)
        if module in quantized and name.endswith(".weight"):
            size = QUANT_BYTES[quantized[module]]
        elif name in experts:
            size = QUANT_BYTES[experts[name]]
        else:
            size = policy.param_dtype(module, trainable).itemsize
        out.append(_Tensor(_unit(name), tuple(p.shape), size, trainable, nf4_experts=name in experts))
    master = policy.master_dtype.itemsize
    for e in plan:  # LoRA: A (r x in) and B (out x r) per adapted linear, in the master dtype
        if e.kind != "lora":
            continue
        unit = _unit(e.module)
        if e.target == "parameter":  # fused MoE experts: peft's A (r*E x in), B (out x r*E)
            experts, fan_in, fan_out = expert_shape(model.get_parameter(e.module))
            out += [_Tensor(unit, (e.r * experts, fan_in), master, True),
                    _Tensor(unit, (fan_out, e.r * experts), master, True)]
            continue
        linear = model.get_submodule(e.module)
        out += [_Tensor(unit, (e.r, linear.in_features), master, True),
                _Tensor(unit, (linear.out_features, e.r), master, True)]
    # not counted: a router trained beside LoRA is a peft copy (modules_to_save) next to its frozen
    # original, E x H values per layer (0.26M for 30B-A3B)
    return out


def _layout(tensors: list[_Tensor], world_size: int, sharded: bool, offload: bool, optim: str,
            compute_bytes: int, reshard_after_forward: bool, layers_per_unit: int) -> dict:
    """Bytes per part on the GPU and in host memory, for one layout."""

    def held(t: _Tensor) -> int:
        return t.shard_numel(world_size) if sharded else t.numel

    trainable = [t for t in tensors if t.trainable]
    params = sum(held(t) * t.dtype_bytes for t in tensors)
    grads = sum(held(t) * t.dtype_bytes for t in trainable)
    # 8-bit: bitsandbytes' blocks per tensor, or per row of each shard under FSDP2 (optim.sharded_8bit)
    state = sum(state_bytes(held(t), optim, t.shape if sharded else None) if optim != "adamw"
                else 2 * held(t) * t.dtype_bytes for t in trainable)
    gathered = 0.0
    if sharded:
        # units gathered at once in the compute dtype: the root (all forward and backward), the
        # vision tower (kept gathered from its forward to its backward), and the decoder layers:
        # the running unit of layers_per_unit layers and the prefetched next, or all of them without
        # reshard_after_forward
        units: dict[str, int] = {}
        for t in tensors:
            units[t.unit] = units.get(t.unit, 0) + t.numel
        per_layer = [units[k] for k in sorted((k for k in units if k.startswith("layer ")), key=lambda k: int(k[6:]))]
        layers = sorted((sum(per_layer[i:i + layers_per_unit]) for i in range(0, len(per_layer), layers_per_unit)),
                        reverse=True)
        always = sum(v for k, v in units.items() if not k.startswith("layer "))
        gathered = (always + sum(layers if not reshard_after_forward else layers[:2])) * compute_bytes
    where = "host" if offload else "gpu"
    parts = {"parameters": params, "gradients": grads, "optimizer_state": state}
    out = {k: {"gpu": 0.0, "host": 0.0} for k in (*parts, "gathered")}
    for k, v in parts.items():
        out[k][where] = v
    out["gathered"]["gpu"] = gathered
    out["total"] = {w: sum(out[k][w] for k in (*parts, "gathered")) for w in ("gpu", "host")}
    return out


def memory_estimate(model: nn.Module, plan: list, cfg, world_size: int = 1) -> dict:
    """Per-process memory of `cfg` (a RunConfig) on `world_size` processes, in bytes.

    `model`: the plain (meta-device) model, `plan`: its tier plan. Returns the resolved strategy,
    the counts, and two layouts: "no_offload" (what cfg.distributed does without cpu_offload) and
    "cpu_offload" (FSDP2 with CPUOffloadPolicy at this world size); "selected" names the one the
    config runs. JSON-able.
    """
    d = cfg.distributed
    strategy, problem = planned_strategy(d.strategy, world_size, cfg.train.device)
    tensors = _tensors(model, plan, cfg)
    policy = PrecisionPolicy(cfg.precision, "cpu")
    compute = policy.compute_dtype.itemsize
    common = dict(world_size=world_size, optim=cfg.optim.name, compute_bytes=compute,
                  reshard_after_forward=d.reshard_after_forward, layers_per_unit=layers_per_unit(d, world_size))
    sharded = strategy == "fsdp2"
    offload_applies = d.cpu_offload and sharded  # auto on one process resolves to none: no offload
    not_estimated = "autocast copies, CUDA/NCCL workspaces, allocator fragmentation"

    rollout_copies = 0.0
    if hasattr(cfg, "rollout"):  # GRPO
        not_estimated += ", the rollout KV cache"
        rollout_copies = rollout_weight_copies(model, plan, cfg, sharded)
        if cfg.tiers.method == "full" and cfg.rl.kl_beta > 0:
            not_estimated += ", the frozen reference copy (full fine-tuning with rl.kl_beta > 0)"
    return {
        "world_size": world_size,
        "strategy": strategy,
        "layers_per_unit": layers_per_unit(d, world_size),
        "problem": problem,
        "optimizer": cfg.optim.name,
        # in the optimizer: the same bytes as fp32 parameters (bf16 copy + fp32 master = fp32 + its
        # autocast cast; bf16 gradients), counted there as fp32 parameters and gradients
        "master_weights": NAMES[policy.master_dtype] + (" (in the optimizer)" if policy.masters_in_optimizer else ""),
        "compute": NAMES[policy.compute_dtype],
        "params": sum(t.numel for t in tensors),
        "trainable_params": sum(t.numel for t in tensors if t.trainable),
        "load": _load(tensors, cfg, world_size, strategy),
        "selected": "cpu_offload" if offload_applies else "no_offload",
        "no_offload": _layout(tensors, sharded=sharded, offload=False, **common),
        "cpu_offload": _layout(tensors, sharded=True, offload=True, **common),
        "expert_lora_copies": expert_lora_copies(model, plan, cfg, compute),
        "nf4_expert_copies": nf4_expert_copies(model, cfg, compute),
        "rollout_weight_copies": rollout_copies,
        "held_gradient_sums": held_gradient_sums(model, plan, cfg),
        "fsdp2_problem": fsdp2_problem(cfg, world_size),
        # the longest micro-batch the config allows (a run counts its data's): one row per notch
        "activations": [activation_estimate(model.config, cfg, plan_tokens(cfg), every) for every in NOTCHES],
        "not_estimated": not_estimated,
    }


def gpu_total(est: dict) -> float:
    """GPU bytes per process of memory_estimate's `est` without activations: the selected layout's
    total and the copies counted beside it."""
    return est[est["selected"]]["total"]["gpu"] + sum(
        est.get(k) or 0.0 for k in ("expert_lora_copies", "nf4_expert_copies", "rollout_weight_copies",
                                    "held_gradient_sums"))


def _load(tensors: list[_Tensor], cfg, world_size: int, strategy: str) -> dict:
    """Memory while the model loads, before training starts. The model is first read in its load
    dtype (train/trainable.setup_model: full fine-tuning in the master dtype, every weight; LoRA
    the base in the compute dtype, peft's adapters in fp32), then cast to the storage dtypes.
    Sharded loading (distributed.meta_init): rank 0 holds that whole model in host memory (full
    fine-tuning of a narrower checkpoint: as stored, model.load.host_dtype), and each GPU its
    shards plus one whole tensor at a time (the one being sent out). Otherwise each process
    holds the whole model on its device first."""
    from vlforge.train.distributed import World
    from vlforge.train.sharding import meta_init
    from vlforge.model.load import host_dtype

    policy = PrecisionPolicy(cfg.precision, "cpu")
    load = policy.master_dtype if cfg.tiers.method == "full" else policy.compute_dtype
    base = [t for t in tensors if not (cfg.tiers.method == "lora" and t.trainable)]
    adapters = [t for t in tensors if cfg.tiers.method == "lora" and t.trainable]
    whole = sum(t.numel for t in base) * load.itemsize + sum(t.numel for t in adapters) * 4
    if cfg.quant.enabled:  # QLoRA reads the weights straight into their packed form
        whole = sum(t.numel * t.dtype_bytes for t in base) + sum(t.numel for t in adapters) * 4
        experts = [t for t in base if t.nf4_experts]
        if experts:  # staged (model/load.py): all in host memory first, then one bf16 expert stack at a time
            return {"meta_init": False, "staged_experts": True,
                    "gpu": whole + max(t.numel for t in experts) * load.itemsize,
                    "host_rank0": sum(t.numel for t in base) * load.itemsize + sum(t.numel for t in adapters) * 4}
    sharded = meta_init(cfg.distributed, World(size=world_size, strategy=strategy))
    if not sharded:
        return {"meta_init": False, "gpu": whole, "host_rank0": 0.0}
    host = host_dtype(cfg.model, load, cfg.tiers.method == "full").itemsize  # a bf16 checkpoint's own dtype
    offload = cfg.distributed.cpu_offload
    shards = 0 if offload else sum(t.shard_numel(world_size) * t.dtype_bytes for t in tensors)
    largest = max([t.numel * host for t in base] + [t.numel * 4 for t in adapters])
    return {"meta_init": True, "gpu": shards + largest,
            "host_rank0": sum(t.numel for t in base) * host + sum(t.numel for t in adapters) * 4}


def expert_lora_copies(model: nn.Module, plan: list, cfg, compute_bytes: int) -> float:
    """GPU bytes of the expert weights peft folds LoRA into: each forward adds the update to a
    full copy of a layer's fused experts (ParamWrapper's baddbmm), which the expert GEMM keeps for
    backward: every MoE layer's copy at once, or one layer's under gradient checkpointing (the
    recomputation folds again). 0 without expert LoRA, or with it fused (model/moe_lora.py: no copy)."""
    per_layer: dict[str, int] = {}
    for e in plan:
        if e.kind == "lora" and e.target == "parameter" and e.expert_lora != "fused":
            per_layer[_unit(e.module)] = per_layer.get(_unit(e.module), 0) + model.get_parameter(e.module).numel()
    return _held_for_backward(per_layer, cfg, compute_bytes)


def nf4_expert_copies(model: nn.Module, cfg, compute_bytes: int) -> float:
    """GPU bytes of dequantized NF4 expert stacks (model/quant.quantize_experts) held for backward
    under `model.experts_implementation=eager`: transformers' reference loop keeps each expert's
    dequantized weight for its input's gradient (every MoE layer's without gradient checkpointing,
    one recomputed layer's with it). The grouped and batched kernels (auto: grouped_mm on a GPU)
    dequantize again in backward instead (model/moe_lora._Redequantized): 0, as without NF4 experts."""
    from vlforge.model.quant import expert_plan

    if cfg.model.experts_implementation != "eager":
        return 0.0
    per_layer: dict[str, int] = {}
    for name, method in expert_plan(model, cfg.quant).items():
        if method != "none":
            per_layer[_unit(name)] = per_layer.get(_unit(name), 0) + model.get_parameter(name).numel()
    return _held_for_backward(per_layer, cfg, compute_bytes)


def _held_for_backward(per_layer: dict[str, int], cfg, compute_bytes: int) -> float:
    """Bytes of per-layer tensors a layer's forward keeps for its backward: all layers' at once, or
    under gradient checkpointing the kept layers' and one recomputed layer's at a time."""
    if not per_layer:
        return 0.0
    if cfg.activation_checkpointing.enabled is not True:  # auto: as without, the most it can take
        return float(sum(per_layer.values()) * compute_bytes)
    # recomputed layers (1 of every activation_checkpointing.every: train/trainable.checkpoint_selected_blocks) hold
    # one copy at a time, in backward; the others keep theirs from forward to backward
    every = cfg.activation_checkpointing.every
    recomputed = [n for unit, n in per_layer.items() if int(unit.split()[-1]) % every == 0]
    kept = [n for unit, n in per_layer.items() if int(unit.split()[-1]) % every != 0]
    return float((sum(kept) + max(recomputed, default=0)) * compute_bytes)


def held_gradient_sums(model: nn.Module, plan: list, cfg) -> float:
    """precision.master_weights=optimizer with gradient accumulation: bytes of the fp32 buffers in
    which MasterWeightAdamW sums the bf16 working weights' gradients over a step's micro-batches (4 a
    weight beside their bf16 gradients; allocated at the first accumulation and kept). SFT with
    train.grad_accum > 1; GRPO always (a mini-batch spanning rollout rounds is several backward
    passes). The full tiers' weights PrecisionPolicy._working_copies picks (LoRA's adapters, a few
    MB, left out)."""
    policy = PrecisionPolicy(cfg.precision, "cpu")
    if not policy.masters_in_optimizer or not (hasattr(cfg, "rollout") or cfg.train.grad_accum > 1):
        return 0.0
    full_roots = [e.module for e in plan if e.kind == "full"]
    linear_only = linear_only_weights(model, policy)
    return float(4 * sum(p.numel() for name, p in model.named_parameters()
                         if p in linear_only and _under(name.rpartition(".")[0], full_roots)))


def rollout_weight_copies(model: nn.Module, plan: list, cfg, sharded: bool) -> float:
    """GRPO: bytes of the compute-dtype copies of master-dtype linear weights that rollouts decode
    from (PrecisionPolicy.inference_weights; kept across steps so the decode graphs stay valid).
    None with compute-dtype masters, and none under FSDP2, whose gathers are in the compute dtype
    (masters in the optimizer: copies of the bf16 trained weights, which the engine may fuse).
    The same selection as inference_weights: weights used only by exact nn.Linear layers computing in
    the compute dtype (not FP8's converted linears, not fp32-compute overrides), LoRA's A and B
    (peft's nn.Linear layers, the fused experts' too) included."""
    from vlforge.train.fp8 import fp8_layer_plan
    from vlforge.model.tiers import expert_shape

    policy = PrecisionPolicy(cfg.precision, "cpu")
    if sharded or policy.master_dtype == policy.compute_dtype:
        return 0.0
    fp8 = fp8_layer_plan(model, cfg.precision.fp8) if cfg.precision.fp8.enabled else {}
    converted = {name for name, d in fp8.items() if d.convert}
    full_roots = [e.module for e in plan if e.kind == "full"]
    linear_only = linear_only_weights(model, policy)
    copied = 0
    for name, p in model.named_parameters():
        module = name.rpartition(".")[0]
        if (p in linear_only and module not in converted and p.is_floating_point()
                and policy.param_dtype(module, _under(module, full_roots)) == policy.master_dtype):
            copied += p.numel()
    for e in plan:  # the adapters (peft names them <module>.lora_A.default; an override may match them)
        if e.kind != "lora" or policy.module_compute(f"{e.module}.lora_A.default") != policy.compute_dtype:
            continue
        if e.target == "parameter":  # fused MoE experts: A (r*E x in), B (out x r*E)
            experts, fan_in, fan_out = expert_shape(model.get_parameter(e.module))
            copied += e.r * experts * (fan_in + fan_out)
        else:
            linear = model.get_submodule(e.module)
            copied += e.r * (linear.in_features + linear.out_features)
    return float(copied * policy.compute_dtype.itemsize)


def fsdp2_problem(cfg, world_size: int) -> str | None:
    """Why the run would refuse `cfg` under FSDP2 (and so cpu_offload), or None: the refusals
    train/distributed.refuse_unsupported raises before loading."""
    from vlforge.config import ConfigError
    from vlforge.train.distributed import World, refuse_unsupported

    try:
        refuse_unsupported(cfg, World(size=world_size, strategy="fsdp2"))
    except ConfigError as e:
        return str(e)
    return None


def _gb(value: float) -> str:
    if not value:
        return "-"
    for unit, size in (("GB", GB), ("MB", 1e6), ("kB", 1e3)):
        if value >= size / 10:
            return f"{value / size:.1f} {unit}"
    return f"{value:.0f} B"


def format_memory(est: dict) -> str:
    n, strategy = est["world_size"], est["strategy"]
    per_unit = est["layers_per_unit"]
    how = {"fsdp2": f"FSDP2 over {n} process(es), every tensor split {n} ways, "
                    f"{per_unit} decoder layer{'s' if per_unit > 1 else ''} (and vision blocks) a unit",
           "ddp": f"DDP over {n} process(es), every one holding everything"}.get(strategy, "one process, no sharding")
    lines = [f"memory per process: {how}; {est['optimizer']}, master weights {est['master_weights']}, "
             f"compute {est['compute']} (GB = 1e9 bytes)"]
    rows = [("", "no offload GPU", "host", "cpu_offload GPU", "host")]
    labels = {"parameters": "parameters", "gradients": "gradients", "optimizer_state": "optimizer state",
              "gathered": "gathered units (FSDP2)", "total": "total"}
    for key, label in labels.items():
        a, b = est["no_offload"][key], est["cpu_offload"][key]
        rows.append((label, _gb(a["gpu"]), _gb(a["host"]), _gb(b["gpu"]), _gb(b["host"])))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines += ["  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
              for r in rows]
    chosen = "cpu_offload" if est["selected"] == "cpu_offload" else "no offload"
    lines.append(f"this config: {chosen}" + ("" if strategy == "fsdp2" else
                                             " (cpu_offload needs distributed.strategy=fsdp2)"))
    load = est["load"]
    if load["meta_init"]:
        lines.append(f"loading (meta_init): rank 0 reads the whole model into host memory, {_gb(load['host_rank0'])}; "
                     f"each GPU holds only its shards and one whole tensor at a time, {_gb(load['gpu'])}")
    elif load.get("staged_experts"):
        lines.append(f"loading (NF4 experts): the whole model in host memory first, {_gb(load['host_rank0'])} (a "
                     f"checkpoint in the load dtype: memory-mapped file pages); the GPU gets it quantized, one bf16 "
                     f"expert stack at a time, {_gb(load['gpu'])}")
    else:
        lines.append(f"loading: each process first holds the whole model, {_gb(load['gpu'])}"
                     + (" (distributed.meta_init=true: only rank 0, in host memory)" if strategy == "fsdp2" else ""))
    if est.get("nf4_expert_copies"):
        lines.append(f"NF4 experts: + {_gb(est['nf4_expert_copies'])} of dequantized expert stacks held for backward "
                     "by model.experts_implementation=eager (grouped_mm dequantizes again in backward instead)")
    if est.get("expert_lora_copies"):
        lines.append(f"expert LoRA: + {_gb(est['expert_lora_copies'])} of folded expert weights held for backward "
                     "(peft adds the update to a copy of each layer's experts; gradient checkpointing keeps one layer's)")
    if est.get("held_gradient_sums"):
        lines.append(f"gradient accumulation: + {_gb(est['held_gradient_sums'])} of fp32 sums of the bf16 working "
                     "weights' gradients, summed across a step's micro-batches (master_weights=optimizer; "
                     "allocated once, kept for the run)")
    if est.get("rollout_weight_copies"):
        lines.append(f"GRPO rollouts: + {_gb(est['rollout_weight_copies'])} of {est['compute']} copies of the "
                     f"{est['master_weights']} linear weights, decoded from and kept across steps")
    acts = est.get("activations") or []
    if acts:
        lines.append(f"activations of a {acts[0]['tokens']:,}-token micro-batch (the longest the config allows; "
                     "eager, compiled layers keep less): " + ", ".join(
                         f"{describe(a['every'])} {_gb(a['total'])}" for a in acts)
                     + f"; with the above, {_gb(gpu_total(est) + acts[0]['total'])} to "
                     f"{_gb(gpu_total(est) + acts[-1]['total'])} (activation_checkpointing.enabled=auto picks from these)")
    lines.append(f"not estimated: {est['not_estimated']}")
    if est["fsdp2_problem"]:
        lines.append(f"FSDP2 columns (and cpu_offload) do not apply, the run refuses them: {est['fsdp2_problem']}")
    if est["problem"]:
        lines.append(f"error: {est['problem']}")
    return "\n".join(lines)
