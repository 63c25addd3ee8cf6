"""`vlforge doctor`: is this machine ready to train, and if not, what to do about it.

A training run that dies after ten minutes of model loading because the driver is too old, the
GPU has no FP8 tensor cores or flash-attn was built against another torch wastes a GPU slot and
a person's patience. The doctor finds those problems up front, in one command:

- the environment (Python, torch and the CUDA runtime it was built with, the NVIDIA driver,
  transformers, peft) against vlforge's minimum versions;
- every visible GPU (memory, compute capability, bf16/FP8 support) and a small real matmul on
  each in bf16 and, where supported, FP8, compared against fp32: an installed but broken CUDA
  stack shows up here rather than as NaN losses later;
- the optional libraries (torchao, bitsandbytes, TransformerEngine, flash-attn, Liger, PyAV), each
  actually imported, since an extension built against another torch installs fine and then
  fails at import;
- multi-GPU plumbing (torch.distributed, NCCL, gloo) and the torchrun launch this process is in
  (RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE / MASTER_ADDR / MASTER_PORT, one GPU per
  process);
- with a recipe (`--config` + overrides): what that recipe needs (device, bf16, FP8 and its
  backend, flash-attention, a local model directory, the optimizer), failed when this machine
  cannot give it, and what its `distributed` section does in this launch (the strategy as
  engine/distributed.init_world resolves it, and what is refused under FSDP2).

Each finding is a `Check` (ok | warn | fail | skip, a detail, and advice saying what to do).
`run_checks` returns a JSON-able report; `format_report` renders it for people. Only "fail"
makes the command exit non-zero: warnings are things worth knowing that do not stop a run.
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
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Literal

import torch

from vlforge.config import ConfigError, GRPOConfig, SFTConfig
from vlforge.engine.hardware import bf16_problem, capability, fp8_problem
from vlforge.engine.runtime import choose_device

Status = Literal["ok", "warn", "fail", "skip"]
STATUSES: tuple[str, ...] = ("ok", "warn", "fail", "skip")

# Minimum versions, kept in step with pyproject.toml (pip enforces them at install time, but
# environments drift: a later `pip install` of something else can downgrade them).
MIN_PYTHON = (3, 11)
MIN_VERSIONS = {"torch": "2.6", "transformers": "5.17", "peft": "0.17"}

# Oldest Linux driver that runs each CUDA major version (minor-version compatibility), from
# NVIDIA's CUDA compatibility table: with an older driver torch sees no GPU at all.
MIN_DRIVER_FOR_CUDA = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}

BF16_TOLERANCE = 2e-2  # bf16 keeps 8 significant bits: <= 0.4% rounding per operand
FP8_TOLERANCE = 0.1  # e4m3 keeps 4: <= 6% per element, averaging down over the 256-term sums
MATMUL_SIZE = 256  # a multiple of 16, as FP8 tensor cores require

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


@dataclass(frozen=True)
class Library:
    name: str  # import name
    distributions: tuple[str, ...]  # pip distribution names to read the version from
    install: str  # the command that installs it
    purpose: str


LIBRARIES = (
    Library("torchao", ("torchao",), 'pip install "vlforge[fp8]"', "FP8 training with precision.fp8.backend=torchao"),
    Library("bitsandbytes", ("bitsandbytes",), 'pip install "vlforge[quant]"', "quantised base weights"),
    Library("transformer_engine", ("transformer-engine", "transformer_engine"),
            'pip install "vlforge[te]" (or pip install --no-build-isolation "transformer_engine[pytorch]")',
            "FP8 training with precision.fp8.backend=te"),
    Library("flash_attn", ("flash-attn", "flash_attn"), "pip install flash-attn --no-build-isolation",
            "model.attn_implementation=flash_attention_2"),
    Library("liger_kernel", ("liger-kernel", "liger_kernel"), "pip install liger-kernel", "fused Triton kernels"),
    Library("av", ("av",), 'pip install "vlforge[video]"', "video files in data rows (frame lists need nothing)"),
)
_LIBRARY = {lib.name: lib for lib in LIBRARIES}

# The module each recipe feature imports: narrower than the top-level package, so a package
# whose top level imports but whose torch extension does not is still caught.
_BACKEND_MODULE = {"torchao": "torchao.float8", "te": "transformer_engine.pytorch"}
_BACKEND_LIBRARY = {"torchao": "torchao", "te": "transformer_engine"}


# ----------------------------------------------------------------------------- small helpers


def _version_tuple(version: str) -> tuple[int, ...]:
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


def _at_least(version: str | None, minimum: str) -> bool:
    return version is not None and _version_tuple(version) >= _version_tuple(minimum)


def _dist_version(*names: str) -> str | None:
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


def _try_import(module: str) -> str | None:
    """None when `module` imports, else the error. Every Exception counts: a broken extension
    raises OSError or RuntimeError as often as ImportError."""
    try:
        with _quiet():
            importlib.import_module(module)
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}".strip()
    return None


def _one_line(text: str, limit: int = 300) -> str:
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
        return None, _one_line(f"{type(e).__name__}: {e}")
    lines = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    if out.returncode != 0 or not lines:
        return None, _one_line(out.stderr or out.stdout or f"nvidia-smi exited with {out.returncode}")
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
    message = next((_one_line(str(w.message)) for w in caught if "CUDA" in str(w.message)), None)
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
        "transformers": _dist_version("transformers"),
        "peft": _dist_version("peft"),
        # below: not part of the report's "environment" section, used by the checks
        "_driver_error": driver_error,
        "_cuda_available": available,
        "_gpu_count": count,
        "_cuda_warning": cuda_warning,
        "_hip": getattr(torch.version, "hip", None),
        **distributed_probe(available),
        "_launch": {k: os.environ[k] for k in LAUNCH_VARS if k in os.environ},
    }


def collect_gpus(cuda_available: bool) -> list[dict[str, Any]]:
    if not cuda_available:
        return []
    gpus = []
    for index in range(torch.cuda.device_count()):
        device = torch.device("cuda", index)
        props = torch.cuda.get_device_properties(index)
        cap = capability(device)
        gpus.append({
            "index": index,
            "name": props.name,
            "memory_gb": round(props.total_memory / 2**30, 1),  # GiB, as nvidia-smi's MiB / 1024
            "capability": f"{cap[0]}.{cap[1]}" if cap else None,
            "bf16": bf16_problem(device) is None,
            "fp8": fp8_problem(device) is None,
        })
    return gpus


def collect_libraries() -> dict[str, dict[str, Any]]:
    libs = {}
    for lib in LIBRARIES:
        error = _try_import(lib.name)
        version = _dist_version(*lib.distributions)
        if version is None and error is None:
            version = getattr(sys.modules.get(lib.name), "__version__", None)
        libs[lib.name] = {"available": error is None, "version": version, "error": error}
    return libs


# ----------------------------------------------------------------------------- recipe


@dataclass
class Recipe:
    """What a training config asks of the machine."""

    config: str | None
    device_spec: str  # train.device as written
    device: torch.device | None  # what it resolves to here; None when it cannot
    device_problem: tuple[str, str] | None  # (detail, advice)
    bf16: bool
    fp8_backend: str | None  # "torchao" | "te" when precision.fp8.enabled
    flash_attn: bool
    model_path: str | None
    quant: frozenset[str] = frozenset()  # quant methods in use: nf4 / int8 (bitsandbytes), fp8 (torchao)
    loss_impl: str = "auto"  # loss.impl: liger needs liger-kernel and CUDA (and SFT: GRPO refuses it)
    grpo: bool = False
    packing: bool | str = False  # data.packing (SFT): auto packs where the varlen flash kernel runs
    precision_mode: str = "bf16"
    attn_implementation: str = "sdpa"
    packed_attention: str = "per_sample"
    cuda_graphs_detail: str | None = None  # precision.cuda_graphs: what it graphs here, or why it is refused
    cuda_graphs_ok: bool = True
    tools: str | None = None  # GRPO rollout.tools: the tools loaded, or why they cannot run
    tools_ok: bool | None = True  # None: not checked (the model's processor did not load)

    @property
    def needs(self) -> list[str]:
        needs = ["device"]
        if self.bf16:
            needs.append("bf16")
        if self.fp8_backend:
            needs += ["fp8", _BACKEND_LIBRARY[self.fp8_backend]]
        if self.quant & {"nf4", "int8"}:
            needs.append("bitsandbytes")
        if "fp8" in self.quant:
            needs += ["quant fp8", "torchao"]
        if self.flash_attn:
            needs.append("flash_attn")
        if self.model_path:
            needs.append("model.path")
        return needs


def recipe_from_config(cfg: SFTConfig | GRPOConfig, config: str | None, cuda_available: bool,
                       gpu_count: int) -> Recipe:
    device, problem = choose_device(cfg.train.device, cuda_available, gpu_count)
    graphs, graphs_ok = None, True
    if cfg.precision.cuda_graphs and device is not None:  # the refusal setup_model makes before loading
        from vlforge.engine.trainable import cuda_graphs_problem

        graphs = cuda_graphs_problem(cfg, device)
        graphs_ok = graphs is None
        graphs = graphs or ("precision.cuda_graphs: the compiled decoder layers"
                            + (" and vision blocks" if cfg.precision.cuda_graphs_vision else "")
                            + " replay as CUDA graphs, on packed rows padded to multiples of 256 tokens")
    tools, tools_ok = None, True
    if isinstance(cfg, GRPOConfig) and cfg.rollout.tools:  # run_grpo's check, before any model loads
        from vlforge.rl.tools import ToolCall, ToolProcesses
        from vlforge.rollout.multiturn import rollout_tools

        try:
            loaded = rollout_tools(cfg)
            if cfg.rollout.tool_processes:  # a worker process loads them as the run's will (one call through it)
                with ToolProcesses(loaded, 1) as run:
                    run([[ToolCall(None, {}, "a doctor check")]], loaded, 60.0)
            tools = (f"rollout.tools: {', '.join(loaded)} (the chat template renders their turns"
                     + ("; a worker process loads them" if cfg.rollout.tool_processes else "") + ")")
        except ConfigError as e:
            if not str(e).startswith("rollout.tools"):  # the model's processor did not load: "recipe model.path" says why
                tools, tools_ok = f"rollout.tools: the chat template not checked ({e})", None
            else:
                tools, tools_ok = str(e), False
    return Recipe(
        config=config,
        device_spec=cfg.train.device,
        device=device,
        device_problem=problem,
        bf16=cfg.precision.mode == "bf16",
        fp8_backend=cfg.precision.fp8.backend if cfg.precision.fp8.enabled else None,
        flash_attn=cfg.model.attn_implementation == "flash_attention_2",
        model_path=cfg.model.path,
        quant=frozenset({cfg.quant.language, cfg.quant.vision, cfg.quant.projector, cfg.quant.expert_method} - {"none"}),
        loss_impl=cfg.loss.impl,
        grpo=isinstance(cfg, GRPOConfig),
        packing=False if isinstance(cfg, GRPOConfig) else cfg.data.packing,  # GRPO packs by rl.packing
        attn_implementation=cfg.model.attn_implementation,
        packed_attention=cfg.model.packed_attention,
        precision_mode=cfg.precision.mode,
        cuda_graphs_detail=graphs,
        cuda_graphs_ok=graphs_ok,
        tools=tools,
        tools_ok=tools_ok,
    )


# ----------------------------------------------------------------------------- checks


def version_checks(env: dict[str, Any], expect_cuda: bool) -> list[Check]:
    checks = []
    py = env["python"]
    if _version_tuple(py) >= MIN_PYTHON:
        checks.append(Check("python", "ok", py, values={"version": py}))
    else:
        checks.append(Check("python", "fail", f"{py} (vlforge needs >= {MIN_PYTHON[0]}.{MIN_PYTHON[1]})",
                            f"use Python >= {MIN_PYTHON[0]}.{MIN_PYTHON[1]} (e.g. a new venv or conda env)",
                            {"version": py}))

    tv = env["torch"]
    if _at_least(tv, MIN_VERSIONS["torch"]):
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
        if _at_least(version, minimum):
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
    major = _version_tuple(cuda)[0] if cuda and _version_tuple(cuda) else None
    minimum = MIN_DRIVER_FOR_CUDA.get(major) if major else None
    if minimum and not _at_least(driver, minimum):
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


def gpu_checks(env: dict[str, Any], gpus: list[dict[str, Any]]) -> list[Check]:
    if not gpus:
        detail = "no CUDA GPU visible: training runs on the CPU (slow)"
        if env.get("_cuda_warning"):
            detail += f" [{env['_cuda_warning']}]"
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None and visible.strip() in ("", "-1"):
            advice = f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU: unset it to use them"
        elif not env["cuda"]:
            advice = ("fine for `vlforge demo` and tests; for real models use an NVIDIA GPU (bf16 needs "
                      "compute capability >= 8.0, FP8 >= 8.9) and a CUDA build of torch")
        else:
            advice = ("fine for `vlforge demo` and tests; for real models use a machine with an NVIDIA GPU "
                      "(bf16 needs compute capability >= 8.0, FP8 >= 8.9) and its driver")
        return [Check("gpu", "warn", detail, advice, {"count": 0})]
    checks = []
    for gpu in gpus:
        device = torch.device("cuda", gpu["index"])
        detail = (f"{gpu['name']}, {gpu['memory_gb']} GiB, compute capability {gpu['capability']}, "
                  f"bf16 {'yes' if gpu['bf16'] else 'no'}, fp8 {'yes' if gpu['fp8'] else 'no'}")
        values = {k: gpu[k] for k in ("index", "memory_gb", "capability", "bf16", "fp8")}
        problem = bf16_problem(device)
        if problem:  # most recipes default to bf16: worth a warning even before a recipe asks
            checks.append(Check(f"gpu {gpu['index']}", "warn", detail, problem, values))
        else:
            checks.append(Check(f"gpu {gpu['index']}", "ok", detail, values=values))
    return checks


def _rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def _operands(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(MATMUL_SIZE, MATMUL_SIZE, device=device, generator=gen)
    b = torch.randn(MATMUL_SIZE, MATMUL_SIZE, device=device, generator=gen)
    # TF32 would make the fp32 reference itself a ~1e-3 approximation
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        ref = a @ b
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return a, b, ref


def bf16_matmul_error(device: torch.device) -> float:
    """Max |bf16 matmul - fp32 matmul| / max |fp32 matmul| for 256x256 random operands."""
    a, b, ref = _operands(device)
    out = a.bfloat16() @ b.bfloat16()
    return _rel_error(out, ref)


def fp8_matmul_error(device: torch.device) -> float:
    """The same with e4m3 operands through torch._scaled_mm (per-tensor scales), the kernel
    torchao's tensorwise FP8 training runs."""
    a, b, ref = _operands(device)
    fp8 = torch.float8_e4m3fn
    fp8_max = torch.finfo(fp8).max
    # _scaled_mm multiplies by these scales, so they are the dequantisation factors amax / fp8_max
    scale_a = (a.abs().max() / fp8_max).float()
    scale_b = (b.abs().max() / fp8_max).float()
    a8 = (a / scale_a).to(fp8)
    b8 = (b / scale_b).to(fp8).t().contiguous().t()  # the second operand must be column-major
    out = torch._scaled_mm(a8, b8, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)
    return _rel_error(out, ref)


def _numeric_check(name: str, fn, device: torch.device, tolerance: float, advice: str) -> Check:
    try:
        error = fn(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as e:  # noqa: BLE001
        return Check(name, "fail", f"raised {_one_line(f'{type(e).__name__}: {e}')}", advice,
                     {"max_rel_error": None, "tolerance": tolerance})
    values = {"max_rel_error": error, "tolerance": tolerance}
    if error == error and error < tolerance:  # error == error: NaN fails
        return Check(name, "ok", f"max relative error {error:.1e} vs fp32 (< {tolerance:g})", values=values)
    return Check(name, "fail", f"max relative error {error:.3g} vs fp32 (needs < {tolerance:g})", advice, values)


def numeric_checks(gpus: list[dict[str, Any]]) -> list[Check]:
    if not gpus:
        reason = "no GPU: the numeric tests run on GPUs only"
        advice = "run vlforge doctor on the GPU machine that will train"
        return [Check("bf16 matmul", "skip", reason, advice), Check("fp8 matmul", "skip", reason, advice)]
    checks = []
    for gpu in gpus:
        i = gpu["index"]
        device = torch.device("cuda", i)
        if gpu["bf16"]:
            checks.append(_numeric_check(
                f"gpu {i} bf16 matmul", bf16_matmul_error, device, BF16_TOLERANCE,
                "this GPU's bf16 matmul is wrong or broken: check the driver/CUDA versions above, "
                "or train with precision.mode=fp32 on it"))
        else:
            checks.append(Check(f"gpu {i} bf16 matmul", "skip", "no bf16 tensor cores", bf16_problem(device) or ""))
        if gpu["fp8"]:
            checks.append(_numeric_check(
                f"gpu {i} fp8 matmul", fp8_matmul_error, device, FP8_TOLERANCE,
                "FP8 matmuls (torch._scaled_mm) fail here: update torch and the driver, or set "
                "precision.fp8.enabled=false"))
        else:
            checks.append(Check(f"gpu {i} fp8 matmul", "skip",
                                f"compute capability {gpu['capability']} has no FP8 tensor cores (needs >= 8.9)"))
    return checks


def te_matmul_error(device: torch.device) -> float:
    """The same through TransformerEngine: a te.Linear forward under te.autocast (current scaling,
    E4M3), the FP8 GEMM that precision.fp8.backend=te runs."""
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe

    from vlforge.engine.fp8 import te_autocast

    a, b, ref = _operands(device)
    layer = te.Linear(MATMUL_SIZE, MATMUL_SIZE, bias=False, params_dtype=torch.bfloat16, device=device)
    with torch.no_grad():
        layer.weight.copy_(b.t())  # te.Linear computes a @ weight.T
        with te_autocast(recipe.Float8CurrentScaling(fp8_format=recipe.Format.E4M3)):
            out = layer(a.bfloat16())
    return _rel_error(out, ref)


def te_checks(gpus: list[dict[str, Any]], libs: dict[str, dict[str, Any]]) -> list[Check]:
    """A real TE FP8 matmul on each FP8 GPU, once TransformerEngine imports (library_checks
    reports it missing or broken)."""
    if not libs["transformer_engine"]["available"]:
        return []
    version = libs["transformer_engine"]["version"]
    return [_numeric_check(f"gpu {gpu['index']} te fp8 matmul (transformer_engine {version})", te_matmul_error,
                           torch.device("cuda", gpu["index"]), FP8_TOLERANCE,
                           "TransformerEngine imports but its FP8 GEMM fails: rebuild transformer_engine_torch "
                           "against this torch (bench/gpu_te.sh), or use precision.fp8.backend=torchao")
            for gpu in gpus if gpu["fp8"]]


def library_checks(libs: dict[str, dict[str, Any]]) -> list[Check]:
    """Optional libraries: missing is a skip (the recipe checks fail what a recipe needs); installed
    but failing to import is a warning, since it will fail the moment a recipe uses it."""
    checks = []
    for lib in LIBRARIES:
        info = libs[lib.name]
        values = {"available": info["available"], "version": info["version"], "error": info["error"]}
        if info["available"]:
            checks.append(Check(lib.name, "ok", f"{info['version'] or 'unknown version'}, for {lib.purpose}",
                                values=values))
        elif info["version"]:
            checks.append(Check(lib.name, "warn", f"{info['version']} installed but does not import: {info['error']}",
                                f"reinstall it against this torch: pip uninstall {lib.distributions[0]} && {lib.install}",
                                values))
        else:
            checks.append(Check(lib.name, "skip", f"not installed (needed for {lib.purpose})", lib.install, values))
    return checks


@dataclass
class Launch:
    """The torchrun launch this process is in, read from LAUNCH_VARS (pure; see `parse_launch`)."""

    torchrun: bool  # RANK and WORLD_SIZE set: engine/distributed.torchrun_env() sees a launch
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int | None = None  # processes on this node; None when not set
    rendezvous: str | None = None  # MASTER_ADDR:MASTER_PORT
    problem: tuple[Status, str, str] | None = None  # (status, detail, advice) of a broken launch


_TORCHRUN_ADVICE = ("launch with torchrun (torchrun --nproc_per_node N -m vlforge sft CONFIG), which sets RANK, "
                    "WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT in every process")


def parse_launch(launch: dict[str, str]) -> Launch:
    """What the launch variables say, and what is wrong with them. `launch`: name -> value of the
    LAUNCH_VARS that are set (collect_environment's "_launch")."""
    if "RANK" not in launch or "WORLD_SIZE" not in launch:
        stray = [k for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if k in launch]
        if stray:  # torchrun_env() needs both: the run would silently be one process
            return Launch(False, problem=("warn", f"{' and '.join(stray)} set without "
                                          f"{'WORLD_SIZE' if 'RANK' in launch else 'RANK'}: vlforge runs as one process",
                                          f"{_TORCHRUN_ADVICE}; or unset {' '.join(stray)}"))
        return Launch(False)
    numbers = {}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        if key in launch:
            try:
                numbers[key] = int(launch[key])
            except ValueError:
                return Launch(True, problem=("fail", f"{key}={launch[key]!r} is not a whole number", _TORCHRUN_ADVICE))
    rank, size = numbers["RANK"], numbers["WORLD_SIZE"]
    out = Launch(True, rank, size, numbers.get("LOCAL_RANK", 0), numbers.get("LOCAL_WORLD_SIZE"),
                 f"{launch['MASTER_ADDR']}:{launch['MASTER_PORT']}" if {"MASTER_ADDR", "MASTER_PORT"} <= set(launch)
                 else None)
    if size < 1 or not 0 <= rank < size:
        out.problem = ("fail", f"RANK={rank} with WORLD_SIZE={size}: a rank must be 0 .. WORLD_SIZE-1", _TORCHRUN_ADVICE)
    elif out.rendezvous is None:
        missing = " and ".join(k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in launch)
        # one process with fsdp2 would fail at init_process_group; auto resolves to none and never meets it
        out.problem = ("fail" if size > 1 else "warn",
                       f"{missing} not set: the processes cannot meet (torch.distributed's env:// rendezvous)",
                       _TORCHRUN_ADVICE)
    elif size > 1 and "LOCAL_RANK" not in launch:
        out.problem = ("warn", "LOCAL_RANK not set: every process on a node takes GPU 0", _TORCHRUN_ADVICE)
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
                     "are one per process", _TORCHRUN_ADVICE, values)
    if launch.local_world_size > count:
        return Check("gpu per process", "fail", f"{launch.local_world_size} processes on this node but {count} "
                     "GPU(s) visible: the processes would share GPUs", advice, values)
    if launch.local_world_size < count:
        return Check("gpu per process", "warn", f"{launch.local_world_size} processes on this node, {count} GPUs: "
                     f"{count - launch.local_world_size} GPU(s) idle", advice, values)
    return Check("gpu per process", "ok", f"{count} processes on this node, one GPU each (this one: "
                 f"cuda:{launch.local_rank})", values=values)


def _split(message: str) -> tuple[str, str]:
    """A refusal's message as (what is wrong, what to do): vlforge's messages put them either side
    of the first ': '."""
    what, _, todo = message.partition(": ")
    return (what, todo) if todo else (message, "")


def distributed_recipe_checks(cfg: SFTConfig | GRPOConfig, env: dict[str, Any], recipe: Recipe) -> list[Check]:
    """What the recipe's `distributed` and `optim` sections do in this launch, refused as the run
    would refuse them (before any model loads), without initialising anything."""
    from vlforge.engine.distributed import World, refuse_unsupported
    from vlforge.engine.distributed import planned_strategy
    from vlforge.engine.optim import optimizer_problem

    launch = parse_launch(env.get("_launch", {}))
    size = launch.world_size if launch.torchrun else 1
    d = cfg.distributed
    strategy, problem = planned_strategy(d.strategy, size, cfg.train.device)
    values = {"strategy": d.strategy, "resolved": strategy, "world_size": size}
    checks = []
    if problem:
        checks.append(Check("recipe distributed", "fail", *_split(problem), values))
    elif strategy == "none":
        if d.cpu_offload:
            checks.append(Check("recipe distributed", "warn", f"distributed.strategy={d.strategy} on one process "
                                "means none: distributed.cpu_offload=true is ignored",
                                "set distributed.strategy=fsdp2 to offload on one process", values))
        else:
            checks.append(Check("recipe distributed", "ok", f"distributed.strategy={d.strategy} -> none: one "
                                "process, no sharding", values=values))
    elif strategy == "ddp":
        checks.append(Check("recipe distributed", "ok", f"distributed.strategy={d.strategy} -> ddp over {size} "
                            "process(es) (a full replica of the model and its training state on each)", values=values))
    else:
        how = ", ".join(["reshard_after_forward" if d.reshard_after_forward else "gathered weights kept after "
                         "forward", "cpu_offload" if d.cpu_offload else "no cpu offload"])
        checks.append(Check("recipe distributed", "ok", f"distributed.strategy={d.strategy} -> fsdp2 over {size} "
                            f"process(es) ({how})", values=values))
    sharded = strategy == "fsdp2"
    if sharded:
        try:
            refuse_unsupported(cfg, World(size=size, strategy=strategy))
        except ConfigError as e:
            checks.append(Check("recipe fsdp2", "fail", *_split(str(e))))
        else:
            checks.append(Check("recipe fsdp2", "ok", "nothing this recipe uses is refused under FSDP2"))
    if recipe.device is None:
        checks.append(Check("recipe optimizer", "skip", "train.device is unusable (see recipe device)"))
    elif opt := optimizer_problem(cfg.optim, recipe.device.type):
        checks.append(Check("recipe optimizer", "fail", *_split(opt), {"optimizer": cfg.optim.name}))
    else:
        checks.append(Check("recipe optimizer", "ok", f"optim.name={cfg.optim.name} runs on {recipe.device}"
                            + (" with FSDP2" if sharded else ""), values={"optimizer": cfg.optim.name}))
    return checks


def _device_feature_check(name: str, device: torch.device | None, problem: str | None, ok: str, failed: str,
                          advice: str | None = None) -> Check:
    """A recipe feature the run's device must have (bf16, FP8). With no usable device there is
    nothing to ask: "recipe device" has failed already, and judging the CPU instead would mislead."""
    if device is None:
        return Check(name, "skip", "train.device is unusable (see recipe device)")
    if problem:
        return Check(name, "fail", failed, advice or problem)
    return Check(name, "ok", ok)


def _library_feature_check(lib: str, feature: str, error: str | None, instead: str, module: str | None = None,
                           version: str | None = None) -> Check:
    """A library a recipe feature imports: ok when it imports, else fail with how to install it
    and what to use instead."""
    module = module or lib
    if error is None:
        return Check(f"recipe {lib}", "ok", f"{feature}: {module} {version + ' ' if version else ''}imports")
    return Check(f"recipe {lib}", "fail", f"{feature} needs {module}: {_one_line(error)}",
                 f"{_LIBRARY[lib].install}; or {instead}", {"error": error})


def recipe_checks(recipe: Recipe, libs: dict[str, dict[str, Any]]) -> list[Check]:
    checks = []
    device = recipe.device
    if recipe.device_problem:
        detail, advice = recipe.device_problem
        checks.append(Check("recipe device", "fail", detail, advice, {"train_device": recipe.device_spec}))
    else:
        via = f"train.device={recipe.device_spec} -> {device}"
        if recipe.device_spec == "auto" and device.type == "cpu":
            via += " (no GPU visible)"
        if device.type not in ("cpu", "cuda"):
            checks.append(Check("recipe device", "warn", via, "vlforge is tested on cpu and cuda devices only",
                                {"train_device": recipe.device_spec}))
        else:
            checks.append(Check("recipe device", "ok", via, values={"train_device": recipe.device_spec}))
    # asked only when the recipe uses FP8: a device's capability is read from the driver
    fp8_missing = fp8_problem(device) if device is not None and (recipe.fp8_backend or "fp8" in recipe.quant) else None

    if recipe.bf16:
        checks.append(_device_feature_check(
            "recipe bf16", device, bf16_problem(device) if device is not None else None,
            f"precision.mode=bf16 runs on {device}" + (" (slowly)" if device and device.type == "cpu" else ""),
            f"precision.mode=bf16 on {device}: no bf16 support"))

    if recipe.fp8_backend:
        checks.append(_device_feature_check(
            "recipe fp8", device, fp8_missing, f"precision.fp8.enabled: {device} has FP8 tensor cores",
            f"precision.fp8.enabled on {device}: no FP8 support"))
        name, module = _BACKEND_LIBRARY[recipe.fp8_backend], _BACKEND_MODULE[recipe.fp8_backend]
        error = _try_import(module) if libs[name]["available"] else libs[name]["error"]
        other = "te" if recipe.fp8_backend == "torchao" else "torchao"
        checks.append(_library_feature_check(
            name, f"precision.fp8.backend={recipe.fp8_backend}", error,
            f"use precision.fp8.backend={other}, or precision.fp8.enabled=false", module=module))

    if recipe.quant & {"nf4", "int8"}:
        info = libs["bitsandbytes"]
        checks.append(_library_feature_check(
            "bitsandbytes", f"quant {'/'.join(sorted(recipe.quant & {'nf4', 'int8'}))}", info["error"],
            "set quant.language=none", version=info["version"]))

    if "fp8" in recipe.quant:
        checks.append(_device_feature_check(
            "recipe quant fp8", device, fp8_missing, f"quant fp8: {device} has FP8 tensor cores",
            f"quant fp8 on {device}: no FP8 support",
            "quant fp8 needs compute capability >= 8.9 (L4, L40, H100, H200, B200): use quant nf4 or int8"))
        info = libs["torchao"]
        checks.append(_library_feature_check("torchao", "quant fp8", info["error"], "use quant nf4 or int8",
                                             version=info["version"]))

    if recipe.flash_attn:
        info = libs["flash_attn"]
        checks.append(_library_feature_check(
            "flash_attn", "model.attn_implementation=flash_attention_2", info["error"],
            "use model.attn_implementation=sdpa", version=info["version"]))

    if recipe.loss_impl == "liger" and device is not None:  # the check setup_model makes before loading
        from vlforge.config import LossConfig
        from vlforge.engine.losses import loss_impl_problem

        problem = ("loss.impl=liger: GRPO's log-probs need banned vision tokens and the entropy, which liger's "
                   "fused op cannot give" if recipe.grpo else loss_impl_problem(LossConfig(impl="liger"), device))
        checks.append(Check("recipe loss", "fail", problem, "set loss.impl=auto (ours, chunked)")
                      if problem else
                      Check("recipe loss", "ok", f"loss.impl=liger: liger-kernel's fused cross-entropy on {device}"))

    if recipe.packing == "auto" and device is not None:  # what the recipe will do; informational
        from vlforge.engine.packed_attention import packing_problem

        problem = packing_problem(device, recipe.attn_implementation, recipe.packed_attention, recipe.precision_mode)
        checks.append(Check("recipe packing", "ok", f"data.packing=auto -> padded rows: {problem}" if problem else
                            f"data.packing=auto -> packed rows on {device} (torch's varlen flash kernel)"))

    if recipe.cuda_graphs_detail:
        checks.append(Check("recipe cuda graphs", "ok", recipe.cuda_graphs_detail) if recipe.cuda_graphs_ok else
                      Check("recipe cuda graphs", "fail", recipe.cuda_graphs_detail, "set precision.cuda_graphs=false"))

    if recipe.tools:
        checks.append(Check("recipe tools", "ok", recipe.tools) if recipe.tools_ok else
                      Check("recipe tools", "skip", recipe.tools) if recipe.tools_ok is None else
                      Check("recipe tools", "fail", recipe.tools, "fix rollout.tools (README: Tools: multi-turn rollouts)"))

    if recipe.model_path:
        checks.append(_model_path_check(recipe.model_path))
    return checks


def _model_path_check(path: str) -> Check:
    where = Path(path).expanduser()
    advice = ("point model.path at a local Hugging Face-format Qwen3-VL directory (config.json, "
              "*.safetensors, tokenizer and preprocessor files); vlforge never downloads weights")
    values = {"path": str(where)}
    if not where.is_dir():
        return Check("recipe model.path", "fail", f"model.path={path}: no such directory", advice, values)
    if not (where / "config.json").is_file():
        return Check("recipe model.path", "fail", f"model.path={path}: has no config.json", advice, values)
    if not any(where.glob("*.safetensors")) and not any(where.glob("*.bin")):
        return Check("recipe model.path", "warn", f"model.path={path}: config.json but no *.safetensors weights",
                     "copy the weight files into it (an incomplete download?)", values)
    return Check("recipe model.path", "ok", f"model.path={path}: config.json and weights found", values=values)


# ----------------------------------------------------------------------------- report


def run_checks(cfg: SFTConfig | GRPOConfig | None = None, config_path: str | None = None) -> dict[str, Any]:
    """Every check, as a JSON-able report. `cfg` None means the default recipe (bf16 SFT, device auto)."""
    env = collect_environment()
    recipe = recipe_from_config(cfg if cfg is not None else SFTConfig(), config_path,
                                env["_cuda_available"], env["_gpu_count"])
    # a driver/CUDA problem is only worth a warning where a GPU is in play
    expect_cuda = env["_cuda_available"] or recipe.device_spec.startswith("cuda")
    gpus = collect_gpus(env["_cuda_available"])
    libs = collect_libraries()
    checks = (version_checks(env, expect_cuda) + gpu_checks(env, gpus) + numeric_checks(gpus)
              + library_checks(libs) + te_checks(gpus, libs) + distributed_checks(env) + recipe_checks(recipe, libs)
              + distributed_recipe_checks(cfg if cfg is not None else SFTConfig(), env, recipe))
    return {
        "ok": not any(c.status == "fail" for c in checks),
        "checks": [c.to_dict() for c in checks],
        "environment": {k: v for k, v in env.items() if not k.startswith("_")},
        "gpus": gpus,
        "libraries": libs,
        "recipe": {"config": config_path, "device": str(recipe.device) if recipe.device else None,
                   "train_device": recipe.device_spec, "needs": recipe.needs},
    }


_TAGS = {"ok": "[ ok ]", "warn": "[warn]", "fail": "[FAIL]", "skip": "[skip]"}


def format_report(report: dict[str, Any]) -> str:
    lines = []
    for check in report["checks"]:
        lines.append(f"{_TAGS[check['status']]} {check['name']}: {check['detail']}")
        if check["advice"]:
            lines.append(f"      -> {check['advice']}")
    failed = sum(c["status"] == "fail" for c in report["checks"])
    lines.append("doctor: all required checks passed" if failed == 0 else f"doctor: {failed} required check(s) failed")
    return "\n".join(lines)

