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


def resolve_device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"train.device={spec} but no CUDA device is visible; use train.device=cpu or auto")
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
