"""What the accelerator can do: the facts that decide whether bf16 or FP8 can run on a device.

Each `*_problem` function returns None when the feature works on `device`, or a message that says
why not and what to use instead. Recipes call these before loading a model; `vlforge doctor`
reports them for every GPU.
"""

from __future__ import annotations

import torch

# FP8 tensor cores arrived with Ada (8.9: L4, L40, RTX 40xx) and Hopper (9.0: H100, H200).
FP8_MIN_CAPABILITY = (8, 9)
# bf16 tensor cores arrived with Ampere (8.0: A100, A10, RTX 30xx).
BF16_MIN_CAPABILITY = (8, 0)


def capability(device: torch.device) -> tuple[int, int] | None:
    """(major, minor) compute capability of a CUDA device; None for CPU."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


def _name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device)


def bf16_problem(device: torch.device) -> str | None:
    cap = capability(device)
    if cap is None or cap >= BF16_MIN_CAPABILITY:
        return None  # CPUs run bf16 (slowly, but correctly)
    return (f"{_name(device)} (compute capability {cap[0]}.{cap[1]}) has no bf16 tensor cores: "
            "use precision.mode=fp16 (dynamic loss scaling) or fp32")


def fp8_problem(device: torch.device) -> str | None:
    if device.type != "cuda" or not torch.cuda.is_available():
        return ("FP8 training needs an NVIDIA GPU with compute capability >= 8.9 (L4, L40, RTX 40xx, "
                "H100, H200, B200); this run has no GPU. Set precision.fp8.enabled=false "
                "(precision.mode=bf16 runs anywhere)")
    cap = capability(device)
    if cap < FP8_MIN_CAPABILITY:
        return (f"{_name(device)} (compute capability {cap[0]}.{cap[1]}) has no FP8 tensor cores "
                f"(need >= {FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]}: L4, L40, H100, H200, B200). "
                "Set precision.fp8.enabled=false and train in precision.mode=bf16"
                + ("" if cap >= BF16_MIN_CAPABILITY else " (or fp16 on this GPU)"))
    return None


def quant_problem(quant, device: torch.device) -> str | None:
    """Weight quantization to FP8 (`quant.*: fp8`, torchao) needs FP8 tensor cores; nf4/int8 run anywhere."""
    if "fp8" not in (quant.language, quant.vision, quant.projector):
        return None
    if capability(device) is None or capability(device) < FP8_MIN_CAPABILITY:
        where = _name(device) if device.type == "cuda" and torch.cuda.is_available() else "the CPU"
        return (f"quant fp8 needs an NVIDIA GPU with compute capability >= 8.9 (L4, L40, H100, H200, B200), "
                f"not {where}: use nf4 or int8 instead")
    return None
