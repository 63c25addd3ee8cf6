"""Run plumbing shared by recipes: device choice, output directory rules, seeding."""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path

import torch

from vlforge.config import ConfigError
from vlforge.engine.checkpoint import list_checkpoints


def choose_device(spec: str, cuda_available: bool, gpu_count: int, key: str = "train.device"
                  ) -> tuple[torch.device | None, tuple[str, str] | None]:
    """The device `spec` (auto | cpu | cuda | cuda:N | ...) names on a machine with `gpu_count`
    visible GPUs: (device, None), or (None, (detail, advice)) when it cannot be used here.

    Pure, so that `vlforge doctor` can report the problem and go on checking, and tests can ask
    about machines they do not run on. `auto` and `cuda` mean torch's current CUDA device.
    """
    if spec == "auto":
        return torch.device("cuda" if cuda_available and gpu_count else "cpu"), None
    try:
        device = torch.device(spec)
    except (RuntimeError, ValueError):
        return None, (f"{key}={spec} is not a device", f"use {key}=auto, cpu, cuda or cuda:N")
    if device.type == "cuda":
        if not cuda_available or gpu_count == 0:
            return None, (f"{key}={spec} but no CUDA GPU is visible", f"use {key}=cpu or auto, or run where "
                          "torch sees a GPU (`vlforge doctor` says why it does not)")
        if device.index is not None and device.index >= gpu_count:
            return None, (f"{key}={spec} but only {gpu_count} GPU(s) are visible",
                          f"use {key}=cuda:0 .. cuda:{gpu_count - 1}, or auto")
    return device, None  # cpu, cuda, or a device type vlforge is not tested on (doctor warns)


def resolve_device(spec: str, key: str = "train.device") -> torch.device:
    """choose_device on this machine; a device it cannot use is a ConfigError."""
    available = torch.cuda.is_available()
    device, problem = choose_device(spec, available, torch.cuda.device_count() if available else 0, key)
    if problem:
        raise ConfigError(f"{problem[0]}; {problem[1]}")
    return device


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def _set_aside_later_checkpoints(out: Path, step: int) -> None:
    """Going back to an older checkpoint branches the run: checkpoints past it belong to the
    abandoned branch. Left in place, keep_last would prune the new branch's checkpoints before
    them and resume=auto would pick them up; deleting them would destroy results. They move to
    output_dir/superseded-STEP-TIME/."""
    later = [p for p in list_checkpoints(out) if int(p.name.split("-")[1]) > step]
    if not later:
        return
    aside = out / f"superseded-{step}-{time.strftime('%Y%m%d-%H%M%S')}"
    aside.mkdir()
    for p in later:
        p.rename(aside / p.name)
    print(f"resuming from step {step}: moved {len(later)} later checkpoint(s) to {aside}")


def prepare_output_dir(output_dir: str | Path, resume: str, overwrite: bool) -> Path | None:
    """Create/validate output_dir. Returns the checkpoint to resume from, if any.

    A non-empty output_dir is refused unless resuming or overwriting: a run never silently
    replaces another run's results.
    """
    out = Path(output_dir)
    if resume not in ("auto", "never"):
        ckpt = Path(resume)
        if not (ckpt / "trainer_state.json").is_file():
            raise ConfigError(f"train.resume={resume}: not a complete checkpoint directory (no trainer_state.json)")
        out.mkdir(parents=True, exist_ok=True)
        _set_aside_later_checkpoints(out, json.loads((ckpt / "trainer_state.json").read_text())["step"])
        return ckpt
    if out.exists() and any(out.iterdir()):
        if resume == "auto":
            ckpts = list_checkpoints(out)
            return ckpts[-1] if ckpts else None
        if overwrite:
            shutil.rmtree(out)
        else:
            raise ConfigError(
                f"train.output_dir={out} is not empty (another run's results?). Pass train.resume=auto to continue "
                "it, train.overwrite=true to replace it, or choose another train.output_dir.")
    out.mkdir(parents=True, exist_ok=True)
    return None
