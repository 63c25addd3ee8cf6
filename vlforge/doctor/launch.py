"""The doctor's multi-GPU checks: torch.distributed and its backends (NCCL, gloo), and the torchrun
launch this process is in (RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE / MASTER_ADDR /
MASTER_PORT, one GPU per process), read from collect_environment's dict without initialising
anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vlforge.doctor.environment import Check, Status


@dataclass
class Launch:
    """The torchrun launch this process is in, read from LAUNCH_VARS (pure; see `parse_launch`)."""

    torchrun: bool  # RANK and WORLD_SIZE set: train/distributed.torchrun_env() sees a launch
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int | None = None  # processes on this node; None when not set
    rendezvous: str | None = None  # MASTER_ADDR:MASTER_PORT
    problem: tuple[Status, str, str] | None = None  # (status, detail, advice) of a broken launch


TORCHRUN_ADVICE = ("launch with torchrun (torchrun --nproc_per_node N -m vlforge sft CONFIG), which sets RANK, "
                    "WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT in every process")


def parse_launch(launch: dict[str, str]) -> Launch:
    """What the launch variables say, and what is wrong with them. `launch`: name -> value of the
    LAUNCH_VARS that are set (collect_environment's "_launch")."""
    if "RANK" not in launch or "WORLD_SIZE" not in launch:
        stray = [k for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if k in launch]
        if stray:  # torchrun_env() needs both: the run would silently be one process
            return Launch(False, problem=("warn", f"{' and '.join(stray)} set without "
                                          f"{'WORLD_SIZE' if 'RANK' in launch else 'RANK'}: vlforge runs as one process",
                                          f"{TORCHRUN_ADVICE}; or unset {' '.join(stray)}"))
        return Launch(False)
    numbers = {}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        if key in launch:
            try:
                numbers[key] = int(launch[key])
            except ValueError:
                return Launch(True, problem=("fail", f"{key}={launch[key]!r} is not a whole number", TORCHRUN_ADVICE))
    rank, size = numbers["RANK"], numbers["WORLD_SIZE"]
    out = Launch(True, rank, size, numbers.get("LOCAL_RANK", 0), numbers.get("LOCAL_WORLD_SIZE"),
                 f"{launch['MASTER_ADDR']}:{launch['MASTER_PORT']}" if {"MASTER_ADDR", "MASTER_PORT"} <= set(launch)
                 else None)
    if size < 1 or not 0 <= rank < size:
        out.problem = ("fail", f"RANK={rank} with WORLD_SIZE={size}: a rank must be 0 .. WORLD_SIZE-1", TORCHRUN_ADVICE)
    elif out.rendezvous is None:
        missing = " and ".join(k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in launch)
        # one process with fsdp2 would fail at init_process_group; auto resolves to none and never meets it
        out.problem = ("fail" if size > 1 else "warn",
                       f"{missing} not set: the processes cannot meet (torch.distributed's env:// rendezvous)",
                       TORCHRUN_ADVICE)
    elif size > 1 and "LOCAL_RANK" not in launch:
        out.problem = ("warn", "LOCAL_RANK not set: every process on a node takes GPU 0", TORCHRUN_ADVICE)
    return out


def distributed_checks(env: dict[str, Any]) -> list[Check]:
    """torch.distributed and its backends, and the torchrun launch (pure over collect_environment's
    dict: `_gpu_count`, `_cuda_available`, `_distributed`, `_nccl`, `_nccl_version`, `_gloo`, `_launch`)."""
    count, dist, nccl, gloo = env["_gpu_count"], env["_distributed"], env["_nccl"], env["_gloo"]
    nccl_version = env.get("_nccl_version")
    values = {"gpu_count": count, "distributed": dist, "nccl": nccl, "nccl_version": nccl_version, "gloo": gloo}
    if count > 1 and not (dist and nccl):
        missing = "torch.distributed" if not dist else "NCCL"
        checks = [Check("multi-gpu", "warn", f"{count} GPUs but this torch has no {missing}: one GPU at a time",
                        "install a Linux CUDA build of torch (https://pytorch.org/get-started/locally/): "
                        "it ships with NCCL", values)]
    else:
        parts = [f"{count} GPU(s)", f"torch.distributed {'yes' if dist else 'no'}",
                 f"NCCL {nccl_version or ('yes' if nccl else 'no')}", f"gloo {'yes' if gloo else 'no'}"]
        checks = [Check("multi-gpu", "ok", ", ".join(parts), values=values)]

    launch = parse_launch(env.get("_launch", {}))
    lv = {"torchrun": launch.torchrun, "rank": launch.rank, "world_size": launch.world_size,
          "local_rank": launch.local_rank, "local_world_size": launch.local_world_size,
          "rendezvous": launch.rendezvous}
    if launch.problem:
        status, detail, advice = launch.problem
        checks.append(Check("torchrun", status, detail, advice, lv))
        if status == "fail":
            return checks
    elif not launch.torchrun:
        hint = f"; this machine can run torchrun --nproc_per_node {count} (one process per GPU)" if count > 1 else ""
        checks.append(Check("torchrun", "ok", f"not under torchrun: one process{hint}", values=lv))
    else:
        local = f" of {launch.local_world_size}" if launch.local_world_size is not None else ""
        checks.append(Check("torchrun", "ok", f"rank {launch.rank} of {launch.world_size} (local rank "
                            f"{launch.local_rank}{local}), rendezvous {launch.rendezvous}", values=lv))
    if not launch.torchrun:
        return checks

    # the process group init_world makes: NCCL where the processes have GPUs, gloo on CPU
    if env["_cuda_available"] and count > 0:
        if not (dist and nccl):
            checks.append(Check("process group", "fail", f"GPUs but no NCCL in this torch for {launch.world_size} "
                                "processes", "install a Linux CUDA build of torch (it ships with NCCL)"))
        else:
            checks.append(Check("process group", "ok", f"NCCL {nccl_version or ''}".rstrip()
                                + f" for {launch.world_size} process(es)"))
        checks.append(_gpu_per_process_check(launch, count))
    elif not (dist and gloo):
        checks.append(Check("process group", "fail", "no GPU and no gloo backend: processes cannot talk on CPU",
                            "install a torch build with torch.distributed (the PyPI builds have gloo)"))
    else:
        checks.append(Check("process group", "ok", f"gloo on CPU for {launch.world_size} process(es) (no GPU: "
                            "slow, fine for tests)"))
    return checks


def _gpu_per_process_check(launch: Launch, count: int) -> Check:
    """One GPU per process: init_world puts local rank i on cuda:i of the GPUs this process sees."""
    values = {"gpu_count": count, "local_rank": launch.local_rank, "local_world_size": launch.local_world_size}
    advice = (f"start one process per GPU: torchrun --nproc_per_node {count} (and leave CUDA_VISIBLE_DEVICES "
              "the same for every process of a node)")
    if launch.local_rank >= count:
        return Check("gpu per process", "fail", f"local rank {launch.local_rank} but this process sees {count} "
                     f"GPU(s): it has no cuda:{launch.local_rank}", advice, values)
    if launch.local_world_size is None:
        return Check("gpu per process", "warn", f"LOCAL_WORLD_SIZE not set: cannot tell whether {count} GPU(s) "
                     "are one per process", TORCHRUN_ADVICE, values)
    if launch.local_world_size > count:
        return Check("gpu per process", "fail", f"{launch.local_world_size} processes on this node but {count} "
                     "GPU(s) visible: the processes would share GPUs", advice, values)
    if launch.local_world_size < count:
        return Check("gpu per process", "warn", f"{launch.local_world_size} processes on this node, {count} GPUs: "
                     f"{count - launch.local_world_size} GPU(s) idle", advice, values)
    return Check("gpu per process", "ok", f"{count} processes on this node, one GPU each (this one: "
                 f"cuda:{launch.local_rank})", values=values)
