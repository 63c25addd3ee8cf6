"""The doctor's report: every check run in order (run_checks, JSON-able) and rendered for people
(format_report). Only "fail" makes `vlforge doctor` exit non-zero."""

from __future__ import annotations

from typing import Any

from vlforge.config import GRPOConfig, SFTConfig
from vlforge.doctor.devices import (
    collect_gpus,
    collect_libraries,
    gpu_checks,
    library_checks,
    numeric_checks,
    te_checks,
)
from vlforge.doctor.environment import cache_checks, collect_environment, version_checks
from vlforge.doctor.launch import distributed_checks
from vlforge.doctor.recipe import (
    distributed_recipe_checks,
    recipe_checks,
    recipe_from_config,
)


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
              + distributed_recipe_checks(cfg if cfg is not None else SFTConfig(), env, recipe) + cache_checks())
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
