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
  train/distributed.init_world resolves it, and what is refused under FSDP2).

Each finding is a `Check` (ok | warn | fail | skip, a detail, and advice saying what to do).
`run_checks` returns a JSON-able report; `format_report` renders it for people. Only "fail"
makes the command exit non-zero: warnings are things worth knowing that do not stop a run.

The modules: environment.py (Check; Python, torch, CUDA runtime, driver, versions), devices.py
(GPUs, their real matmuls, the optional libraries), launch.py (torch.distributed, the torchrun
launch), recipe.py (what a recipe needs, and its distributed section), report.py (run_checks,
format_report). Their public names are importable from `vlforge.doctor`.
"""

from vlforge.doctor.devices import (
    BF16_TOLERANCE,
    FP8_TOLERANCE,
    LIBRARIES,
    MATMUL_SIZE,
    Library,
    bf16_matmul_error,
    collect_gpus,
    collect_libraries,
    fp8_matmul_error,
    gpu_checks,
    library_checks,
    numeric_checks,
    te_checks,
    te_matmul_error,
)
from vlforge.doctor.environment import (
    LAUNCH_VARS,
    MIN_DRIVER_FOR_CUDA,
    MIN_PYTHON,
    MIN_VERSIONS,
    STATUSES,
    Check,
    Status,
    collect_environment,
    cuda_probe,
    distributed_probe,
    nvidia_driver,
    version_checks,
)
from vlforge.doctor.launch import Launch, distributed_checks, parse_launch
from vlforge.doctor.recipe import (
    Recipe,
    distributed_recipe_checks,
    recipe_checks,
    recipe_from_config,
)
from vlforge.doctor.report import format_report, run_checks

__all__ = [
    "BF16_TOLERANCE", "FP8_TOLERANCE", "LAUNCH_VARS", "LIBRARIES", "MATMUL_SIZE", "MIN_DRIVER_FOR_CUDA", "MIN_PYTHON",
    "MIN_VERSIONS", "STATUSES", "Check", "Launch", "Library", "Recipe", "Status", "bf16_matmul_error",
    "collect_environment", "collect_gpus", "collect_libraries", "cuda_probe", "distributed_checks",
    "distributed_probe", "distributed_recipe_checks", "format_report", "fp8_matmul_error", "gpu_checks",
    "library_checks", "numeric_checks", "nvidia_driver", "parse_launch", "recipe_checks", "recipe_from_config",
    "run_checks", "te_checks", "te_matmul_error", "version_checks",
]
