"""FSDP2 or DDP around a model: the units (decoder layers, vision blocks) and the root module a
step's forward enters (Root), the vision tower kept alive on ranks without images, materializing a
meta-initialised model's shards, and the gathers and reshards the recipes need. torch's
`fully_shard` and DistributedDataParallel do the work; the process group is train/distributed.py.

    root = wrap(model, world, cfg.distributed, ...)            # FSDP2 units | DDP | the model itself
"""

from __future__ import annotations

import contextlib

import torch

from vlforge.config import ConfigError, DistributedConfig
from vlforge.model.tiers import unwrap


from vlforge.train.distributed import World


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
    Returns the root (a Root the step calls, wrapped), or None on one process without either.
    A model on the meta device (meta_init, FSDP2 only) is filled once sharded, from rank 0's `source`
    (materialize). `computes`: each module's compute dtype where precision.overrides change it
    (PrecisionPolicy.computes); absent modules compute in `compute_dtype`.

    Units: the language decoder layers and the vision blocks (the memory peaks), `layers_per_unit`
    consecutive ones a unit (one each with several processes), the rest of the vision tower (called on its own by train/sharding.vision_keepalive), and the root, which holds the
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

    Measured on one H200 (2B full, eager, one call, docs/benchmarks-log.md, 2026-12-03, "One GEMM for q/k/v"): FSDP2 on
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
    (Root(model)); `vision`: the vision units' settings. Returns the root, which keeps every
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
    (Root: `root(fn, *args)` runs `fn(copy, *args)`, gathering each unit as its forward
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
    """DistributedDataParallel over Root(model): the recipes call the backbone and lm_head
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


def vision_keepalive(model, device: torch.device) -> torch.Tensor:
    """0 x the vision tower's output on one blank image (its smallest grid), with a graph to every
    vision parameter. A rank whose micro-batch has no image runs it: sharded (FSDP2), the vision
    tower's all-gathers and gradient reduce-scatters are collectives every rank must join, so
    skipping the tower on one rank would hang the others. It changes neither the loss nor any
    gradient (its gradients are exact zeros)."""
    visual = unwrap(model).model.visual
    cfg = visual.config
    m = cfg.spatial_merge_size
    pixels = torch.zeros(m * m, cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2, device=device,
                         dtype=next(visual.parameters()).dtype)
    out = visual(pixels, grid_thw=torch.tensor([[1, m, m]], device=device))
    return 0.0 * (out.pooler_output.float().sum() + sum(f.float().sum() for f in out.deepstack_features))


def drop_keepalive_grads(model) -> None:
    """For an optimizer step whose global batch had no image at all: the vision tower's gradients
    are the keep-alive's zeros; None instead, as one process leaves them, so AdamW skips those
    parameters (a zero gradient would still move them by momentum and weight decay)."""
    for p in unwrap(model).model.visual.parameters():
        p.grad = None


class Root(torch.nn.Module):
    """`Root(model)(fn, *args)` is `fn(model, *args)`: a training step's forward as one module.

    Sharded (FSDP2), this is the root unit: the embeddings, final norm and lm_head are gathered
    when its forward starts and their gradients reduced after its backward. The recipes call the
    backbone and lm_head themselves (logits only where labels are; shared image features in GRPO),
    which bypasses the HF model's own forward, so the root must be a module the step does enter.
    """

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, fn, *args, **kwargs):
        return fn(self.model, *args, **kwargs)
