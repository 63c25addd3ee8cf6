"""Run plumbing shared by recipes: device choice, DataLoader workers, output directory rules, seeding.

An output directory belongs to one run at a time: `prepare_output_dir` takes an exclusive lock on
it (output_dir/.vlforge.lock) before it looks at or changes anything, and `train.overwrite=true`
removes only what a vlforge run writes there (`RUN_FILES`, `is_run_entry`).
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import re
import shutil
import tempfile
import time
from pathlib import Path

import torch
import yaml

from vlforge.config import ConfigError
from vlforge.train.checkpoint import CKPT_RE, TMP_PREFIX, list_checkpoints
from vlforge.train.manifest import MANIFEST, checksum_problem, read_manifest, size_problem, written_by_a_run

LOCK_NAME = ".vlforge.lock"
SUPERSEDED_PREFIX = "superseded-"
# Files a run writes at the top of output_dir (recipes, train/metrics.py, train/evaluate.py); with
# checkpoint-STEP/, .tmp-checkpoint-*/, superseded-*/ and TensorBoard's events they are all it writes.
RUN_FILES = frozenset({"config.yaml", "metrics.jsonl", "metrics.jsonl.tmp", "eval.json", "eval.json.tmp",
                       "loss.png", "reward.png", LOCK_NAME})
TENSORBOARD_DIR = "tensorboard"  # MetricsLog's SummaryWriter directory
SAMPLES_DIR = "samples"  # train/samples.py's sample logs and thumbnails
_TB_EVENTS = re.compile(r"^events\.out\.tfevents\.")


# ----------------------------------------------------------------------------- compile caches

CACHE_ENV = "VLFORGE_CACHE"
# torch's persistent compile caches (torch docs, "Compile Time Caching in torch.compile"): Inductor's
# FX-graph and AOTAutograd caches, and Triton's compiled kernels, each under the cache directory
COMPILE_CACHES = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}


def cache_root(env=os.environ) -> Path:
    """vlforge's cache directory: $VLFORGE_CACHE, else ~/.cache/vlforge."""
    return Path(env.get(CACHE_ENV) or "~/.cache/vlforge").expanduser()


def use_compile_caches(env=os.environ) -> dict[str, str]:
    """Keep torch's compile caches under cache_root (a variable the user set wins), so that a second
    run of the same recipe on the same machine loads its compiled graphs and kernels instead of
    compiling them again (torch's default, a temporary directory, may be cleared between runs); one
    place to see and clear. Set once at process start, before anything compiles; returns each
    variable's directory."""
    try:  # a private helper of torch's (torch 2.14 has it); a torch without it: only unset variables are ours
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
        torch_default = default_cache_dir()
    except (ImportError, AttributeError):
        torch_default = None
    root = cache_root(env)
    for var, sub in COMPILE_CACHES.items():
        # importing torch._dynamo writes torch's default into the environment (torch 2.14): that is not the user's
        if not env.get(var) or (var == "TORCHINDUCTOR_CACHE_DIR" and env[var] == torch_default):
            env[var] = str(root / sub)
    return {var: env[var] for var in COMPILE_CACHES}


def cache_note(dirs: dict[str, str], env=os.environ) -> str:
    """The line a command prints about where its compile caches live."""
    root = cache_root(env)
    own = all(Path(d).parent == root for d in dirs.values())
    where = str(root) if own else ", ".join(f"{var}={d}" for var, d in dirs.items())
    return (f"compile caches: {where}" + (f" ({CACHE_ENV}; delete it to clear them)" if own else
                                          " (set in the environment)"))


def directory_bytes(path: Path) -> int:
    """Bytes of the files under `path` (0 when it does not exist)."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()) if Path(path).exists() else 0


# ----------------------------------------------------------------------------- device, workers, seeds


def choose_device(spec: str, cuda_available: bool, gpu_count: int, key: str = "train.device",
                  mps_available: bool = False) -> tuple[torch.device | None, tuple[str, str] | None]:
    """The device `spec` (auto | cpu | cuda | cuda:N | mps) names on a machine with `gpu_count`
    visible GPUs: (device, None), or (None, (detail, advice)) when it cannot be used here.

    Pure, so that `vlforge doctor` can report the problem and go on checking, and tests can ask
    about machines they do not run on. `auto` and `cuda` mean torch's current CUDA device.
    """
    if spec == "auto":
        return torch.device("cuda" if cuda_available and gpu_count else "cpu"), None
    try:
        device = torch.device(spec)
    except (RuntimeError, ValueError):
        return None, (f"{key}={spec} is not a device", f"use {key}=auto, cpu, cuda, cuda:N or mps")
    if device.type == "cuda":
        if not cuda_available or gpu_count == 0:
            return None, (f"{key}={spec} but no CUDA GPU is visible", f"use {key}=cpu or auto, or run where "
                          "torch sees a GPU (`vlforge doctor` says why it does not)")
        if device.index is not None and device.index >= gpu_count:
            return None, (f"{key}={spec} but only {gpu_count} GPU(s) are visible",
                          f"use {key}=cuda:0 .. cuda:{gpu_count - 1}, or auto")
    elif device.type == "mps" and not mps_available:
        return None, (f"{key}={spec} but MPS (Apple GPU) is not available", f"use {key}=cpu or auto")
    elif device.type not in ("cpu", "cuda", "mps"):
        return None, (f"{key}={spec}: vlforge runs on cpu, cuda or mps", f"use {key}=auto, cpu, cuda or cuda:N")
    return device, None


def resolve_device(spec: str, key: str = "train.device") -> torch.device:
    """choose_device on this machine; a device it cannot use is a ConfigError."""
    available = torch.cuda.is_available()
    device, problem = choose_device(spec, available, torch.cuda.device_count() if available else 0, key,
                                    torch.backends.mps.is_available())
    if problem:
        raise ConfigError(f"{problem[0]}; {problem[1]}")
    return device


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask: a container or `taskset` may give fewer than the machine has)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def resolve_num_workers(spec: int | str, device: torch.device) -> int:
    """data.num_workers as a count of DataLoader worker processes.

    auto: none when training on the CPU (workers would take cores from the training math, and CPU
    runs are small), else one per spare CPU up to 4, one CPU staying with the training loop itself
    (more workers than CPUs only makes the DataLoader warn and the processes contend).
    """
    if spec != "auto":
        return int(spec)
    if device.type == "cpu":
        return 0
    return max(0, min(4, usable_cpus() - 1))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


# ----------------------------------------------------------------------------- the output-directory lock


class OutputDirLock:
    """An exclusive POSIX record lock (`lockf`) on output_dir/.vlforge.lock, the holder's pid written
    in the file.

    The kernel drops it when its process exits, however it exits (SIGKILL included), so a lock file
    left by a dead process never blocks: only a live holder does. A record lock belongs to the
    process: a forked child (a DataLoader worker, which can outlive the run that started it) does
    not hold it, where a `flock`, shared with every forked copy of the descriptor, stayed held by
    the workers after the run released it (found on CUDA, where the loader forks: the next run in
    the same process on the same directory was refused as "in use"). This process never opens the
    lock file twice, so the record lock's one caveat (closing any descriptor of the file drops it)
    does not arise. (Per machine: runs on two hosts sharing a network filesystem are not kept apart.)
    """

    def __init__(self, out: Path):
        self.path = out / LOCK_NAME
        self.created = not self.path.exists()
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise ConfigError(f"train.output_dir={out}: cannot write there ({e.strerror}); "
                              "choose a writable train.output_dir") from None
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except (BlockingIOError, PermissionError):  # EAGAIN or EACCES: another process holds it
            holder = os.read(self._fd, 64).decode(errors="replace").strip() or "unknown"
            os.close(self._fd)
            raise ConfigError(f"train.output_dir={out} is in use by another run (pid {holder}, see {self.path}): "
                              "wait for it to finish or stop it, or choose another train.output_dir") from None
        os.ftruncate(self._fd, 0)
        os.write(self._fd, f"{os.getpid()}\n".encode())

    def release(self, remove: bool = False) -> None:
        if self._fd is None:
            return
        if remove:  # only for a lock file this run created in a directory it then refused
            self.path.unlink(missing_ok=True)
        os.close(self._fd)  # closing drops the lock
        self._fd = None


# Locks this process holds, by resolved output_dir. A later run in the same process (a test, the
# demo, a notebook) on the same directory reuses the lock instead of being refused by itself.
_HELD: dict[Path, OutputDirLock] = {}


def lock_output_dir(output_dir: str | Path) -> OutputDirLock:
    """Hold the output_dir lock until release_output_dir or process exit; ConfigError if another process holds it."""
    key = Path(output_dir).resolve()
    if key not in _HELD:
        _HELD[key] = OutputDirLock(Path(output_dir))
    return _HELD[key]


def release_output_dir(output_dir: str | Path, remove: bool = False) -> None:
    """Release this process's lock on output_dir (a no-op if it holds none). Call when a run ends."""
    lock = _HELD.pop(Path(output_dir).resolve(), None)
    if lock is not None:
        lock.release(remove)


# ----------------------------------------------------------------------------- the output directory


def _is_run_config(path: Path) -> bool:
    """config.yaml as dump_config writes it (every section), not some other tool's config.yaml."""
    try:
        data = yaml.safe_load(path.read_text(errors="replace"))
    except (OSError, yaml.YAMLError):
        return False
    return isinstance(data, dict) and {"model", "data", "train"} <= set(data)


def is_run_entry(p: Path) -> bool:
    """Whether an entry at the top of an output_dir is something a vlforge run writes there."""
    name = p.name
    if p.is_symlink():
        return False  # a run writes none: a link points at something of the user's
    if p.is_dir():
        if CKPT_RE.match(name):  # the manifest tells: a user's folder named checkpoint-999/ is not the run's
            return written_by_a_run(p)
        if name.startswith(SUPERSEDED_PREFIX):  # checkpoints a branch set aside, and nothing else
            return all(CKPT_RE.match(q.name) and written_by_a_run(q) for q in p.iterdir())
        if name == SAMPLES_DIR:  # train/samples.py's files and nothing else: a user's samples/ is not the run's
            return _is_samples_dir(p)
        return name.startswith(TMP_PREFIX) or name == TENSORBOARD_DIR
    if name == "config.yaml":
        return _is_run_config(p)
    return name in RUN_FILES or bool(_TB_EVENTS.match(name))


_SAMPLE_FILES = re.compile(r"^(grpo|eval)\.jsonl(\.tmp)?$")
_THUMBNAIL = re.compile(r"^[0-9a-f]{24}\.png(\.tmp)?$")


def _is_samples_dir(p: Path) -> bool:
    """samples/ as train/samples.py writes it: its two logs, and img/ of hash-named thumbnails."""
    for q in p.iterdir():
        if q.is_symlink() or not (_SAMPLE_FILES.match(q.name) and q.is_file() or q.name == "img" and q.is_dir()):
            return False
    img = p / "img"
    return not img.is_dir() or all(q.is_file() and not q.is_symlink() and _THUMBNAIL.match(q.name)
                                   for q in img.iterdir())


def _is_run(out: Path) -> bool:
    return (out / "metrics.jsonl").is_file() or _is_run_config(out / "config.yaml") or bool(list_checkpoints(out))


def _names(paths: list[Path], limit: int = 5) -> str:
    shown = ", ".join(p.name + ("/" if p.is_dir() else "") for p in paths[:limit])
    return shown + (f" and {len(paths) - limit} more" if len(paths) > limit else "")


def _make_dir(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise ConfigError(f"train.output_dir={out} is a file, not a directory; choose a directory path")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):  # writable? (read-only filesystem, no permission)
            pass
    except OSError as e:
        raise ConfigError(f"train.output_dir={out}: cannot write there ({e.strerror}); "
                          "choose a writable train.output_dir") from None


def _set_aside_later_checkpoints(out: Path, step: int) -> None:
    """Going back to an older checkpoint branches the run: checkpoints past it belong to the
    abandoned branch. Left in place, keep_last would prune the new branch's checkpoints before
    them and resume=auto would pick them up; deleting them would destroy results. They move to
    output_dir/superseded-STEP-TIME/."""
    later = [p for p in list_checkpoints(out) if int(p.name.split("-")[1]) > step]
    if not later:
        return
    aside = out / f"{SUPERSEDED_PREFIX}{step}-{time.strftime('%Y%m%d-%H%M%S')}"
    aside.mkdir()
    for p in later:
        p.rename(aside / p.name)
    print(f"resuming from step {step}: moved {len(later)} later checkpoint(s) to {aside}")


def _remove_run_entries(entries: list[Path]) -> None:
    for p in entries:
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()


def _newest_intact(out: Path) -> Path | None:
    """train.resume=auto's checkpoint: the newest intact one. Sizes of every checkpoint against its
    manifest (a stat each), then the checksums of the newest with the right sizes, the next one if
    those fail; a damaged checkpoint is skipped with a warning naming its file. Newer damaged ones
    are set aside (kept): left in place, keep_last's rotation would count them as the newest and
    prune the checkpoints the resumed run writes. None when the run has no checkpoint; every one
    damaged is a ConfigError."""
    checkpoints = list_checkpoints(out)
    damaged = {p: problem for p in checkpoints if (problem := size_problem(p))}
    chosen = None
    for p in reversed([p for p in checkpoints if p not in damaged]):
        if not (problem := checksum_problem(p)):
            chosen = p
            break
        damaged[p] = problem
    for p, problem in sorted(damaged.items(), key=lambda item: _step(item[0])):
        print(f"warning: train.resume=auto: skipping {p}, which is damaged: {problem}")
    if chosen is None:
        if damaged:
            names = _names(sorted(damaged, key=_step))
            raise ConfigError(f"train.resume=auto: every checkpoint in {out} is damaged ({names}, above); restore "
                              "one from a copy, or start afresh with train.resume=never and train.overwrite=true")
        return None
    if read_manifest(chosen) is None:
        print(f"note: {chosen} has no {MANIFEST} (saved before vlforge wrote one): its files are not verified")
    if any(_step(p) > _step(chosen) for p in damaged):
        _set_aside_later_checkpoints(out, _step(chosen))
    return chosen


def _step(checkpoint: Path) -> int:
    return int(CKPT_RE.match(checkpoint.name).group(1))


def _explicit_checkpoint(resume: str) -> Path:
    """train.resume=PATH, verified: sizes and checksums against its manifest; a damaged one is refused."""
    ckpt = Path(resume)
    if not (ckpt / "trainer_state.json").is_file() and not (ckpt / MANIFEST).is_file():
        raise ConfigError(f"train.resume={resume}: not a complete checkpoint directory (no trainer_state.json)")
    if problem := checksum_problem(ckpt):
        raise ConfigError(f"train.resume={resume}: the checkpoint is damaged: {problem}. Resume from another "
                          "checkpoint (train.resume=auto picks the newest intact one)")
    if read_manifest(ckpt) is None:
        print(f"note: {ckpt} has no {MANIFEST} (saved before vlforge wrote one): its files are not verified")
    return ckpt


def prepare_output_dir(output_dir: str | Path, resume: str, overwrite: bool) -> Path | None:
    """Create, lock and validate output_dir, before any model loads. Returns the checkpoint to resume from, if any.

    The lock is held until `release_output_dir(output_dir)` or the process exits. A non-empty
    output_dir is refused unless resuming or overwriting: a run never silently replaces another
    run's results; overwrite removes only what a run wrote, and refuses a directory holding
    anything else; resume=auto refuses a directory that is not a run, and resumes from the newest
    intact checkpoint; a damaged one named by train.resume is refused.
    """
    out = Path(output_dir)
    ckpt = _explicit_checkpoint(resume) if resume not in ("auto", "never") else None
    _make_dir(out)
    lock = lock_output_dir(out)
    try:
        if ckpt is not None:
            _set_aside_later_checkpoints(out, json.loads((ckpt / "trainer_state.json").read_text())["step"])
            return ckpt
        entries = sorted(p for p in out.iterdir() if p.name != LOCK_NAME)
        if not entries:
            return None
        foreign = [p for p in entries if not is_run_entry(p)]
        if resume == "auto":
            if not _is_run(out):
                raise ConfigError(
                    f"train.resume=auto: train.output_dir={out} is not a vlforge run (no config.yaml, metrics.jsonl "
                    f"or checkpoint-STEP/; it holds {_names(entries)}); choose a new or empty train.output_dir")
            return _newest_intact(out)
        if not overwrite:
            raise ConfigError(
                f"train.output_dir={out} is not empty (another run's results?). Pass train.resume=auto to continue "
                "it, train.overwrite=true to replace it, or choose another train.output_dir.")
        if foreign:
            raise ConfigError(
                f"train.overwrite=true removes only what a vlforge run wrote, but train.output_dir={out} also holds "
                f"{_names(foreign)}; move those out or choose another train.output_dir (nothing was removed)")
        _remove_run_entries(entries)
        return None
    except ConfigError:
        # Refused: no lock stays behind, and no lock file in a directory that is not a run's.
        release_output_dir(out, remove=lock.created and not _is_run(out))
        raise
