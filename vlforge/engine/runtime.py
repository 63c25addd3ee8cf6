"""Run plumbing shared by recipes: device choice, output directory rules, seeding."""

from __future__ import annotations

import random
import shutil
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
