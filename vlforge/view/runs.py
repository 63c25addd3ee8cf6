"""The runs `vlforge view` shows, read from their directories (nothing written there).

A run directory is one a recipe wrote: config.yaml and metrics.jsonl (train/run.py), samples/
(train/samples.py), checkpoint-STEP/. A path given to the viewer is a run, or a folder whose
subfolders (one level down) are runs.
"""

from __future__ import annotations

import json

import fcntl
import os
import struct
import time
from pathlib import Path

import yaml

from vlforge.config import ConfigError
from vlforge.train.checkpoint import list_checkpoints
from vlforge.train.metrics import read_metrics
from vlforge.train.runtime import LOCK_NAME
from vlforge.train.samples import read_samples

# The settings a reader of the run wants first: what trained, in which precision, with what memory plan
KEY_CONFIG = {
    "model": ("preset", "path"), "tiers": ("method",), "quant": ("language", "vision"),
    "precision": ("mode", "master_weights"), "compile": ("enabled",), "activation_checkpointing": ("enabled",),
    "optim": ("name", "schedule"), "train": ("batch_size", "grad_accum", "max_steps", "device"),
    "distributed": ("strategy", "cpu_offload"), "rollout": ("group_size", "prompts_per_step", "tools"),
    "rl": ("advantage", "policy_loss", "kl_beta"),
}


def is_run(path: Path) -> bool:
    return path.is_dir() and ((path / "metrics.jsonl").is_file() or (path / "config.yaml").is_file())


def find_runs(paths: list[str | Path]) -> list[Path]:
    """The run directories of `paths` (each a run or a folder of runs), in the order given."""
    runs: list[Path] = []
    for given in paths:
        path = Path(given).expanduser()
        if not path.is_dir():
            raise ConfigError(f"vlforge view {given}: no such directory; give a run's train.output_dir or a "
                              "folder of runs")
        found = [path] if is_run(path) else sorted(p for p in path.iterdir() if is_run(p))
        if not found:
            raise ConfigError(f"vlforge view {given}: neither a run directory (config.yaml, metrics.jsonl) nor a "
                              "folder holding any; give a run's train.output_dir")
        runs += [p.resolve() for p in found if p.resolve() not in runs]
    return runs


def lock_held(run: Path) -> bool:
    """Whether a live process holds the run's output-directory lock (train/runtime.OutputDirLock).
    F_GETLK asks without taking the lock: a probe that took it, even for a moment, could refuse a
    run (a resume) starting then. Where F_GETLK is unavailable, the pid written in the file is asked."""
    path = run / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        query = struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)  # struct flock (Linux, 64-bit)
        answer = fcntl.fcntl(fd, fcntl.F_GETLK, query)
        return struct.unpack("hhqqi4x", answer)[0] != fcntl.F_UNLCK
    except OSError:
        pid = os.read(fd, 32).decode(errors="replace").strip()
        try:
            os.kill(int(pid), 0)
            return True
        except (ValueError, OSError):
            return False
    finally:
        os.close(fd)


def run_state(run: Path, rows: list[dict], config: dict) -> str:
    """running (its lock is held), finished (logged its last step), stopped (not running, a
    checkpoint at its last logged step: a stop signal's save) or crashed (ended otherwise)."""
    if lock_held(run):
        return "running"
    last = max((r.get("step", 0) for r in rows), default=0)
    if last and last == (config.get("train") or {}).get("max_steps"):
        return "finished"
    checkpoints = list_checkpoints(run)
    if checkpoints and last and checkpoints[-1].name == f"checkpoint-{last}":
        # a run sized by train.epochs has no max_steps: its checkpoints record the run's length
        try:
            total = json.loads((checkpoints[-1] / "trainer_state.json").read_text()).get("total_steps")
        except (OSError, ValueError, AttributeError):
            total = None
        return "finished" if total == last else "stopped"
    return "crashed" if rows else "starting"


def key_config(config: dict) -> dict:
    out = {}
    for section, keys in KEY_CONFIG.items():
        for key in keys:
            value = (config.get(section) or {}).get(key)
            if value not in (None, [], {}):
                out[f"{section}.{key}"] = value
    return out


def run_summary(run: Path) -> dict:
    """What the run list shows: name, recipe, state, last step, key config, files' times."""
    config = _config(run)
    rows = read_metrics(run / "metrics.jsonl") if (run / "metrics.jsonl").is_file() else []
    modified = max((p.stat().st_mtime for p in (run / "metrics.jsonl", run / "config.yaml") if p.exists()),
                   default=time.time())
    return {"name": run.name, "path": str(run), "recipe": "grpo" if "rollout" in config else "sft",
            "state": run_state(run, rows, config), "last_step": max((r.get("step", 0) for r in rows), default=0),
            "config": key_config(config), "modified": modified}


def run_data(run: Path) -> dict:
    """Everything the page shows of one run: summary, metrics rows with their times, sample rows."""
    rows = read_metrics(run / "metrics.jsonl") if (run / "metrics.jsonl").is_file() else []
    return {**run_summary(run), "metrics": rows, "grpo": read_samples(run, "grpo"), "eval": read_samples(run, "eval")}


def _config(run: Path) -> dict:
    try:
        data = yaml.safe_load((run / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}
