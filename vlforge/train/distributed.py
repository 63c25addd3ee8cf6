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

import datetime
import functools
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from vlforge.config import ConfigError, DistributedConfig
from vlforge.train.runtime import resolve_device


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
