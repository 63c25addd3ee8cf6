"""Several processes, one training run: torchrun's process group, FSDP2 or DDP wrapping, and
the few collectives the recipes need. PyTorch's own machinery throughout (torch.distributed, FSDP2
`fully_shard`, DistributedDataParallel, DCP in train/checkpoint.py); nothing here re-implements
sharding or gradient averaging.

    torchrun --nproc_per_node 8 -m vlforge sft CONFIG          # one process per GPU
    world = init_world(cfg.distributed, cfg.train.device)     # rank 0 of 1 without torchrun
    root = wrap(model, world, cfg.distributed, ...)            # FSDP2 units (decoder layers, vision blocks) | DDP

Two strategies: `fsdp2` shards every parameter, gradient and optimizer state over the ranks
(World.sharded); `ddp` keeps a full replica on every rank and all-reduces gradients
(World.replicated): simpler and faster for models whose full training state fits one GPU, and
plain tensors, so everything that works on one process works there. Either way the recipes'
forward runs through the root module (World.wrapped), whose backward holds collectives every
rank must join. Rank r of N trains on its slice of every global batch (recipes/sft.py); both
average gradients over ranks, so each rank's loss is scaled by N to keep the update of a global
batch the same as one process's.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from vlforge.config import ConfigError, DistributedConfig
from vlforge.train.runtime import resolve_device
from vlforge.model.tiers import unwrap


@dataclass
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    strategy: str = "none"  # none | fsdp2 | ddp (resolved from distributed.strategy)
    device: torch.device = torch.device("cpu")
    owns_group: bool = False  # init_world created the process group (close() ends it)

    @property
    def main(self) -> bool:
        """Rank 0 writes the run's files (metrics, plots, eval.json, checkpoints' metadata)."""
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        """FSDP2: parameters, gradients and optimizer state are DTensor shards; every forward of a
        unit (no-grad ones too: eval, rollouts, reference log-probs) is a collective."""
        return self.strategy == "fsdp2"

    @property
    def replicated(self) -> bool:
        """DDP: every rank holds the whole model as plain tensors; only backward (the gradient
        all-reduce) is a collective, forwards without backward are each rank's own."""
        return self.strategy == "ddp"

    @property
    def wrapped(self) -> bool:
        """The step runs through a wrapper (FSDP2 root or DDP) whose backward every rank must join,
        with every parameter in the graph (text-only batches run the vision keep-alive)."""
        return self.strategy in ("fsdp2", "ddp")

    @functools.cached_property
    def mesh(self):
        """The FSDP2 device mesh: one dimension over every rank, on the device type of train.device.
        fully_shard's default mesh takes torch's current accelerator instead, so on a machine with a
        GPU a run configured for the CPU (gloo) would have its shards put on cuda:0 and meet its CPU
        batches there (found running the CPU tests on an H100 machine)."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(self.device.type, (self.size,))

    @property
    def active(self) -> bool:
        """A process group exists (torchrun, or FSDP2 on one process)."""
        return dist.is_available() and dist.is_initialized()

    def sum(self, value: float) -> float:
        """Sum of a number over all ranks (fp64: token counts and losses add up exactly)."""
        return self.sums(value)[0]

    def sums(self, *values: float) -> list[float]:
        """Each number summed over all ranks, in one all-reduce (one host sync, not one per number)."""
        if not self.active or self.size == 1:
            return [float(v) for v in values]
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self._comm_device)
        dist.all_reduce(t)
        return t.tolist()

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's `t` (equal shapes), concatenated along dim 0 in rank order, on every rank."""
        if not self.active or self.size == 1:
            return t
        local = t.to(self._comm_device)
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local)
        return torch.cat(parts).to(t.device)

    def gather_objects(self, obj) -> list:
        """Every rank's `obj` (picklable, any size: per-rank lists of different lengths), in rank
        order, on every rank."""
        if not self.active or self.size == 1:
            return [obj]
        out = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj):
        """Rank 0's `obj` on every rank."""
        if not self.active or self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.active and self.size > 1:
            dist.barrier()

    def close(self, together: bool = True) -> None:
        """Leave the process group. `together` (a run that ended normally on every rank): wait for
        the peers first; a rank tearing gloo down while a peer still holds its connection can abort
        that peer at exit ("terminate called without an active exception", torch 2.14). After an
        error the peers may never arrive, so a failing run leaves at once."""
        if self.owns_group and self.active:
            if together:
                self.barrier()
            dist.destroy_process_group()

    @property
    def _comm_device(self) -> torch.device:
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")


def torchrun_env() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when started by torchrun, else None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))


def planned_strategy(strategy: str, world_size: int, device_spec: str) -> tuple[str, str | None]:
    """(strategy, problem): distributed.strategy resolved for `world_size` processes, and why the
    run cannot start that way (or None). Pure: `vlforge doctor` and `--plan` ask it too."""
    resolved = strategy if strategy != "auto" else ("fsdp2" if world_size > 1 else "none")
    if world_size > 1 and resolved == "none":
        return resolved, (f"distributed.strategy=none but torchrun started {world_size} processes: use fsdp2 "
                          "or ddp (or run one process)")
    if world_size > 1 and device_spec.startswith("cuda:"):
        return resolved, (f"train.device={device_spec} under torchrun: each process takes the GPU of its "
                          "LOCAL_RANK; use train.device=auto (or cuda)")
    return resolved, None


def gpu_shortage(local_rank: int, local_world_size: int | None, gpu_count: int) -> str | None:
    """Why a torchrun launch on CUDA cannot give each of this machine's processes a GPU of its own
    (process i trains on cuda:i), or None. Asked by every process before anything loads, so that all
    of them stop with this message, not rank 1 alone with torch's "Invalid device id"."""
    started = max(local_world_size or 0, local_rank + 1)
    if started <= gpu_count:
        return None
    return (f"torchrun started {started} processes on this machine but only {gpu_count} GPU(s) are visible, and each "
            f"process trains on a GPU of its own: use torchrun --nproc_per_node {gpu_count} (or fewer), or "
            "train.device=cpu to run the processes on the CPU (gloo)")


def init_world(cfg: DistributedConfig, device_spec: str) -> World:
    """Join torchrun's process group (or make a one-process group for FSDP2 alone). Idempotent."""
    env = torchrun_env()
    rank, size, local_rank = env or (0, 1, 0)
    strategy, problem = planned_strategy(cfg.strategy, size, device_spec)
    if problem:
        raise ConfigError(problem)
    device = resolve_device(device_spec)
    if device.type == "cuda" and size > 1:
        local_size = os.environ.get("LOCAL_WORLD_SIZE")
        if shortage := gpu_shortage(local_rank, int(local_size) if local_size else None, torch.cuda.device_count()):
            raise ConfigError(shortage)
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    owns_group = strategy != "none" and not dist.is_initialized()
    if owns_group:
        # FSDP2 (or DDP) on one process: a group of one on a free local port, given explicitly (setting
        # RANK/WORLD_SIZE in the environment would make later code believe torchrun started it)
        where = {} if env is not None else {"init_method": f"tcp://127.0.0.1:{_free_port()}", "rank": 0,
                                            "world_size": 1}
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                timeout=datetime.timedelta(seconds=cfg.timeout_s), **where)
    return World(rank, size, local_rank, strategy, device, owns_group)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def refuse_unsupported(cfg, world: World) -> None:
    """What does not work sharded yet, refused before the model loads (cfg: a RunConfig). DDP
    refuses nothing here: its parameters are the plain tensors one process trains (fp16's
    GradScaler, precision overrides, FP8 and QLoRA layers, 8-bit AdamW all see what they see there),
    except precision.master_weights=optimizer, whose bf16 gradients DDP would average in bf16."""
    if cfg.precision.master_weights == "optimizer" and world.strategy != "none":
        raise ConfigError(f"precision.master_weights=optimizer runs on one process (distributed.strategy={world.strategy} "
                          "would reduce its bf16 gradients in bf16): use precision.master_weights=fp32 there")
    if not world.sharded:
        return
    why = {
        "precision.fp8.enabled": cfg.precision.fp8.enabled,
        "quant (QLoRA)": cfg.quant.enabled,
        # the loss scaler's inf check on gradient shards in host memory would be reduced over NCCL,
        # which takes CUDA tensors only (gloo, the CPU tests' backend, does; not run on GPUs)
        "precision.mode=fp16 with distributed.cpu_offload": (
            cfg.precision.mode == "fp16" and cfg.distributed.cpu_offload and world.device.type == "cuda"),
    }
    bad = [k for k, v in why.items() if v]
    if bad:
        raise ConfigError(f"distributed.strategy={world.strategy} does not support {', '.join(bad)} yet: "
                          "use distributed.strategy=ddp if the model's training state fits one GPU, train on one "
                          "process (distributed.strategy=none), or turn them off")


def meta_init(cfg: DistributedConfig, world: World) -> bool:
    """Whether this run builds its model on the meta device and fills the shards from rank 0
    (distributed.meta_init; auto: FSDP2 over several processes, or with cpu_offload)."""
    if not world.sharded:
        return False
    return world.size > 1 or cfg.cpu_offload if cfg.meta_init == "auto" else cfg.meta_init


def outside_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a state dict does not carry and `to_empty` leaves uninitialised: every buffer
    (Qwen3-VL's are the text and vision rotary `inv_freq` / `original_inv_freq`, all
    non-persistent) and any tensor kept as a plain module attribute. Small (a few kB)."""
    out = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        for key, value in vars(module).items():
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                out[prefix + key] = value.detach().clone()
        out.update({prefix + key: b.detach().clone() for key, b in module._buffers.items() if b is not None})
    return out


def materialize(root: torch.nn.Module, model: torch.nn.Module, world: World, offload: bool,
                source: tuple[dict, dict] | None) -> None:
    """Fill a model built on the meta device and sharded by fully_shard: allocate each rank's
    shards (`to_empty`; in host memory under cpu_offload), then copy rank 0's full state dict
    into them, one tensor at a time (set_model_state_dict's broadcast_from_rank0; each shard
    converted to its storage dtype), then rank 0's buffers and tensor attributes, on the
    compute device. `source`: rank 0's (state dict, outside_state_dict), None on the others."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    root.to_empty(device=torch.device("cpu") if offload else world.device)
    state, extras = source if source is not None else ({}, {})
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    _set_outside_state(model, world.broadcast(extras), world.device)


def _set_outside_state(model: torch.nn.Module, extras: dict[str, torch.Tensor], device: torch.device) -> None:
    """Put outside_state_dict's tensors (buffers, tensor attributes) into `model`, on `device`."""
    for name, value in extras.items():
        owner, _, key = name.rpartition(".")
        module = model.get_submodule(owner)
        value = value.to(device)
        if key in module._buffers:  # keeps the buffer's persistence
            module._buffers[key] = value
        else:
            setattr(module, key, value)


def wrap(model: torch.nn.Module, world: World, cfg: DistributedConfig, compute_dtype: torch.dtype,
         master_dtype: torch.dtype, source: tuple[dict, dict] | None = None,
         computes: dict[torch.nn.Module, torch.dtype] | None = None) -> torch.nn.Module | None:
    """FSDP2 (fully_shard) or DDP over a model whose parameters are already in their storage dtypes.
    Returns the root (a losses.Root the step calls, wrapped), or None on one process without either.
    A model on the meta device (meta_init, FSDP2 only) is filled once sharded, from rank 0's `source`
    (materialize). `computes`: each module's compute dtype where precision.overrides change it
    (PrecisionPolicy.computes); absent modules compute in `compute_dtype`.

    Units: the language decoder layers and the vision blocks (the memory peaks), `layers_per_unit`
    consecutive ones a unit (one each with several processes), the rest of the vision tower (called on its own by losses.vision_keepalive), and the root, which holds the
    embeddings, final norm and lm_head (tied weights stay one parameter); with precision.overrides,
    also each module an override makes compute in another dtype (_shard_units). Each unit is gathered
    when its forward starts; generation gathers the root explicitly (`gathered`).
    """
    if world.strategy == "none":
        return None
    if world.replicated:
        return _wrap_ddp(model, world)
    from torch.distributed.fsdp import CPUOffloadPolicy

    kwargs = {"reshard_after_forward": cfg.reshard_after_forward, "mesh": world.mesh}
    if cfg.cpu_offload:
        # pinned host memory speeds the copies to a GPU; a CPU run (tests) has none to pin
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=world.device.type == "cuda")
    # The vision tower stays gathered from its forward to its backward: its features join the
    # language model at several layers (deepstack), so a rank with images reaches its backward in
    # the middle of the layers' backward, a text-only rank (vision_keepalive) at the end; gathering
    # again in backward would then put the ranks' collectives out of order. It is small (~0.6B at 32B).
    root = _shard_units(model, kwargs, {**kwargs, "reshard_after_forward": False}, layers_per_unit(cfg, world.size),
                        _GatherPolicy(compute_dtype, master_dtype, world.size), computes or {})
    if any(p.is_meta for p in model.parameters()):
        materialize(root, model, world, cfg.cpu_offload, source)
    _enter_root(root)
    # With reshard_after_forward=false that no-grad forward leaves the root gathered, and a unit
    # gathered outside a backward-tracked forward gets no gradient reduced into its shards: the
    # first step would then leave the embeddings, final norm and lm_head untouched (tested).
    reshard_all(root)
    return root


class _GatherPolicy:
    """A unit's FSDP2 MixedPrecisionPolicy, from the dtype the unit computes in and its own
    parameters' storage dtypes. One policy object per distinct setting."""

    def __init__(self, compute_dtype: torch.dtype, master_dtype: torch.dtype, world_size: int):
        self.compute_dtype, self.master_dtype, self.world_size = compute_dtype, master_dtype, world_size
        self._made: dict = {}

    def __call__(self, dtype: torch.dtype, params: list[torch.nn.Parameter], override: bool = False):
        """`override`: the unit is a module precision.overrides wrapped. Its forward sets its own
        compute dtype (a nested autocast, or autocast off with its inputs upcast), so FSDP2 gathers
        its weights as stored (in fp32 where they mix dtypes: FSDP2 gathers one dtype a unit) and
        leaves its inputs as they come: the module computes as on one process. (Cast to a half
        override's dtype, a bf16 block's output would reach fp32 modules that run without autocast,
        and an fp16 input would meet its bf16 norm weights.)"""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if override:
            param_dtype = torch.float32 if len({p.dtype for p in params}) > 1 else None
        else:
            # bf16 compute with fp32 masters: gather parameters in bf16, reduce gradients in fp32. On
            # one process nothing is summed, so the bf16 gradients are "reduced" as they are and FSDP2
            # casts the result to the fp32 shard: the same values, without the fp32 copy-in of every
            # unit's gradients. A unit whose parameters mix storage dtypes (LoRA's fp32 adapters on a
            # bf16 base) is gathered in its compute dtype; one stored as it computes, as stored.
            widened = dtype == self.compute_dtype and self.master_dtype != self.compute_dtype
            param_dtype = dtype if widened or any(p.dtype != dtype for p in params) else None
        reduce_dtype = torch.float32 if self.world_size > 1 or param_dtype is None else None
        key = (param_dtype, reduce_dtype, not override)
        if key not in self._made:
            self._made[key] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                                                   cast_forward_inputs=not override)
        return self._made[key]


def layers_per_unit(cfg: DistributedConfig, world_size: int) -> int:
    """distributed.layers_per_unit resolved: auto = 4 on one process, 1 with several.

    Measured on one H200 (2B full, eager, one call, docs/benchmarks.md, fourteenth session): FSDP2 on
    one process ran at 0.82x of no sharding with a unit per layer, 0.90x with 2, 0.93x with 4 and
    0.81x with 8 (a unit that large is gathered with too little compute to hide behind, as the whole
    model as one unit measured 0.81x before). What units cost there is FSDP2's host work per unit
    (hooks, copy-in/out, DTensor bookkeeping), which fewer units do less of. With several processes
    a unit per layer (torchtitan's choice) keeps the gathered memory and the overlap per layer."""
    if cfg.layers_per_unit != "auto":
        return int(cfg.layers_per_unit)
    return 4 if world_size == 1 else 1


def _shard_units(model: torch.nn.Module, kwargs: dict, vision: dict, per_unit: int, gather: _GatherPolicy,
                 computes: dict[torch.nn.Module, torch.dtype]) -> torch.nn.Module:
    """fully_shard the vision blocks and the language decoder layers, `per_unit` consecutive ones a
    unit (one FSDP2 state over a list of modules), and the vision tower, then the root
    (losses.Root(model)); `vision`: the vision units' settings. Returns the root, which keeps every
    sharded module's reshard_after_forward in `reshard_settings` (fully_gathered restores them).

    precision.overrides: FSDP2 gathers a unit's parameters in one dtype, and a module computing in
    fp32 (autocast off) needs its weights in fp32. So each module an override makes compute in a
    dtype other than its parent's is a unit of its own, gathered as stored (_GatherPolicy), and a
    group of layers whose members compute differently is split into one unit a layer. A module that
    cannot be a unit of its own (_own_unit_possible: lm_head tied to the embeddings; the language
    model or `model`, which hold other units) leaves its parameters to the unit around it, which is
    then gathered in fp32 where its modules' dtypes differ (autocast still casts each matmul to its
    module's dtype); the units inside it compute as it does. Units are sharded deepest first (FSDP2
    shards bottom-up: a unit takes the parameters no unit inside it has taken)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from vlforge.train.losses import Root

    core = unwrap(model)
    visual = core.model.visual
    blocks, layers = list(visual.blocks), list(core.model.language_model.layers)
    default = gather.compute_dtype
    groups = [(blocks[i:i + per_unit], vision) for i in range(0, len(blocks), per_unit)]
    groups += [(layers[i:i + per_unit], kwargs) for i in range(0, len(layers), per_unit)]
    units = []
    for members, how in groups:
        mixed = len({computes.get(m, default) for m in members}) > 1
        units += [([m], how) for m in members] if mixed else [(members, how)]
    units.append(([visual], vision))
    taken = {m for unit, _ in units for m in unit}
    in_vision = set(visual.modules())
    users: dict[int, set[torch.dtype]] = {}  # parameter -> the compute dtypes of the modules holding it
    for module in model.modules():
        for p in module.parameters(recurse=False):
            users.setdefault(id(p), set()).add(computes.get(module, default))
    names = {m: name for name, m in model.named_modules()}
    for module in names:
        if hasattr(module, "_vlforge_compute") and module not in taken and _own_unit_possible(model, module, taken):
            units.append(([module], vision if module in in_vision else kwargs))
    units.sort(key=lambda unit: -names[unit[0][0]].count("."))  # stable: equal depths keep their order

    def policy(modules: list[torch.nn.Module]):
        own = [p for m in modules for p in m.parameters() if not isinstance(p, DTensor)]  # deeper units took theirs
        trained = sorted({str(p.dtype) for p in own if p.requires_grad})
        if len(trained) > 1:  # FSDP2 shards a unit's trainable weights as one
            raise ConfigError(f"precision.overrides leave the trainable weights of "
                              f"{names.get(modules[0], 'the root')!r} in several dtypes ({', '.join(trained)}), "
                              "which FSDP2 cannot shard as one unit (with master_weights=compute an fp32 override "
                              "on a module that cannot be a unit of its own, e.g. a tied lm_head): use "
                              "precision.master_weights=fp32, drop that override, or distributed.strategy=ddp")
        dtypes = set().union(*(users[id(p)] for p in own)) or {computes.get(modules[0], default)}
        return gather(dtypes.pop() if len(dtypes) == 1 else torch.float32, own,
                      override=hasattr(modules[0], "_vlforge_compute"))

    for unit, how in units:
        fully_shard(unit if len(unit) > 1 else unit[0], **how, mp_policy=policy(unit))
    top = Root(model)
    root = fully_shard(top, **kwargs, mp_policy=policy([top]))
    root.reshard_settings = [(m, how["reshard_after_forward"]) for unit, how in units for m in unit] + \
        [(root, kwargs["reshard_after_forward"])]  # the root last
    return root


def _own_unit_possible(model: torch.nn.Module, module: torch.nn.Module, taken: set) -> bool:
    """Whether an overridden `module` can be an FSDP2 unit of its own: FSDP2 gathers a unit's weights
    when the unit's forward starts, so the module must hold parameters that only its own forward
    uses. Not so for a module sharing a weight with one outside it (lm_head tied to the
    embeddings), nor for one holding other units (the language model, `model`): the embeddings
    inside it run before its forward (HF's model calls them), and generation calls its parts
    directly."""
    inside = set(module.modules())
    if any(m in taken for m in inside if m is not module):
        return False
    mine = {id(p) for p in module.parameters()}
    return bool(mine) and not any(id(p) in mine for other in model.modules() if other not in inside
                                  for p in other.parameters(recurse=False))


def _enter_root(root: torch.nn.Module) -> None:
    # Enter the root once now: FSDP2 initialises its state on the first forward of any unit, and
    # that unit becomes the root; rollouts and keep-alives call inner units first.
    with torch.no_grad():
        root(lambda model: None)


def frozen_sharded_copy(model: torch.nn.Module, empty: torch.nn.Module, world: World, cfg: DistributedConfig,
                        policy) -> torch.nn.Module:
    """A frozen copy of the FSDP2-sharded `model`, sharded the same way, its weights stored as the
    precision `policy` (train/precision.PrecisionPolicy) stores frozen ones (the compute dtype, an
    override's storage) and computing as it says: GRPO's KL reference for full fine-tuning. `empty`:
    the same architecture built on the meta device (model.load.build_meta_model). Returns its root
    (losses.Root: `root(fn, *args)` runs `fn(copy, *args)`, gathering each unit as its forward
    starts and freeing it after).

    Each rank copies its own shards of the policy into the copy's (the same units over the same
    mesh give the same local shards): no rank gathers the full weights, which a deepcopy of the
    sharded model could not give either (FSDP2's hooks and state belong to the original modules)."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    kwargs = {"reshard_after_forward": True, "mesh": world.mesh}  # no backward: each unit is freed after its forward
    if cfg.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=world.device.type == "cuda")
    empty.requires_grad_(False).eval()
    policy.apply(empty)  # frozen: no fp32 master weights
    root = _shard_units(empty, kwargs, kwargs, layers_per_unit(cfg, world.size),
                        _GatherPolicy(policy.compute_dtype, policy.compute_dtype, world.size), policy.computes(empty))
    root.to_empty(device=torch.device("cpu") if cfg.cpu_offload else world.device)
    own = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in empty.named_parameters():
            p.to_local().copy_(own[name].to_local())  # a DTensor shard each; cast to its storage dtype by copy_
    _set_outside_state(empty, outside_state_dict(model), world.device)
    _enter_root(root)
    reshard_all(root)
    return root


def _wrap_ddp(model: torch.nn.Module, world: World) -> torch.nn.Module:
    """DistributedDataParallel over losses.Root(model): the recipes call the backbone and lm_head
    themselves, so the module DDP watches must be the one the step enters (as FSDP2's root).

    - No device_ids: DDP would then move the step's inputs itself, and they are not only tensors
      (the step function, rollouts); the recipes put them on the device already.
    - broadcast_buffers=False: the buffers (rotary frequencies) are constants, identical on every
      rank; broadcasting them would make every forward, no-grad ones included, a collective.
    - Every parameter gets a gradient in every backward (a text-only batch runs the vision
      keep-alive), so DDP need not search the graph for unused ones (find_unused_parameters off).
      Not static_graph: with no_sync in its first step (gradient accumulation) torch's reducer
      fails an internal assert ("expect_autograd_hooks_", torch 2.14, gloo; seen here).
    DDP broadcasts rank 0's parameters when it is built: replicas start identical even where
    initialisation drew random numbers differently."""
    from torch.nn.parallel import DistributedDataParallel

    from vlforge.train.losses import Root

    return DistributedDataParallel(Root(model), broadcast_buffers=False)


def no_sync(root, last: bool):
    """Context for one backward of several that make up a step: DDP reduces gradients only in the
    last (`last`), accumulating locally before; FSDP2 and one process: no change (FSDP2 reduces
    every backward's gradients into its shards, which is what it saves memory by)."""
    if root is not None and not last and hasattr(root, "no_sync"):
        return root.no_sync()
    return contextlib.nullcontext()


def _fsdp(root):
    """The FSDP2 root unit, or None (no wrapper, or DDP: nothing to gather or reshard)."""
    return root if root is not None and hasattr(root, "reshard_settings") else None


def reshard_all(root) -> None:
    """Every unit back to its shards. After a forward without backward (eval, reference log-probs)
    the vision units, which reshard only after their backward, are left gathered; code that then
    changes parameters' attributes (peft's disable_adapter toggles requires_grad) would change
    the gathered copies, not the sharded parameters the optimizer holds."""
    if (root := _fsdp(root)) is not None:
        for unit, _ in root.reshard_settings:
            unit.reshard()


@contextlib.contextmanager
def gathered(root):
    """The root unit's parameters gathered for a forward that does not enter it (generation)."""
    if (root := _fsdp(root)) is None:
        yield
        return
    root.unshard()
    try:
        yield
    finally:
        reshard_all(root)


@contextlib.contextmanager
def fully_gathered(root):
    """Every unit's parameters gathered, in one fixed order on every rank, and kept gathered until
    the block ends: for rollouts, where each rank decodes for as many steps as its own responses
    need, so no forward may issue a collective (the other ranks would not join it)."""
    if (root := _fsdp(root)) is None:
        yield
        return
    for unit, _ in reversed(root.reshard_settings):
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield
    finally:
        for unit, reshard in root.reshard_settings:
            unit.reshard()
            unit.set_reshard_after_forward(reshard, recurse=False)
