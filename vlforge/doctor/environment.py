"""The doctor's environment checks, and `Check`, the one finding every check returns.

The facts are read without changing anything (nvidia-smi, torch's CUDA and torch.distributed
probes, the launch variables; nothing is initialised) into collect_environment's dict, which the
checks read: Python, torch and the CUDA runtime it was built with, the NVIDIA driver, transformers
and peft against vlforge's minimum versions. The small helpers here (versions, quiet imports, one
line of an error) serve every doctor module.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import logging
import os
import platform
import shutil
import subprocess
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Literal

import torch

Status = Literal["ok", "warn", "fail", "skip"]
STATUSES: tuple[str, ...] = ("ok", "warn", "fail", "skip")

# Minimum versions, kept in step with pyproject.toml (pip enforces them at install time, but
# environments drift: a later `pip install` of something else can downgrade them).
MIN_PYTHON = (3, 11)
MIN_VERSIONS = {"torch": "2.6", "transformers": "5.17", "peft": "0.17"}

# Oldest Linux driver that runs each CUDA major version (minor-version compatibility), from
# NVIDIA's CUDA compatibility table: with an older driver torch sees no GPU at all.
MIN_DRIVER_FOR_CUDA = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}

# What torchrun sets in every process it starts (and what torch.distributed's env:// rendezvous reads)
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class Check:
    """One finding. `values` holds structured data for --json (versions, errors, measurements)."""

    name: str
    status: Status
    detail: str
    advice: str = ""
    values: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "detail": self.detail, "advice": self.advice,
                **self.values}


# ----------------------------------------------------------------------------- small helpers


def version_tuple(version: str) -> tuple[int, ...]:
    """Leading numeric release of a version string: '2.14.1+cu130' -> (2, 14, 1), '5.17.0rc1' -> (5, 17, 0)."""
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        parts.append(int(digits))
        if digits != piece:  # a pre-release tail ends the release part
            break
    return tuple(parts)


def at_least(version: str | None, minimum: str) -> bool:
    return version is not None and version_tuple(version) >= version_tuple(minimum)


def dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence import-time warnings/log lines of third-party libraries: they are not doctor output."""
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(logging.NOTSET)


def try_import(module: str) -> str | None:
    """None when `module` imports, else the error. Every Exception counts: a broken extension
    raises OSError or RuntimeError as often as ImportError."""
    try:
        with _quiet():
            importlib.import_module(module)
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}".strip()
    return None


def one_line(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ----------------------------------------------------------------------------- facts


def nvidia_driver() -> tuple[str | None, str | None]:
    """(driver version, error) from nvidia-smi; (None, None) when nvidia-smi is not installed."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None, None
    try:
        out = subprocess.run([exe, "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return None, one_line(f"{type(e).__name__}: {e}")
    lines = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    if out.returncode != 0 or not lines:
        return None, one_line(out.stderr or out.stdout or f"nvidia-smi exited with {out.returncode}")
    return lines[0], None


def cuda_probe() -> tuple[bool, int, str | None]:
    """(CUDA usable, visible GPU count, torch's initialisation warning if any).

    torch only *warns* when CUDA fails to initialise (driver too old, no device) and then reports
    no GPU; that warning is the most useful line the doctor can show, so it is captured here.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = torch.cuda.is_available()
        count = torch.cuda.device_count() if available else 0
    message = next((one_line(str(w.message)) for w in caught if "CUDA" in str(w.message)), None)
    return available, count, message


def distributed_probe(cuda_available: bool) -> dict[str, Any]:
    """torch.distributed's backends in this torch build (nothing is initialised)."""
    dist = torch.distributed.is_available()
    nccl = dist and torch.distributed.is_nccl_available()
    nccl_version = None
    if nccl and cuda_available:
        try:
            v = torch.cuda.nccl.version()
            nccl_version = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception:  # noqa: BLE001 - a version we cannot read is not a failure
            nccl_version = None
    return {"_distributed": dist, "_nccl": nccl, "_nccl_version": nccl_version,
            "_gloo": dist and torch.distributed.is_gloo_available()}


def collect_environment() -> dict[str, Any]:
    driver, driver_error = nvidia_driver()
    available, count, cuda_warning = cuda_probe()
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "driver": driver,
        "transformers": dist_version("transformers"),
        "peft": dist_version("peft"),
        # below: not part of the report's "environment" section, used by the checks
        "_driver_error": driver_error,
        "_cuda_available": available,
        "_gpu_count": count,
        "_cuda_warning": cuda_warning,
        "_hip": getattr(torch.version, "hip", None),
        **distributed_probe(available),
        "_launch": {k: os.environ[k] for k in LAUNCH_VARS if k in os.environ},
    }


# ----------------------------------------------------------------------------- checks


def version_checks(env: dict[str, Any], expect_cuda: bool) -> list[Check]:
    checks = []
    py = env["python"]
    if version_tuple(py) >= MIN_PYTHON:
        checks.append(Check("python", "ok", py, values={"version": py}))
    else:
        checks.append(Check("python", "fail", f"{py} (vlforge needs >= {MIN_PYTHON[0]}.{MIN_PYTHON[1]})",
                            f"use Python >= {MIN_PYTHON[0]}.{MIN_PYTHON[1]} (e.g. a new venv or conda env)",
                            {"version": py}))

    tv = env["torch"]
    if at_least(tv, MIN_VERSIONS["torch"]):
        checks.append(Check("torch", "ok", tv, values={"version": tv}))
    else:
        checks.append(Check("torch", "fail", f"{tv} (vlforge needs >= {MIN_VERSIONS['torch']})",
                            f'pip install -U "torch>={MIN_VERSIONS["torch"]}" (a CUDA build: see '
                            "https://pytorch.org/get-started/locally/)", {"version": tv}))

    cuda, hip = env["cuda"], env.get("_hip")
    if cuda:
        checks.append(Check("cuda runtime", "ok", f"torch built with CUDA {cuda}", values={"version": cuda}))
    elif hip:
        checks.append(Check("cuda runtime", "warn", f"torch built with ROCm/HIP {hip}, not CUDA",
                            "vlforge is tested on NVIDIA GPUs only; FP8 and flash-attn checks assume CUDA",
                            {"version": None}))
    elif expect_cuda:
        checks.append(Check("cuda runtime", "warn", "this torch is a CPU-only build: it cannot use a GPU",
                            "install a CUDA build of torch: https://pytorch.org/get-started/locally/ "
                            "(e.g. pip install torch --index-url https://download.pytorch.org/whl/cu128)",
                            {"version": None}))
    else:
        checks.append(Check("cuda runtime", "ok", "none (CPU-only torch build)", values={"version": None}))

    checks.append(_driver_check(env, expect_cuda))

    for lib in ("transformers", "peft"):
        version, minimum = env[lib], MIN_VERSIONS[lib]
        if at_least(version, minimum):
            checks.append(Check(lib, "ok", version, values={"version": version}))
        else:
            found = version if version else "not installed"
            checks.append(Check(lib, "fail", f"{found} (vlforge needs >= {minimum})",
                                f'pip install -U "{lib}>={minimum}"', {"version": version}))
    return checks


def _driver_check(env: dict[str, Any], expect_cuda: bool) -> Check:
    driver, cuda = env["driver"], env["cuda"]
    values = {"version": driver}
    if driver is None:
        if env.get("_driver_error"):
            return Check("nvidia driver", "warn" if expect_cuda else "skip",
                         f"nvidia-smi failed: {env['_driver_error']}",
                         "reinstall or reload the NVIDIA driver (a driver/library version mismatch "
                         "usually needs a reboot)", values)
        if expect_cuda and not env.get("_hip"):
            return Check("nvidia driver", "warn", "nvidia-smi not found: driver version unknown",
                         "install the NVIDIA driver (nvidia-smi comes with it) or put nvidia-smi on PATH",
                         values)
        return Check("nvidia driver", "skip", "nvidia-smi not found (no NVIDIA driver; not needed on CPU)",
                     values=values)
    major = version_tuple(cuda)[0] if cuda and version_tuple(cuda) else None
    minimum = MIN_DRIVER_FOR_CUDA.get(major) if major else None
    if minimum and not at_least(driver, minimum):
        return Check("nvidia driver", "warn", f"{driver} is older than CUDA {cuda} needs (>= {minimum})",
                     f"upgrade the NVIDIA driver to >= {minimum}, or install a torch built for an older "
                     "CUDA that this driver runs (https://pytorch.org/get-started/locally/)",
                     {**values, "min_for_cuda": minimum})
    if cuda and not env.get("_cuda_available"):
        why = env.get("_cuda_warning") or "torch.cuda.is_available() is False"
        return Check("nvidia driver", "warn", f"{driver}, but torch (CUDA {cuda}) sees no GPU: {why}",
                     "check CUDA_VISIBLE_DEVICES and that this process may use the GPU "
                     "(container: --gpus all)", values)
    return Check("nvidia driver", "ok", driver, values=values)


def cache_checks(env=None) -> list[Check]:
    """Where torch's compile caches go for vlforge's commands (train/runtime.use_compile_caches) and
    their size: the second run of a recipe reuses them; deleting the directory clears them."""
    from vlforge.train.runtime import CACHE_ENV, cache_root, directory_bytes, use_compile_caches

    env = dict(os.environ if env is None else env)  # a copy: the doctor compiles nothing
    dirs = use_compile_caches(env)
    sizes = {var: directory_bytes(Path(d)) for var, d in dirs.items()}
    root = cache_root(env)
    detail = f"{root} ({sum(sizes.values()) / 1e6:.1f} MB)" + "".join(
        f"; {var}={d} (set in the environment, {sizes[var] / 1e6:.1f} MB)" for var, d in dirs.items()
        if Path(d).parent != root)
    return [Check("compile cache", "ok", detail, advice=f"set {CACHE_ENV} to move it; delete the directory to clear it",
                  values={"path": str(root), "bytes": sum(sizes.values()), **dirs})]

