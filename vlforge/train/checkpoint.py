"""Atomic checkpoints with everything needed for an exact resume.

    output_dir/checkpoint-STEP/
        adapter_model.safetensors + adapter_config.json   (LoRA)   | model*.safetensors + config.json (full)
        tokenizer / processor files                        (so a checkpoint is a usable model directory)
        optimizer.pt  scheduler.pt  scaler.pt  rng.pt  (DDP: + rng-RANK.pt of the other ranks)
        fp8_state.pt                                       (TransformerEngine layers only: FP8 scales, amax history)
        trainer_state.json                                 (step, epoch, data position, the model's identity, ...)
        vlforge-manifest.json                              (every file's size and sha256: train/manifest.py)

A checkpoint is written under a temporary name and renamed into place only once complete, so a
crash (even SIGKILL) leaves either the previous checkpoint set or the new one, never a torn one. A
save that cannot be written (disk full, quota, permissions) removes its torn copy and stops the run
with CheckpointWriteError, naming the finished checkpoint to resume from; the run warns at its start
when the disk has less room than its checkpoints will take (`checkpoint_bytes`, `space_problem`).

A resume reads a checkpoint as data someone may have handed us: every .pt file with
torch.load(weights_only=True) (tensors, numbers, strings and their containers; the RNG states are
saved as tensors), weights through safetensors, DCP's files through model/safe_load.py; a file that
holds other objects is refused (rng.pt: the RNG starts fresh, with a warning), never unpickled.
Before anything loads, its shapes are compared with this run's model (a changed LoRA rank is named,
not a size-mismatch traceback); the model it was trained from is checked by train/identity.py and
its files by the manifest (train/runtime.prepare_output_dir).

RNG streams on resume (`restore_rng`): weights, optimizer, schedule and data position resume on
any number of processes, but the RNG (dropout masks) resumes exactly only on the world size that
saved it. Each rank takes its own saved state; a rank the saving run did not have gets a fresh
stream seeded from (train.seed, step, rank), never a copy of another rank's (two ranks would then
draw the same dropout masks). GRPO's RNG is one stream all ranks hold in lockstep (dropout off,
the rollout seed drawn from it on every rank): there every rank takes rank 0's (`shared`), so a
GRPO resume on any world size continues exactly.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from vlforge.config import ConfigError
from vlforge.train.errors import CheckpointWriteError
from vlforge.train.fp8 import fp8_state, load_fp8_state
from vlforge.train.manifest import is_checkpoint, write_manifest, written_by_a_run
from vlforge.train.rng import restore_rng, save_rng
from vlforge.model.safe_load import SafeLoadPlanner, SafeReader, load_failure, load_trusted, read_metadata
from vlforge.model.export import SHARDED_DIR, is_sharded

CKPT_RE = re.compile(r"^checkpoint-(\d+)$")
GB = 1e9
TMP_PREFIX = ".tmp-checkpoint-"  # a save in progress (or torn by a crash): never listed, never resumed from


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checkpoint_bytes(model, optimizer_name: str, masters_in_optimizer: bool = False) -> int:
    """About how many bytes one checkpoint of this run takes on disk: the weights (a LoRA run's
    adapters; a full run's whole model, as save_pretrained and the sharded save both write it) and
    the optimizer's moments (AdamW: two per parameter in its dtype; 8-bit: one byte each plus block
    scales; precision.master_weights=optimizer: fp32 moments and, for bf16 weights, their fp32
    master). The tokenizer, schedule and RNG files are a few MB and left out."""
    from peft import PeftModel

    from torch.distributed.tensor import DTensor

    from vlforge.train.optim import state_bytes

    params = list(model.parameters())  # a tied weight once, as save_pretrained writes it
    trainable = [p for p in params if p.requires_grad]
    weights = trainable if isinstance(model, PeftModel) else params
    moments = sum((8 if p.dtype == torch.float32 else 12) * p.numel() if masters_in_optimizer else
                  2 * p.numel() * p.element_size() if optimizer_name == "adamw" else
                  state_bytes(p.numel(), optimizer_name, tuple(p.shape) if isinstance(p, DTensor) else None)
                  for p in trainable)
    return sum(p.numel() * p.element_size() for p in weights) + moments


def checkpoints_held(saves_left: int, existing: int, keep_last: int) -> int:
    """How many more checkpoints' worth of disk this run will need at its fullest: during a save,
    train.keep_last finished ones plus the one being written. `existing` finished checkpoints
    already take their room; rotation removes the oldest only after the new one is complete."""
    if saves_left <= 0:
        return 0
    return max(1, min(existing + saves_left, keep_last + 1) - existing)


def readable_size(n: float) -> str:
    """Bytes as a person reads them: 23.4 GB, 850.0 MB, 12.0 kB (a small LoRA run's checkpoints
    would otherwise read "0.0 GB")."""
    for unit, size in (("GB", GB), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} bytes"


def space_problem(free: int, per_checkpoint: int, held: int, out: Path) -> str | None:
    """The warning a run prints at its start when `out`'s disk has less free space than `held` more
    checkpoints of `per_checkpoint` bytes; None when they fit."""
    need = per_checkpoint * held
    if free >= need:
        return None
    what = ("not even the first save fits" if free < per_checkpoint else
            f"the run needs room for {held} more (a save holds train.keep_last finished ones plus the one being "
            "written)")
    return (f"{out} has {readable_size(free)} free and this run's checkpoints take ~{readable_size(per_checkpoint)} "
            f"each: {what}, ~{readable_size(need)}. A save that finds the disk full stops the run (finished "
            "checkpoints are kept). Free space, point train.output_dir at a larger disk, or lower train.keep_last")


def _write_failure(out: Path, step: int, error: BaseException) -> str:
    """The message of a save that failed, read before its partial copy is removed (free space then
    is what the failed write saw)."""
    finished = list_checkpoints(out)
    if not out.is_dir():
        return (f"could not write checkpoint-{step}: the run's directory {out} no longer exists (its checkpoints went "
                "with it)")
    failures = list((getattr(error, "failures", None) or {}).values())  # DCP: each failed rank's (exception, trace)
    if failures and isinstance(failures[0], tuple) and isinstance(failures[0][0], BaseException):
        error = failures[0][0]  # its own text, not DCP's, which carries every rank's traceback
    chain, e = [], error
    while e is not None and len(chain) < 8:  # the zip writer and DCP wrap the OSError, if they keep it at all
        chain.append(e)
        e = e.__cause__ or e.__context__
    codes = {getattr(x, "errno", None) for x in chain if isinstance(x, BaseException)}
    text = " ".join(str(x) for x in chain)
    free = shutil.disk_usage(out).free
    quota = errno.EDQUOT in codes or "quota" in text.lower()
    full = not quota and (errno.ENOSPC in codes or "No space left" in text or "os error 28" in text
                          or free < 64 * 2**20)
    cause = ("the disk quota is exceeded" if quota else f"the disk is full ({free / GB:.2f} GB free)" if full else
             f"{type(error).__name__}: {error}".strip())
    if not (full or quota) and "inline_container" in text:  # torch.save's zip writer says no more than this
        cause += " (torch.save's writer: the file system refused the bytes, e.g. a size limit)"
    resume = (f"the finished checkpoint {finished[-1]} is kept: fix the cause and rerun with train.resume=auto to go "
              "on from it" if finished else "no checkpoint of this run was finished yet")
    advice = (" Free space, point train.output_dir at a larger disk (copying the run's directory), or lower "
              "train.keep_last." if full or quota else "")
    return f"could not write checkpoint-{step} in {out}: {cause}; its partial copy was removed, and {resume}.{advice}"


def _is_write_failure(error: BaseException) -> bool:
    """What a failed write raises: an OSError, torch.save's zip writer (RuntimeError), safetensors'
    SafetensorError, DCP's CheckpointException (a BaseException carrying each rank's failure). Other
    errors are bugs and keep their traceback."""
    return isinstance(error, (OSError, RuntimeError)) or type(error).__name__ in ("SafetensorError",
                                                                                  "CheckpointException")


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Checkpoints, oldest first: checkpoint-STEP directories holding one (a manifest, or a
    trainer_state.json from before manifests), intact or not (train/manifest.py tells); temporary
    directories and a folder that merely has such a name are never listed."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in out.iterdir()
             if p.is_dir() and (m := CKPT_RE.match(p.name)) and is_checkpoint(p)]
    return [p for _, p in sorted(found)]


def save_checkpoint(output_dir: str | Path, step: int, model, processor, optimizer, scheduler, scaler,
                    state: dict, keep_last: int, world=None) -> Path:
    """Write checkpoint-STEP atomically. `world` (DDP, train.distributed.World): every rank calls
    this; the replicas are identical, so rank 0 writes the one-process checkpoint and each other
    rank only its RNG state (rng-RANK.pt: dropout and sampling streams differ per rank), and rank 0
    renames the directory into place once every rank has written. Such a checkpoint resumes on one
    process or on any number of DDP ranks."""
    from peft import PeftModel

    out = Path(output_dir)
    final = out / f"checkpoint-{step}"
    several = world is not None and world.size > 1
    # one name every rank can compute when several write into it; a pid otherwise
    tmp = out / (f"{TMP_PREFIX}{step}" if several else f"{TMP_PREFIX}{step}-{os.getpid()}")
    main = world is None or world.main
    with _all_ranks_or_none(tmp, out, step, world):  # also the barrier: the directory exists
        if main:
            _start_directory(out, tmp)
    with _all_ranks_or_none(tmp, out, step, world):  # also the barrier: every rank's RNG state is on disk
        if not main:
            save_rng(tmp / f"rng-{world.rank}.pt")
        else:
            if isinstance(model, PeftModel):
                model.save_pretrained(tmp)
            else:
                model.save_pretrained(tmp, max_shard_size="5GB")
            processor.save_pretrained(tmp)
            torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
            torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
            torch.save(scaler.state_dict(), tmp / "scaler.pt")
            save_rng(tmp / "rng.pt")
            if fp8 := fp8_state(model):  # TE delayed scaling's scales + amax history: without them a resume drifts
                torch.save(fp8, tmp / "fp8_state.pt")
            (tmp / "trainer_state.json").write_text(json.dumps({**state, "step": step,
                                                                "world_size": world.size if world else 1}, indent=2))
    with _all_ranks_or_none(tmp, out, step, world):  # also the barrier: no rank runs ahead to the next save
        if main:
            _finish_directory(out, tmp, final, keep_last)
    return final


def _start_directory(out: Path, tmp: Path) -> None:
    # Torn leftovers of a crashed save. Never another live run's save in progress: a run holds
    # output_dir's lock (train/runtime.py) for its whole life.
    for stale in out.glob(f"{TMP_PREFIX}*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir(parents=True)


def _finish_directory(out: Path, tmp: Path, final: Path, keep_last: int) -> None:
    """List the files in the manifest (every rank's are on disk: callers run this after the last
    barrier), make the bytes durable, then visible under the final name; drop the oldest of the
    run's own checkpoints beyond keep_last."""
    write_manifest(tmp)
    for f in tmp.rglob("*"):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    _fsync_dir(tmp)
    if final.exists() or final.is_symlink():
        if written_by_a_run(final):  # re-saving a step after a resume: replace the old copy
            shutil.rmtree(final)
        else:  # a folder of the user's that has the name: kept, under another
            aside = final.with_name(f"{final.name}.not-written-by-vlforge-{time.strftime('%Y%m%d-%H%M%S')}")
            final.rename(aside)
            print(f"warning: {final} held files vlforge did not write: moved to {aside}")
    os.rename(tmp, final)
    try:
        _fsync_dir(out)
    except OSError as e:  # the checkpoint is complete and in place: not a failed save, said all the same
        print(f"warning: {final} is written, but syncing its directory entry to disk failed ({e}): a power loss "
              "now could lose it")
    ours = [p for p in list_checkpoints(out) if written_by_a_run(p)]  # a user's own files are never rotated away
    for old in ours[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def _all_ranks_or_none(tmp: Path, out: Path, step: int, world=None):
    """One phase of a save, run by every rank. Its outcome is collective: when a write fails on any
    rank the save fails on all (one rank stopping alone would leave the others waiting at the next
    collective until a timeout), rank 0 removes the torn copy once every rank has stopped writing,
    and each rank raises CheckpointWriteError with the cause and the checkpoint to resume from. An
    error that is not a write failure (a bug) keeps its traceback on its rank; the others name it."""
    failure = None
    try:
        yield
    except (KeyboardInterrupt, SystemExit, GeneratorExit):  # the launcher stops every rank: nothing to gather
        raise
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        failure = e
    # each rank's outcome, read before anything is removed (free space then is what the failed write saw)
    mine = None if failure is None else f"{type(failure).__name__}: {failure}"
    if failure is not None and _is_write_failure(failure):
        try:
            mine = _write_failure(out, step, failure)
        except Exception:  # reading the disk's state failed too: the plain cause, and this rank still joins below
            mine = f"could not write checkpoint-{step} in {out}: {mine}"
    outcomes = world.gather_objects(mine) if world is not None else [mine]
    failed = [(rank, message) for rank, message in enumerate(outcomes) if message is not None]
    if not failed:
        return
    if world is None or world.main:
        shutil.rmtree(tmp, ignore_errors=True)
    if failure is not None and not _is_write_failure(failure):
        raise failure
    if mine is None:
        rank, message = failed[0]
        mine = (f"rank {rank} of {len(outcomes)} failed: {message}" if message.startswith("could not write") else
                f"could not write checkpoint-{step} in {out}: rank {rank} of {len(outcomes)} failed: {message}")
    raise CheckpointWriteError(mine) from failure


def _other_run(path: Path, what: str) -> str:
    return (f"cannot resume from {path}: {what}. It was saved by a run with another config (other tiers, "
            f"model or optimizer); resume with the config it was saved with ({path.parent / 'config.yaml'}), or "
            "start this config in a new train.output_dir")


def _header_shapes(file: Path) -> dict[str, list[int]]:
    """Each tensor's shape in a safetensors file, from its header alone (no tensor is read)."""
    try:
        with safe_open(file, "pt") as f:
            return {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as e:  # safetensors' SafetensorError: a torn or foreign file
        raise ConfigError(f"{file} is unreadable ({e}): the file is damaged (truncated or overwritten)") from None


def shape_problem(saved: dict[str, list[int]], here: dict[str, list[int]]) -> str | None:
    """The first tensor (by name) both hold with another shape, named; a LoRA factor's says so."""
    for key in sorted(saved.keys() & here.keys()):
        if list(saved[key]) != list(here[key]):
            lora = ": a LoRA rank differs (tiers.*.r)" if re.search(r"\.lora_(embedding_)?[AB]\b", key) else ""
            return f"{key} is {list(saved[key])} there and {list(here[key])} in this run's model{lora}"
    return None


def _load_adapters(path: Path, model) -> None:
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    file = path / "adapter_model.safetensors"
    if not file.is_file():
        raise FileNotFoundError(f"{path} has no adapter_model.safetensors: it was not written by a LoRA run")
    # before peft's load: a changed rank is one named key here, not a size-mismatch traceback there
    here = {k: list(v.shape) for k, v in get_peft_model_state_dict(model).items()}
    if problem := shape_problem(_header_shapes(file), here):
        raise ConfigError(_other_run(path, problem))
    result = set_peft_model_state_dict(model, load_file(file))
    if getattr(result, "unexpected_keys", None):
        raise ConfigError(_other_run(path, f"its adapters do not fit this model ({result.unexpected_keys[:3]})"))


def _load_weights(path: Path, model) -> None:
    files = sorted(path.glob("model*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no model*.safetensors: it was not written by a full fine-tuning run")
    params = dict(model.named_parameters())
    saved = {k: shape for f in files for k, shape in _header_shapes(f).items()}
    missing = [n for n, p in params.items() if p.requires_grad and n not in saved]
    if missing:
        raise ConfigError(_other_run(path, f"it lacks weights this run trains ({missing[:3]})"))
    if problem := shape_problem(saved, {n: list(p.shape) for n, p in params.items()}):
        raise ConfigError(_other_run(path, problem))
    with torch.no_grad():
        for f in files:
            for n, tensor in load_file(f).items():
                if n in params:
                    params[n].copy_(tensor.to(params[n].dtype))


def saved_master_weights(path: str | Path) -> str | None:
    """The precision.master_weights a checkpoint's run trained with (its trainer_state.json, read as
    JSON); fp32 for a checkpoint from before it was recorded (the default then); None when `path`
    has no trainer_state.json (the resume's own checks name what is wrong with it)."""
    try:
        state = json.loads((Path(path) / "trainer_state.json").read_text())
    except (OSError, ValueError):
        return None
    value = state.get("master_weights", "fp32") if isinstance(state, dict) else None
    return value if value in ("fp32", "compute", "optimizer") else None


def load_checkpoint(path: str | Path, model, optimizer, scheduler, scaler, rank: int = 0, seed: int = 0,
                    shared_rng: bool = False) -> dict:
    """Restore weights, optimizer, scheduler, loss scaler and RNG in place; returns trainer_state.
    `rank` (DDP): every rank loads the same files, and its RNG as restore_rng says (`seed`:
    train.seed, for a rank the saving run did not have; `shared_rng`: every rank takes rank 0's).
    Every file is read as data (load_trusted, safetensors); shapes are compared before loading."""
    from peft import PeftModel

    path = Path(path)
    if not (path / "trainer_state.json").is_file():
        raise FileNotFoundError(f"{path} is not a complete vlforge checkpoint (no trainer_state.json)")
    if is_sharded(path):
        raise FileNotFoundError(f"{path} is a sharded (FSDP2) checkpoint; resume it with distributed.strategy=fsdp2 "
                                "(any number of processes), or `vlforge export` it and start from the export")
    if isinstance(model, PeftModel):
        _load_adapters(path, model)
    else:
        _load_weights(path, model)
    from vlforge.train.optim import MasterWeightAdamW

    saved = load_trusted(path / "optimizer.pt")
    if not isinstance(optimizer, MasterWeightAdamW) and any("master" in s for s in saved["state"].values()):
        # its model files hold the bf16 working copies; the fp32 masters are in the optimizer state
        raise ConfigError(_other_run(path, "its fp32 master weights are in its optimizer state "
                                           "(precision.master_weights=optimizer)"))
    try:
        optimizer.load_state_dict(saved)
    except ValueError as e:  # torch's check that the groups and their sizes match
        raise ConfigError(_other_run(path, f"its optimizer state is for other parameters ({e})")) from None
    scheduler.load_state_dict(load_trusted(path / "scheduler.pt"))
    scaler.load_state_dict(load_trusted(path / "scaler.pt"))
    state = json.loads((path / "trainer_state.json").read_text())
    restore_rng(path, rank, seed, state["step"], shared_rng)
    if (path / "fp8_state.pt").is_file():
        load_fp8_state(model, load_trusted(path / "fp8_state.pt"))
    return state


# ----------------------------------------------------------------------------- sharded (FSDP2)
#
#   output_dir/checkpoint-STEP/
#       dcp/                       model + optimizer shards (torch.distributed.checkpoint): the
#                                  trainable weights only with LoRA, every weight in full fine-tuning
#       tokenizer / processor files, scheduler.pt, scaler.pt, trainer_state.json, rng-RANK.pt
#
# DCP writes each rank's shards and reads them back on any number of ranks (it reshards), so a
# run saved on N processes resumes on M. `vlforge export` consolidates one into a plain HF directory.

def _trainable_only(model, state: dict) -> dict:
    """With LoRA only the adapters (and any other trainable tensors) are worth saving: the base is
    the run's model.path / preset. Full fine-tuning keeps every weight (export needs them all)."""
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        return state
    trainable = _trained_here(model)
    return {k: v for k, v in state.items() if k in trainable}


def _trained_here(model) -> set[str]:
    """The names of the parameters this run trains (FSDP2 keeps the module's names: they are DCP's keys)."""
    return {n for n, p in model.named_parameters() if p.requires_grad}


def _trained_record(names: set[str]) -> dict:
    """What a sharded checkpoint records of the parameters its run trained (trainer_state.json): their
    count and a digest of their names, so a resume tells another config from parameters that merely
    had no gradient yet (no optimizer state: a vision tier before the first image)."""
    return {"tensors": len(names), "sha256": hashlib.sha256("\n".join(sorted(names)).encode()).hexdigest()}


def _with_optimizer_state(metadata, names: set[str]) -> dict[str, set[str]]:
    """Of `names`, those a sharded checkpoint holds optimizer state for (optim.state.NAME.exp_avg, ...:
    DCP flattens nested state further, so a key is matched to the longest name it starts with), each
    with the state's keys (exp_avg, ...: AdamW; state1, absmax1, ...: 8-bit). Read from DCP's
    metadata, before anything is loaded."""
    prefix = "optim.state."
    found: dict[str, set[str]] = {}
    for key in metadata.state_dict_metadata:
        if key.startswith(prefix):
            name = key[len(prefix):]
            while name and name not in names:
                name = name.rpartition(".")[0]
            if name:
                found.setdefault(name, set()).add(key[len(prefix) + len(name) + 1:])
    return found


def _optimizer_kind(state_keys: set[str]) -> str:
    return "8-bit AdamW (optim.name=adamw8bit or paged_adamw8bit)" if "state1" in state_keys else \
        "AdamW (optim.name=adamw)"


def save_sharded_checkpoint(output_dir: str | Path, step: int, model, processor, optimizer, scheduler, scaler,
                            state: dict, keep_last: int, world) -> Path:
    """Every rank calls this (the shards are written collectively); rank 0 writes the rest and
    renames the finished directory into place, after a barrier: atomic as the one-process save."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    out = Path(output_dir)
    final = out / f"checkpoint-{step}"
    tmp = out / f"{TMP_PREFIX}{step}"
    with _all_ranks_or_none(tmp, out, step, world):  # also the barrier: the directory exists
        if world.main:
            _start_directory(out, tmp)
    model_state = _trainable_only(model, get_model_state_dict(model))
    optim_state = get_optimizer_state_dict(model, optimizer)  # collectives: every rank, outside the phases
    with _all_ranks_or_none(tmp, out, step, world):  # also the barrier: every rank's shards are on disk
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp / SHARDED_DIR))
        save_rng(tmp / f"rng-{world.rank}.pt")
        if world.main:
            processor.save_pretrained(tmp)
            torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
            torch.save(scaler.state_dict(), tmp / "scaler.pt")
            (tmp / "trainer_state.json").write_text(json.dumps(
                {**state, "step": step, "world_size": world.size, "trained": _trained_record(_trained_here(model))},
                indent=2))
    with _all_ranks_or_none(tmp, out, step, world):
        if world.main:
            _finish_directory(out, tmp, final, keep_last)
    return final


def load_sharded_checkpoint(path: str | Path, model, optimizer, scheduler, scaler, world, seed: int = 0,
                            shared_rng: bool = False) -> dict:
    """Restore a sharded checkpoint on this world (of any size); returns trainer_state. The RNG as
    restore_rng says (`seed`: train.seed; `shared_rng`: every rank takes rank 0's)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict)

    path = Path(path)
    if not is_sharded(path):
        raise FileNotFoundError(f"{path} is a one-process (or DDP) checkpoint; resume it with "
                                "distributed.strategy=none (one process) or ddp, or start the sharded run afresh")
    # Another config's checkpoint: DCP loads a subset without complaint and the optimizer then fails at
    # its first step, so compare first (the record; a checkpoint from before it: what has optimizer state)
    state = json.loads((path / "trainer_state.json").read_text())
    here = _trained_here(model)
    metadata = read_metadata(path / SHARDED_DIR)  # DCP's records only: nothing else is unpickled
    with_state = _with_optimizer_state(metadata, {n for n, _ in model.named_parameters()})
    if "trained" in state:
        other = state["trained"] != _trained_record(here)
    else:  # a checkpoint from before the record: whatever has optimizer state must be trained here
        other = bool(set(with_state) - here)
    if other:
        differ = [f"{n} (trained there only)" for n in sorted(set(with_state) - here)[:2]] + \
                 [f"{n} (trained here only)" for n in sorted(here - set(with_state))[:2]]
        saved = state["trained"]["tensors"] if "trained" in state else len(with_state)
        raise ConfigError(_other_run(path, f"it trained {saved} tensors, this config trains {len(here)}"
                                           + (f": {', '.join(differ)}" if differ else "")))
    model_state = _trainable_only(model, get_model_state_dict(model))
    saved_shapes = {k.removeprefix("model."): list(m.size) for k, m in metadata.state_dict_metadata.items()
                    if k.startswith("model.") and hasattr(m, "size")}
    if problem := shape_problem(saved_shapes, {k: list(v.shape) for k, v in model_state.items()}):
        raise ConfigError(_other_run(path, problem))  # DCP would fail mid-load, on every rank, with a traceback
    optim_state = get_optimizer_state_dict(model, optimizer)
    for name in here - set(with_state):  # trained, but no gradient had reached it yet: fresh moments, as in the run
        optim_state["state"].pop(name, None)
    saved_keys = set().union(*with_state.values())
    if wanted := {k for state in optim_state["state"].values() for k in state} - saved_keys:
        raise ConfigError(_other_run(path, f"it holds the state of {_optimizer_kind(saved_keys)}; this config's "
                                           f"optimizer is {_optimizer_kind(wanted)}, which keeps {', '.join(sorted(wanted))}"))
    loaded = {"model": model_state, "optim": optim_state}
    try:
        dcp.load(loaded, storage_reader=SafeReader(str(path / SHARDED_DIR)), planner=SafeLoadPlanner())
    except CheckpointException as e:  # every rank's: a refused item, or a shard torn since the manifest was checked
        raise ConfigError(f"cannot resume from {path}: its {SHARDED_DIR}/ shards could not be read: {load_failure(e)}; "
                          "resume from another checkpoint") from None
    set_model_state_dict(model, loaded["model"], options=StateDictOptions(strict=False))
    # strict: every trained parameter has saved state; not so for those without a gradient yet (above)
    set_optimizer_state_dict(model, optimizer, loaded["optim"],
                             options=StateDictOptions(strict=not (here - set(with_state))))
    scheduler.load_state_dict(load_trusted(path / "scheduler.pt"))
    scaler.load_state_dict(load_trusted(path / "scaler.pt"))
    restore_rng(path, world.rank, seed, state["step"], shared_rng)
    return state
