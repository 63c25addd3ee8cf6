"""RNG states in checkpoints: saved as tensors and numbers, restored per rank, or started fresh.

Weights, optimizer, schedule and data position resume on any number of processes, but the RNG
(dropout masks) resumes exactly only on the world size that saved it. Each rank takes its own saved
state (rank 0: rng.pt, or rng-0.pt in a sharded checkpoint; rank r: rng-r.pt); a rank the saving
run did not have gets a fresh stream seeded from (train.seed, step, rank), never a copy of another
rank's (two ranks would then draw the same dropout masks). GRPO's RNG is one stream all ranks hold
in lockstep (dropout off, the rollout seed drawn from it on every rank): there every rank takes
rank 0's (`shared`), so a GRPO resume on any world size continues exactly.

The files hold only tensors and numbers and are read with torch.load(weights_only=True)
(model/safe_load.load_trusted); one that would need more is never unpickled: a warning, and a
fresh stream.
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import torch

from vlforge.model.safe_load import ForeignObjects, load_trusted


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def save_rng(path: Path) -> None:
    """This process's RNG states as rng.pt holds them: tensors and numbers only. Python's state (a
    version, 625 ints below 2**32, the Gaussian's spare value) goes in as an int64 tensor."""
    state = rng_state()
    version, internal, gauss = state["python"]
    torch.save({**state, "python": torch.tensor([version, *internal], dtype=torch.int64), "python_gauss": gauss}, path)


def read_rng(path: Path) -> tuple[dict | None, str]:
    """(rng_state()'s form of a saved rng file, ""), or (None, why it is not one). Read with
    weights_only=True: a file that needs more than tensors and numbers is refused, never unpickled.
    Also reads the files of vlforge before save_rng (Python's state as a tuple: plain numbers too)."""
    try:
        saved = load_trusted(path)  # a damaged file's ConfigError goes on up: resume from another checkpoint
    except ForeignObjects as e:
        return None, str(e)
    if not isinstance(saved, dict):
        return None, f"{path} is not an RNG state vlforge saved (a {type(saved).__name__}, not a dict)"
    python, cuda = saved.get("python"), saved.get("cuda", [])
    if isinstance(python, torch.Tensor) and python.dtype == torch.int64 and python.dim() == 1 and len(python) > 1:
        values = python.tolist()
        python = (values[0], tuple(values[1:]), saved.get("python_gauss"))
    if not (isinstance(saved.get("torch"), torch.Tensor) and isinstance(python, tuple) and len(python) == 3
            and isinstance(python[1], tuple) and isinstance(cuda, list)
            and all(isinstance(c, torch.Tensor) for c in cuda)):
        return None, f"{path} is not an RNG state vlforge saved (no torch and python states)"
    return {"torch": saved["torch"], "python": python, **({"cuda": cuda} if "cuda" in saved else {})}, ""


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        # the devices this process sees (a resume on a host with fewer GPUs restores those it has)
        for device, cuda_state in enumerate(state["cuda"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, device)


def rank_seed(seed: int, step: int, rank: int) -> int:
    """The seed of a rank's fresh RNG stream at a resumed step: a hash, so that nearby (seed, step,
    rank) triples give unrelated streams (seed + rank would give rank 1 of seed 0 the stream of
    rank 0 of seed 1)."""
    digest = hashlib.sha256(f"vlforge-rng:{seed}:{step}:{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # below 2**63: every RNG takes it


def restore_rng(path: Path, rank: int, seed: int, step: int, shared: bool = False) -> bool:
    """Set this rank's torch (CPU and CUDA) and Python RNG from checkpoint `path`: its own saved
    state (rank 0: rng.pt, or rng-0.pt in a sharded checkpoint; rank r: rng-r.pt), rank 0's with
    `shared`, or, for a rank the saving run did not have, a fresh stream from rank_seed(seed, step,
    rank). Returns whether a saved state was restored (False: a fresh stream). A saved file that is
    not a plain RNG state (one that would need unpickling objects) is not loaded: a warning, and a
    fresh stream."""
    first = path / "rng.pt" if (path / "rng.pt").is_file() else path / "rng-0.pt"
    saved = first if rank == 0 or shared else path / f"rng-{rank}.pt"
    if saved.is_file():
        state, problem = read_rng(saved)
        if state is not None:
            try:
                set_rng_state(state)
                return True
            except (RuntimeError, TypeError, ValueError) as e:  # the right types, wrong contents
                problem = f"{saved} is not an RNG state torch and Python accept ({e})"
        print(f"warning: rank {rank}: {problem}; its RNG (dropout masks) starts a fresh stream from train.seed, "
              "step and rank instead, so this resume is not bit-exact to an uninterrupted run")
    fresh_rng(seed, step, rank)
    return False


def fresh_rng(seed: int, step: int, rank: int) -> None:
    """Seed this process's torch (CPU and every CUDA device) and Python RNG with rank_seed."""
    fresh = rank_seed(seed, step, rank)
    torch.manual_seed(fresh)  # the CPU generator and every CUDA device's
    random.seed(fresh)
