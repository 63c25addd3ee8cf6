"""AdamW (torch fp32, bitsandbytes 8-bit, or over fp32 masters of bf16 working weights) over per-tier
param groups, and the warmup + decay learning-rate schedule."""

from __future__ import annotations

import functools
import importlib.util
import math
import sys
from itertools import chain

import torch

from vlforge.config import ConfigError, OptimConfig

# bitsandbytes' 8-bit optimizers keep a tensor's moments in uint8 only from this many elements
# (its `min_8bit_size` default); smaller tensors (biases, norms) keep fp32 moments.
MIN_8BIT_SIZE = 4096
BLOCK = 256  # values per fp32 absmax scale in bitsandbytes' blockwise 8-bit state


MASTERS_NEED_ADAMW = ("precision.master_weights=optimizer keeps fp32 masters in AdamW's update (MasterWeightAdamW); "
                      "optim.name={name} has its own state: use optim.name=adamw or precision.master_weights=fp32")


def lr_factor(step: int, total: int, warmup: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of each group's peak lr at optimizer step `step` (0-based). Pure; tested."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "linear":
        decay = 1.0 - progress
    else:
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_ratio + (1.0 - min_ratio) * decay


def optimizer_problem(cfg: OptimConfig, device_type: str) -> str | None:
    """Why `cfg.name` cannot run here (None: it can). Pure; called before any model loads. FSDP2
    makes no difference: the 8-bit AdamW then updates each rank's shards (sharded_8bit)."""
    if cfg.name == "adamw":
        return None
    if cfg.name == "paged_adamw8bit" and device_type != "cuda":
        return (f"optim.name=paged_adamw8bit pages optimizer state between GPU and host memory, which needs "
                f"CUDA; this run is on {device_type}: use optim.name=adamw8bit (or adamw)")
    if device_type not in ("cuda", "cpu"):
        return (f"optim.name={cfg.name}: bitsandbytes has no 8-bit optimizer kernels for {device_type}; "
                "use optim.name=adamw")
    if importlib.util.find_spec("bitsandbytes") is None:
        return f"optim.name={cfg.name} needs bitsandbytes: pip install 'vlforge[quant]' (or use optim.name=adamw)"
    return None


def eight_bit_rows(shape: tuple[int, ...]) -> bool:
    """Whether an FSDP2-sharded tensor of `shape` gets 8-bit moments (sharded_8bit): 4096 values or
    more, in dim-0 rows of whole 256-value blocks, so that no block crosses from one rank's rows
    into the next's."""
    numel = math.prod(shape)
    return len(shape) >= 2 and numel >= MIN_8BIT_SIZE and (numel // shape[0]) % BLOCK == 0


def state_bytes(numel: int, name: str, shard_of: tuple[int, ...] | None = None) -> int:
    """Bytes of optimizer state `numel` values of one parameter tensor get (the step count aside).
    `shard_of`: the whole tensor's shape when they are FSDP2 shards of it (where the 8-bit state
    follows eight_bit_rows); None: an unsharded tensor of `numel` values."""
    eight_bit = name != "adamw" and (numel >= MIN_8BIT_SIZE if shard_of is None else eight_bit_rows(shard_of))
    if not eight_bit:
        return 8 * numel  # two fp32 moments
    return 2 * numel + 2 * 4 * -(-numel // BLOCK)  # two uint8 moments + their fp32 block scales


class ShardLocalAdamW(torch.optim.AdamW):
    """torch's AdamW whose update runs on the local shards of FSDP2's DTensor parameters.

    AdamW is elementwise, so updating each rank's shard alone is the same update. Through DTensor,
    the fused (or foreach) kernel's list arguments pay DTensor's sharding propagation on the host
    for every parameter at every step (pytorch/pytorch#134191: AdamW CPU-bound under FSDP2), which
    the library offers no switch to skip. The state (moments, step) is created by AdamW itself, so
    it stays DTensors: checkpoints (DCP) and resharding to another world size see the usual
    optimizer. Plain tensors pass through unchanged."""

    def _init_group(self, group, params, grads, *state_lists):  # torch's hook that lists a group's tensors
        from torch.distributed.tensor import DTensor

        has_complex = super()._init_group(group, params, grads, *state_lists)
        for tensors in (params, grads, *state_lists):
            # _local_tensor, not to_local(): a view of the shard's storage, so in-place updates reach
            # the parameter, and no autograd op per tensor (~20 us each)
            tensors[:] = [t._local_tensor if isinstance(t, DTensor) else t for t in tensors]
        return has_complex


def build_optimizer(groups: list[dict], cfg: OptimConfig, device_type: str,
                    masters: dict | None = None) -> torch.optim.Optimizer:
    """One optimizer over `groups` (tiers.param_groups: each group's own lr and weight_decay).
    `masters`: the fp32 values of parameters the model computes with in bf16
    (precision.master_weights=optimizer: PrecisionPolicy.take_masters), which MasterWeightAdamW keeps."""
    if masters is not None:
        if cfg.name != "adamw":  # refused before loading too (train/trainable.refuse_bad_combinations)
            raise ConfigError(MASTERS_NEED_ADAMW.format(name=cfg.name))
        return MasterWeightAdamW(groups, masters, betas=cfg.betas, eps=cfg.eps, compiled=device_type == "cuda")
    if cfg.name == "adamw":
        # fused AdamW on CUDA: one kernel for all params (the peer baseline uses it too).
        fused = device_type == "cuda"
        return ShardLocalAdamW(groups, betas=cfg.betas, eps=cfg.eps, fused=fused)  # lr: per tier group
    if problem := optimizer_problem(cfg, device_type):
        raise ConfigError(problem)
    import bitsandbytes as bnb
    from torch.distributed.tensor import DTensor

    cls = bnb.optim.PagedAdamW8bit if cfg.name == "paged_adamw8bit" else bnb.optim.AdamW8bit
    if any(isinstance(p, DTensor) for g in groups for p in g["params"]):
        cls = sharded_8bit(cls)
    # min_8bit_size stated so state_bytes stays true; lr and weight_decay: per tier group
    return cls(groups, betas=cfg.betas, eps=cfg.eps, min_8bit_size=MIN_8BIT_SIZE)


@functools.cache
def sharded_8bit(base: type) -> type:
    """bitsandbytes' 8-bit AdamW (`base`: AdamW8bit or PagedAdamW8bit) on FSDP2's DTensor parameters.

    bitsandbytes (0.50) cannot step DTensors: its update kernel is a custom op with no DTensor rule
    ("got mixed torch.Tensor and DTensor"). AdamW is elementwise, so each rank updates its own shard
    (the parameter's local tensor, as ShardLocalAdamW does) with bitsandbytes' own update, and the
    state lives per shard. What bitsandbytes does not offer is state that DCP can save and reshard:
    its 256-value blocks run over the flat tensor, and a rank's block scales are not a slice of
    anything global. So here the blocks follow rows (eight_bit_rows): a tensor whose rows are whole
    blocks quantizes as it does on one process on any number of ranks, and its state is saved as
    DTensors sharded like the parameter (the codes shaped as it, the scales as rows x blocks-per-row):
    exact on resume, and resharded by DCP onto another world size. The few tensors whose rows are
    not whole blocks (norms, biases, the 1152-wide vision tower of the 8B/32B models, LoRA's B)
    keep fp32 moments, like bitsandbytes' tensors under 4096 values. Plain tensors pass through."""
    name = f"Sharded{base.__name__}"
    return type(name, (_ShardLocal8bit, base), {"__module__": __name__, "__qualname__": name})


class _ShardLocal8bit:
    """The DTensor half of sharded_8bit's classes (placed before bitsandbytes' optimizer in their
    bases, so `super()` is bitsandbytes): a DTensor parameter's state is its local shard's."""

    @torch.no_grad()
    def init_state(self, group, p, gindex, pindex):
        from torch.distributed.tensor import DTensor

        if not isinstance(p, DTensor):
            return super().init_state(group, p, gindex, pindex)
        local = p._local_tensor
        state = self.state[p]
        state["step"] = 0
        if self.get_config(gindex, pindex, group)["optim_bits"] == 8 and eight_bit_rows(p.shape):
            for i, qmap in ((1, "dynamic"), (2, "udynamic")):
                state[f"state{i}"] = self.get_state_buffer(local, dtype=torch.uint8)
                state[f"qmap{i}"] = self.name2qmap[qmap].to(local.device)
                state[f"absmax{i}"] = torch.zeros(local.numel() // BLOCK, dtype=torch.float32,
                                                  device=local.device)
        else:
            state["state1"] = self.get_state_buffer(local, dtype=torch.float32)
            state["state2"] = self.get_state_buffer(local, dtype=torch.float32)

    @torch.no_grad()
    def update_step(self, group, p, gindex, pindex):
        from torch.distributed.tensor import DTensor

        if not isinstance(p, DTensor):
            return super().update_step(group, p, gindex, pindex)
        state, local = self.state[p], p._local_tensor
        if local.numel() == 0:  # a rank past the last row of a small tensor holds no shard of it
            state["step"] += 1
            return
        # bitsandbytes' own update on the shard: it reads the state under the tensor it steps
        # (the same dict, aliased for the call) and the gradient from its .grad
        local.grad = p.grad._local_tensor
        self.state[local] = state
        try:
            super().update_step(group, local, gindex, pindex)
        finally:
            del self.state[local]
            local.grad = None

    def state_dict(self):
        """bitsandbytes' state dict, with each DTensor parameter's state as DTensors (DCP's
        sharded save) and its scalar step; the quantization maps are constants, left out."""
        from torch.distributed.tensor import DTensor

        out = super().state_dict()
        params = list(chain.from_iterable(g["params"] for g in self.param_groups))
        for index in list(out["state"]):
            p = params[index]
            if isinstance(p, DTensor):
                out["state"][index] = _sharded_entry(p, self.state[p])
        return out

    def load_state_dict(self, state_dict, move_to_device=True):
        from torch.distributed.tensor import DTensor

        params = list(chain.from_iterable(g["params"] for g in self.param_groups))
        saved = dict(zip(chain.from_iterable(g["params"] for g in state_dict["param_groups"]), params))
        sharded = {k: v for k, v in state_dict["state"].items() if isinstance(saved.get(k), DTensor)}
        rest = {k: v for k, v in state_dict["state"].items() if k not in sharded}
        super().load_state_dict({**state_dict, "state": rest}, move_to_device)
        for key, entry in sharded.items():
            self.state[saved[key]] = self._local_state(saved[key], entry)

    def _local_state(self, p, entry: dict) -> dict:
        from torch.distributed.tensor import DTensor

        device = p._local_tensor.device
        local = lambda t: (t.to_local() if isinstance(t, DTensor) else t).to(device).contiguous()
        state = {"step": int(entry["step"])}
        for i, qmap in ((1, "dynamic"), (2, "udynamic")):
            state[f"state{i}"] = local(entry[f"state{i}"])
            if f"absmax{i}" in entry:
                state[f"absmax{i}"] = local(entry[f"absmax{i}"]).reshape(-1)
                state[f"qmap{i}"] = self.name2qmap[qmap].to(device)
        return state


def _sharded_entry(p, state: dict) -> dict:
    """One DTensor parameter's 8-bit AdamW state as DTensors placed as the parameter is: the moments
    (uint8 codes or fp32) shaped as it, the block scales as (rows, blocks per row)."""
    from torch.distributed.tensor import DTensor

    def like(local: torch.Tensor, shape: tuple[int, ...]) -> DTensor:
        stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=shape, stride=stride)

    entry = {"step": torch.tensor(float(state["step"]))}
    for i in (1, 2):
        entry[f"state{i}"] = like(state[f"state{i}"], tuple(p.shape))
        if f"absmax{i}" in state:
            per_row = p.numel() // p.shape[0] // BLOCK
            entry[f"absmax{i}"] = like(state[f"absmax{i}"].view(-1, per_row), (p.shape[0], per_row))
    return entry


def adamw_update_(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                  working: torch.Tensor | None, hp: torch.Tensor) -> None:
    """One AdamW step of one tensor, in place, as torch.optim.AdamW computes it (decoupled weight
    decay, bias-corrected moments), in fp32 whatever `grad`'s dtype, then `working` (the bf16 copy
    the model computes with, if any) rewritten from the new master. `hp` (fp32, on the device):
    [grad divisor (the clip), 1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2, lr / (1 - beta1^t),
    1 / sqrt(1 - beta2^t), eps]: tensors, so a new lr is no new compiled graph."""
    divisor, decay, one_minus_beta1, beta2, one_minus_beta2, step_size, inv_bc2_sqrt, eps = hp.unbind()
    g = grad.float() / divisor
    master.mul_(decay)
    exp_avg.lerp_(g, one_minus_beta1)
    exp_avg_sq.mul_(beta2).add_(one_minus_beta2 * g * g)
    master.sub_(step_size * exp_avg / (exp_avg_sq.sqrt() * inv_bc2_sqrt + eps))
    if working is not None:
        working.copy_(master)


def _update_group(masters, grads, exp_avgs, exp_avg_sqs, workings, hp) -> None:
    """adamw_update_ over one param group's lists (compiled once per group on CUDA: inductor fuses
    each tensor's update, the bf16 gradient's upcast and the working copy's write into one kernel
    that reads 14 bytes a bf16-computed weight and writes 14; fp32 weights under autocast move ~12
    more a step: the forward's cast, the gradient's cast back, and AdamW's 4-byte gradient read,
    less the copy's write. ~6% of the 2B step on an H100: docs/benchmarks.md)."""
    for master, grad, exp_avg, exp_avg_sq, working in zip(masters, grads, exp_avgs, exp_avg_sqs, workings):
        adamw_update_(master, grad, exp_avg, exp_avg_sq, working, hp)


class MasterWeightAdamW(torch.optim.Optimizer):
    """AdamW whose fp32 master weights live in its state, for a model that computes with bf16
    working copies of its linear weights (precision.master_weights=optimizer).

    With fp32 parameters under autocast every step casts each weight to bf16 in the forward and
    each bf16 weight gradient back to fp32, and fused AdamW then reads the fp32 gradient: three
    passes over every weight that only move bytes. Here the model's linear weights are bf16 (what
    autocast would have computed with: the forward is the same bits), backward leaves bf16 gradients
    (the same values autocast's cast would have widened), and one update per tensor reads the bf16
    gradient with the fp32 master and moments and writes the master, the moments and the bf16 copy.
    Hand-written because torch's fused AdamW refuses a parameter and gradient of different dtypes
    and has no second output; its math is copied (tests/test_master_weights.py checks it against
    torch.optim.AdamW). Parameters that stay fp32 (norms, embeddings) are their own masters.

    Gradient accumulation: bf16 sums lose a small micro-batch gradient's low bits against a large
    running sum, so `hold_gradients` (after every backward but a step's last) adds them into fp32
    buffers, and `fold_held_gradients` (GradHealth.step, before the norms) rounds the fp32 total to
    bf16 once: the precision of one micro-batch's bf16 gradient. The state (masters included) is
    saved and loaded in fp32, so a resumed run continues exactly."""

    takes_grad_scale = True  # the clip rides in the update (train/health.clips_in_optimizer)

    def __init__(self, groups: list[dict], masters: dict, betas=(0.9, 0.999), eps: float = 1e-8,
                 compiled: bool = False):
        super().__init__(groups, {"lr": 1e-3, "betas": betas, "eps": eps, "weight_decay": 0.0})
        self._initial_masters = masters  # param -> fp32 value (dropped as each param's state is made)
        # gradient accumulation: param -> its fp32 sum buffer (made at the first hold, kept: one
        # allocation a run), and the params whose buffer holds this step's sum so far
        self._sums: dict[torch.Tensor, torch.Tensor] = {}
        self._held: set[torch.Tensor] = set()
        if compiled:
            from vlforge.train.compiled import allow_compiled_variants

            allow_compiled_variants()
        self._update = torch.compile(_update_group, dynamic=False) if compiled else _update_group

    def _state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            master = self._initial_masters.pop(p, None)
            if p.dtype != torch.float32:
                if master is None:
                    raise RuntimeError("a non-fp32 parameter without its fp32 master: PrecisionPolicy.apply makes them")
                state["master"] = master
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
        return state

    @torch.no_grad()
    def hold_gradients(self) -> None:
        """After a backward that is not the step's last: move the bf16 gradients into fp32 sums (a
        few foreach calls for all of them: one Python call per list, not per tensor)."""
        # fp32 parameters accumulate in fp32 already
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None and p.dtype != torch.float32]
        if not params:
            return
        for p in params:
            if p not in self._sums:
                self._sums[p] = torch.empty_like(p, dtype=torch.float32)
        first = [p for p in params if p not in self._held]
        more = [p for p in params if p in self._held]
        if first:  # the step's first hold of these: the sum starts as the gradient (no zeroing pass)
            torch._foreach_copy_([self._sums[p] for p in first], [p.grad for p in first])
        if more:
            torch._foreach_add_([self._sums[p] for p in more], [p.grad for p in more])
        self._held.update(first)
        # kept, not dropped: CUDA graphs' gradient buffers must stay where they are
        torch._foreach_zero_([p.grad for p in params])

    @torch.no_grad()
    def fold_held_gradients(self) -> None:
        """After the step's last backward: each held fp32 sum plus the last gradient, rounded once.
        hold_gradients leaves every gradient it takes in place (zeroed), so a gradient that is None
        now was dropped since (losses.drop_keepalive_grads: the vision tower's placeholder gradients
        on a text-only step): its sum is dropped with it."""
        params = [p for p in self._held if p.grad is not None]
        if params:
            sums = [self._sums[p] for p in params]
            torch._foreach_add_(sums, [p.grad for p in params])
            torch._foreach_copy_([p.grad for p in params], sums)
        self._held.clear()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._held.clear()
        super().zero_grad(set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("MasterWeightAdamW takes no closure")
        if self._held:
            self.fold_held_gradients()
        divisor = getattr(self, "grad_scale", None)
        for group in self.param_groups:
            # by step count: a tensor without a gradient in some steps (the vision tower's on text-only
            # ones) has taken fewer, and its bias correction is its own (as torch's per-tensor `step`)
            by_step: dict[int, list] = {}
            for p in group["params"]:
                if p.grad is not None:
                    state = self._state(p)
                    state["step"] += 1
                    by_step.setdefault(state["step"], []).append((p, state))
            beta1, beta2 = group["betas"]
            lr = group["lr"]
            for step, pairs in by_step.items():
                hp = torch.tensor([1.0, 1.0 - lr * group["weight_decay"], 1.0 - beta1, beta2, 1.0 - beta2,
                                   lr / (1.0 - beta1 ** step), 1.0 / math.sqrt(1.0 - beta2 ** step), group["eps"]],
                                  dtype=torch.float32).to(pairs[0][0].device, non_blocking=True)
                if divisor is not None:
                    hp[0] = divisor
                self._update([s.get("master", p) for p, s in pairs], [p.grad for p, _ in pairs],
                             [s["exp_avg"] for _, s in pairs], [s["exp_avg_sq"] for _, s in pairs],
                             [p if "master" in s else None for p, s in pairs], hp)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's for the groups (its checks that they match, the lr and betas); the state is set
        here, in fp32 as saved (torch's would cast it to each parameter's dtype, the bf16 working
        copy's: 6 more bytes a weight alive during the load, then a wrong master)."""
        saved_ids = list(chain.from_iterable(g["params"] for g in state_dict["param_groups"]))
        params = list(chain.from_iterable(g["params"] for g in self.param_groups))
        for key, p in zip(saved_ids, params):
            if p.dtype != torch.float32 and "master" not in state_dict["state"].get(key, {"master": None}):
                raise ValueError("its optimizer state holds no fp32 master weights (saved with precision."
                                 "master_weights=fp32 or compute)")
        super().load_state_dict({**state_dict, "state": {}})
        for key, p in zip(saved_ids, params):
            if key in state_dict["state"]:
                self._initial_masters.pop(p, None)  # before the saved state arrives: one master alive at a time
                self.state[p] = {k: v.to(p.device) if torch.is_tensor(v) else v
                                 for k, v in state_dict["state"][key].items()}


def hold_gradients(optimizer: torch.optim.Optimizer) -> None:
    """After a backward that is not its optimizer step's last (gradient accumulation): an optimizer
    that sums bf16 gradients in fp32 (MasterWeightAdamW) takes them; others leave autograd's sums."""
    if isinstance(optimizer, MasterWeightAdamW):
        optimizer.hold_gradients()


def warmup_problem(cfg: OptimConfig, total_steps: int) -> str | None:
    """Why the warmup does not fit the run (None: it does). Pure. A config range check cannot say
    it: the steps are known only from the data (epochs) or train.max_steps, once the run starts."""
    if cfg.warmup_steps <= total_steps:
        return None
    return (f"optim.warmup_steps={cfg.warmup_steps} is more than this run's {total_steps} step{'s' if total_steps != 1 else ''}: the learning rate "
            f"rises for the whole run, reaching {total_steps / cfg.warmup_steps:.0%} of its peak, and never decays; "
            f"lower optim.warmup_steps to at most {total_steps} (or train more steps)")


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int):
    """Warmup then decay over `total_steps` (scheduler steps: one a batch, whether it updated or
    not). A warmup longer than the run is said (once, by the main process), not refused: a short
    trial of a long run's config is legitimate."""
    problem = warmup_problem(cfg, total_steps)
    if problem and not (torch.distributed.is_initialized() and torch.distributed.get_rank() > 0):
        print(f"warning: {problem}", file=sys.stderr)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total_steps, cfg.warmup_steps, cfg.schedule, cfg.min_lr_ratio))
