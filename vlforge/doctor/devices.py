"""The doctor's GPU and library checks: every visible GPU (memory, compute capability, bf16/FP8
support) with a small real matmul on each in bf16 and, where supported, FP8 (torch._scaled_mm and
TransformerEngine's), compared against fp32, so that a broken CUDA stack shows up here rather than
as NaN losses later; and the optional libraries, each actually imported, since an extension built
against another torch installs fine and then fails at import.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

import torch

from vlforge.doctor.environment import Check, dist_version, one_line, try_import
from vlforge.train.hardware import bf16_problem, capability, fp8_problem

BF16_TOLERANCE = 2e-2  # bf16 keeps 8 significant bits: <= 0.4% rounding per operand
FP8_TOLERANCE = 0.1  # e4m3 keeps 4: <= 6% per element, averaging down over the 256-term sums
MATMUL_SIZE = 256  # a multiple of 16, as FP8 tensor cores require


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
            "model.attention.implementation=flash_attention_2"),
    Library("liger_kernel", ("liger-kernel", "liger_kernel"), "pip install liger-kernel", "fused Triton kernels"),
    Library("av", ("av",), 'pip install "vlforge[video]"', "video files in data rows (frame lists need nothing)"),
)
LIBRARY_BY_NAME = {lib.name: lib for lib in LIBRARIES}


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
        error = try_import(lib.name)
        version = dist_version(*lib.distributions)
        if version is None and error is None:
            version = getattr(sys.modules.get(lib.name), "__version__", None)
        libs[lib.name] = {"available": error is None, "version": version, "error": error}
    return libs


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
        return Check(name, "fail", f"raised {one_line(f'{type(e).__name__}: {e}')}", advice,
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

    from vlforge.train.fp8 import te_autocast

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
