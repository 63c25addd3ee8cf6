"""`vlforge doctor` on this CPU-only machine: the report's schema, recipe requirements, exit codes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vlforge.cli import main
from vlforge.config import ConfigError, GRPOConfig, SFTConfig
from vlforge.doctor import (
    BF16_TOLERANCE,
    FP8_TOLERANCE,
    LIBRARIES,
    STATUSES,
    Recipe,
    bf16_matmul_error,
    format_report,
    fp8_matmul_error,
    recipe_checks,
    recipe_from_config,
    run_checks,
    version_checks,
)
from vlforge.config import load_recipe_config, recipe_class
from vlforge.train.runtime import choose_device, resolve_device

ROOT = Path(__file__).resolve().parents[1]
# in-process runs see whatever GPUs the machine has; these tests describe a machine with none
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="expects a machine without a visible GPU")


def _fails(report: dict) -> list[dict]:
    return [c for c in report["checks"] if c["status"] == "fail"]


def test_json_report_schema_on_cpu():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-m", "vlforge", "doctor", "--json"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert set(report) >= {"ok", "checks", "environment", "gpus", "libraries", "recipe"}
    assert report["ok"] is True and report["gpus"] == []
    for check in report["checks"]:
        assert {"name", "status", "detail", "advice"} <= set(check)
        assert check["status"] in STATUSES and isinstance(check["detail"], str) and isinstance(check["advice"], str)
        if check["status"] == "fail":
            assert check["advice"]
    statuses = {c["name"]: c["status"] for c in report["checks"]}
    assert statuses["gpu"] == "warn" and statuses["python"] == "ok" and statuses["transformers"] == "ok"
    assert statuses["bf16 matmul"] == "skip" and statuses["fp8 matmul"] == "skip"
    gpu = next(c for c in report["checks"] if c["name"] == "gpu")
    assert "CPU" in gpu["detail"] and gpu["advice"]

    env_section = report["environment"]
    assert set(env_section) == {"python", "torch", "cuda", "driver", "transformers", "peft"}
    assert env_section["torch"] == torch.__version__ and env_section["cuda"] == torch.version.cuda

    libs = report["libraries"]
    assert set(libs) == {"torchao", "bitsandbytes", "transformer_engine", "flash_attn", "liger_kernel", "av"}
    for info in libs.values():
        assert set(info) == {"available", "version", "error"} and isinstance(info["available"], bool)
        assert (info["error"] is None) == info["available"]
    for name in libs:
        check = next(c for c in report["checks"] if c["name"] == name)
        if libs[name]["available"]:
            assert check["status"] == "ok" and check["available"] is True
        else:
            assert check["status"] in ("skip", "warn") and "pip install" in check["advice"]

    recipe = report["recipe"]
    assert recipe["config"] is None and recipe["device"] == "cpu" and "bf16" in recipe["needs"]


@no_gpu
def test_fp8_recipe_fails_on_cpu_on_the_hardware_check(tmp_path, capsys):
    cfg = tmp_path / "fp8.yaml"
    cfg.write_text("precision: {mode: bf16, fp8: {enabled: true}}\n")
    assert main(["doctor", "--config", str(cfg), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and report["recipe"]["config"] == str(cfg)
    assert {"fp8", "torchao"} <= set(report["recipe"]["needs"])
    fails = _fails(report)
    assert [c["name"] for c in fails] == ["recipe fp8"]  # torchao is installed: only the hardware fails
    assert "precision.fp8.enabled=false" in fails[0]["advice"]


@no_gpu
def test_cuda_device_fails_without_a_gpu(capsys):
    assert main(["doctor", "train.device=cuda"]) == 1
    out = capsys.readouterr().out
    assert "[FAIL] recipe device: train.device=cuda but no CUDA GPU is visible" in out
    assert "doctor: 1 required check(s) failed" in out.splitlines()[-1]


def test_missing_model_path_is_named(tmp_path, capsys):
    missing = tmp_path / "no-such-model"
    assert main(["doctor", f"model.path={missing}", "--json"]) == 1
    fails = _fails(json.loads(capsys.readouterr().out))
    assert len(fails) == 1 and fails[0]["name"] == "recipe model.path" and str(missing) in fails[0]["detail"]

    (tmp_path / "model").mkdir()
    assert main(["doctor", f"model.path={tmp_path / 'model'}", "--json"]) == 1
    assert "config.json" in _fails(json.loads(capsys.readouterr().out))[0]["detail"]
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "model" / "model.safetensors").write_bytes(b"")
    assert main(["doctor", f"model.path={tmp_path / 'model'}", "--json"]) == 0
    capsys.readouterr()


def test_grpo_recipe_is_recognised(tmp_path):
    cfg = tmp_path / "grpo.yaml"
    cfg.write_text("rollout: {group_size: 4}\nmodel: {attention: {implementation: flash_attention_2}}\n")
    loaded = load_recipe_config(str(cfg))
    assert isinstance(loaded, GRPOConfig) and loaded.rollout.group_size == 4
    assert isinstance(load_recipe_config(None, ["rl.kl_beta=0.1"]), GRPOConfig)
    assert recipe_class({"model": {}}) is SFTConfig
    assert isinstance(load_recipe_config(str(ROOT / "configs" / "demo-sft.yaml")), SFTConfig)
    assert isinstance(load_recipe_config(str(ROOT / "configs" / "demo-grpo.yaml")), GRPOConfig)
    recipe = recipe_from_config(loaded, str(cfg), cuda_available=False, gpu_count=0)
    assert "flash_attn" in recipe.needs and recipe.device == torch.device("cpu")


def _libs(*available: str) -> dict[str, dict]:
    """A collect_libraries() result in which exactly `available` import."""
    return {lib.name: {"available": lib.name in available, "version": "9.9" if lib.name in available else None,
                       "error": None if lib.name in available else f"ModuleNotFoundError: No module named '{lib.name}'"}
            for lib in LIBRARIES}


def _recipe(**kw) -> Recipe:
    fields = dict(config=None, device_spec="cpu", device=torch.device("cpu"), device_problem=None, bf16=False,
                  fp8_backend=None, flash_attn=False, model_path=None)
    return Recipe(**{**fields, **kw})


def test_liger_loss_recipe_is_checked_as_the_run_checks_it(monkeypatch):
    """loss.impl=liger: refused on a CPU device (liger's fused op is Triton kernels) even with
    liger-kernel installed, and in GRPO anywhere; the way out named."""
    import vlforge.train.losses as losses

    monkeypatch.setattr(losses, "liger_available", lambda: True)
    loss = lambda recipe: [c for c in recipe_checks(recipe, _libs()) if c.name == "recipe loss"]  # noqa: E731
    (failed,) = loss(_recipe(loss_impl="liger"))
    assert failed.status == "fail" and "needs CUDA" in failed.detail and "loss.impl=auto" in failed.advice
    (ok,) = loss(_recipe(loss_impl="liger", device_spec="cuda", device=torch.device("cuda")))
    assert ok.status == "ok"
    (grpo,) = loss(_recipe(loss_impl="liger", device_spec="cuda", device=torch.device("cuda"), grpo=True))
    assert grpo.status == "fail" and "GRPO" in grpo.detail
    assert not loss(_recipe())  # auto: nothing to check


def test_packing_auto_says_what_the_recipe_will_do(monkeypatch):
    """data.packing=auto: doctor says whether the run packs (what packing_pays decides once the model
    loads), and why not where it pads; nothing to say for true/false."""
    import vlforge.train.packed_attention as packed_attention

    packing = lambda recipe: [c for c in recipe_checks(recipe, _libs()) if c.name == "recipe packing"]  # noqa: E731
    (cpu,) = packing(_recipe(packing="auto"))
    assert cpu.status == "ok" and "padded rows" in cpu.detail and "on cpu" in cpu.detail
    # device 0 as an sm80+ GPU, then as an older one (one index: the machine running this may have one GPU, or none)
    monkeypatch.setattr(packed_attention, "flash_capable", lambda index: True)
    (gpu,) = packing(_recipe(packing="auto", device_spec="cuda", device=torch.device("cuda", 0)))
    assert "packed rows on cuda:0" in gpu.detail
    monkeypatch.setattr(packed_attention, "flash_capable", lambda index: False)
    (old,) = packing(_recipe(packing="auto", device_spec="cuda:0", device=torch.device("cuda", 0)))
    assert "padded rows" in old.detail and "no flash kernels" in old.detail
    monkeypatch.setattr(packed_attention, "flash_capable", lambda index: True)
    (eager,) = packing(_recipe(packing="auto", device_spec="cuda", device=torch.device("cuda", 0),
                               attn_implementation="eager"))
    assert "padded rows" in eager.detail and "data.packing=true packs anyway" in eager.detail
    (fp32,) = packing(_recipe(packing="auto", device_spec="cuda", device=torch.device("cuda", 0), precision_mode="fp32"))
    assert "padded rows" in fp32.detail and "precision.mode=fp32" in fp32.detail
    assert not packing(_recipe(packing=True)) and not packing(_recipe())
    recipe = recipe_from_config(load_recipe_config(None, ["data.packing=auto"]), None, cuda_available=False,
                                gpu_count=0)
    assert recipe.packing == "auto" and recipe.attn_implementation == "sdpa"
    assert recipe_from_config(load_recipe_config(None, ["rl.kl_beta=0.1"]), None, False, 0).packing is False


def test_cuda_graphs_are_checked_as_the_recipe_refuses_them(monkeypatch):
    """compile.cuda_graphs: doctor fails where setup_model would refuse it before loading (the same
    function), and says what it graphs where it runs."""
    import vlforge.train.packed_attention as packed_attention

    monkeypatch.setattr(packed_attention, "flash_capable", lambda index: True)
    monkeypatch.setattr(packed_attention, "varlen_kernel", lambda: object())  # a torch with the varlen kernel
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # no GPU here: train.device=cuda is device 0
    on = ["compile.enabled=true", "compile.cuda_graphs=true"]

    def check(*overrides, cuda=True, grpo=False):
        cfg = load_recipe_config(None, [*on, *overrides, *(["rl.kl_beta=0.1"] if grpo else [])])
        recipe = recipe_from_config(cfg, None, cuda_available=cuda, gpu_count=int(cuda))
        return [c for c in recipe_checks(recipe, _libs()) if c.name == "recipe cuda graphs"]

    (ok,) = check("train.device=cuda", "compile.cuda_graphs_vision=true")
    assert ok.status == "ok" and "decoder layers and vision blocks replay as CUDA graphs" in ok.detail
    (cpu,) = check("train.device=cpu", cuda=False)
    assert cpu.status == "fail" and "not with device cpu" in cpu.detail
    (padded,) = check("train.device=cuda", "data.packing=false")
    assert padded.status == "fail" and "data.packing=true or auto" in padded.detail
    (fp32,) = check("train.device=cuda", "precision.mode=fp32")  # auto would pad: the flash kernel is half-only
    assert fp32.status == "fail" and "data.packing=auto pads here" in fp32.detail
    (moe,) = check("train.device=cuda", "model.preset=qwen3vl-30b-a3b")
    assert moe.status == "fail" and "MoE" in moe.detail
    (grpo,) = check("train.device=cuda", grpo=True)
    assert grpo.status == "fail" and "not GRPO's update" in grpo.detail
    assert not [c for c in recipe_checks(recipe_from_config(load_recipe_config(None, []), None, True, 1), _libs())
                if c.name == "recipe cuda graphs"]


def test_flash_attention_recipe_needs_flash_attn():
    recipe = _recipe(flash_attn=True)
    (ok,) = [c for c in recipe_checks(recipe, _libs("flash_attn")) if c.name == "recipe flash_attn"]
    assert ok.status == "ok" and "flash_attn 9.9 imports" in ok.detail
    (failed,) = [c for c in recipe_checks(recipe, _libs()) if c.name == "recipe flash_attn"]
    assert failed.status == "fail" and "No module named 'flash_attn'" in failed.detail
    assert failed.advice.startswith("pip install flash-attn") and "attention.implementation=sdpa" in failed.advice


def test_recipe_library_checks_fail_when_missing():
    recipe = _recipe(quant=frozenset({"nf4"}), fp8_backend="te")
    checks = {c.name: c for c in recipe_checks(recipe, _libs("torchao"))}
    assert checks["recipe bitsandbytes"].status == "fail" and "quant nf4 needs bitsandbytes" in checks["recipe bitsandbytes"].detail
    assert "quant.language=none" in checks["recipe bitsandbytes"].advice
    te = checks["recipe transformer_engine"]
    assert te.status == "fail" and "transformer_engine.pytorch" in te.detail and "backend=torchao" in te.advice
    assert checks["recipe fp8"].status == "fail"  # the CPU has no FP8 either
    checks = {c.name: c for c in recipe_checks(_recipe(quant=frozenset({"int8"})), _libs("bitsandbytes"))}
    assert checks["recipe bitsandbytes"].status == "ok" and "quant int8: bitsandbytes 9.9" in checks["recipe bitsandbytes"].detail


def test_unusable_device_skips_the_hardware_checks():
    device, problem = choose_device("cuda:2", cuda_available=True, gpu_count=2)
    recipe = _recipe(device_spec="cuda:2", device=device, device_problem=problem, bf16=True, fp8_backend="torchao",
                     quant=frozenset({"fp8"}))
    checks = {c.name: c for c in recipe_checks(recipe, _libs("torchao"))}
    assert checks["recipe device"].status == "fail" and "only 2 GPU(s)" in checks["recipe device"].detail
    assert [checks[n].status for n in ("recipe bf16", "recipe fp8", "recipe quant fp8")] == ["skip"] * 3
    assert checks["recipe torchao"].status == "ok"  # libraries do not depend on the device


def test_choose_device_decides_for_any_machine():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert choose_device("auto", cuda_available=False, gpu_count=0) == (cpu, None)
    assert choose_device("auto", cuda_available=True, gpu_count=0) == (cpu, None)
    assert choose_device("auto", cuda_available=True, gpu_count=1) == (cuda, None)
    assert choose_device("cuda:1", cuda_available=True, gpu_count=2) == (torch.device("cuda", 1), None)
    device, (detail, advice) = choose_device("cuda", cuda_available=False, gpu_count=0)
    assert device is None and detail == "train.device=cuda but no CUDA GPU is visible" and "train.device=cpu" in advice
    device, (detail, advice) = choose_device("cuda:4", cuda_available=True, gpu_count=4)
    assert device is None and "only 4 GPU(s)" in detail and "cuda:0 .. cuda:3" in advice
    device, (detail, _) = choose_device("tpu", cuda_available=False, gpu_count=0, key="--device")
    assert device is None and detail == "--device=tpu is not a device"


def test_resolve_device_raises_the_same_problem_as_a_config_error():
    with pytest.raises(ConfigError, match=r"^train.device=tpu is not a device; use train.device=auto"):
        resolve_device("tpu")
    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cpu")
        with pytest.raises(ConfigError, match="no CUDA GPU is visible"):
            resolve_device("cuda")


@no_gpu
def test_human_format_and_default_recipe(capsys):
    assert main(["doctor"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "doctor: all required checks passed"
    assert any(line.startswith("[warn] gpu: ") for line in lines)
    assert any(line.startswith("[ ok ] python: ") for line in lines)
    assert all(line.startswith(("[ ok ] ", "[warn] ", "[FAIL] ", "[skip] ", "      -> ", "doctor: ")) for line in lines)


def test_bad_config_key_exits_2_naming_it(tmp_path, capsys):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("train: {bacth_size: 2}\n")
    assert main(["doctor", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "train.bacth_size" in err and "did you mean 'batch_size'" in err and len(err.strip().splitlines()) == 1


def test_matmul_error_measures_run_on_cpu():
    # the GPU checks' arithmetic, run for real on the CPU: bf16 and FP8 land inside their tolerances
    cpu = torch.device("cpu")
    assert 0 < bf16_matmul_error(cpu) < BF16_TOLERANCE
    assert bf16_matmul_error(cpu) < fp8_matmul_error(cpu) < FP8_TOLERANCE


def test_old_transformers_fails_with_the_pip_command():
    env = {"python": "3.11.7", "torch": "2.14.1+cu130", "cuda": "13.0", "driver": None, "transformers": "5.16.2",
           "peft": "0.21.2", "_cuda_available": False}
    checks = {c.name: c for c in version_checks(env, expect_cuda=False)}
    assert checks["transformers"].status == "fail"
    assert checks["transformers"].advice == 'pip install -U "transformers>=5.17"'
    assert checks["torch"].status == "ok" and checks["peft"].status == "ok"
    assert checks["nvidia driver"].status == "skip"
    env.update(python="3.10.14", transformers="5.17.0rc1", driver="535.104.05")
    checks = {c.name: c for c in version_checks(env, expect_cuda=True)}
    assert checks["python"].status == "fail" and checks["transformers"].status == "ok"
    assert checks["nvidia driver"].status == "warn" and "580" in checks["nvidia driver"].advice


def test_format_report_counts_failures():
    report = run_checks()
    report["checks"].append({"name": "x", "status": "fail", "detail": "broken", "advice": "fix it"})
    text = format_report(report)
    assert "[FAIL] x: broken\n      -> fix it\n" in text
    assert text.splitlines()[-1] == "doctor: 1 required check(s) failed"


@no_gpu
def test_quant_recipe_needs_bitsandbytes_or_fp8_hardware(capsys):
    pytest.importorskip("bitsandbytes")
    assert main(["doctor", "--json", "quant.language=nf4"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert "bitsandbytes" in report["recipe"]["needs"]
    assert any(c["name"] == "recipe bitsandbytes" and c["status"] == "ok" for c in report["checks"])
    assert main(["doctor", "--json", "quant.language=fp8"]) == 1
    failed = _fails(json.loads(capsys.readouterr().out))
    assert [c["name"] for c in failed] == ["recipe quant fp8"] and "nf4 or int8" in failed[0]["advice"]


# ----------------------------------------------------------------------------- torchrun / distributed

def _env(gpus: int = 0, nccl: bool = True, gloo: bool = True, **launch) -> dict:
    """collect_environment()'s distributed facts for a machine with `gpus` GPUs, in a launch whose
    torchrun variables are `launch` (e.g. RANK="1")."""
    return {"_gpu_count": gpus, "_cuda_available": gpus > 0, "_distributed": True, "_nccl": nccl,
            "_nccl_version": "2.27.3" if nccl else None, "_gloo": gloo, "_launch": launch}


TORCHRUN_2 = dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", MASTER_ADDR="10.0.0.1",
                  MASTER_PORT="29500")


def _by_name(checks) -> dict:
    return {c.name: c for c in checks}


def test_torchrun_launch_is_read_from_the_environment():
    from vlforge.doctor import distributed_checks

    alone = _by_name(distributed_checks(_env(gpus=8)))
    assert alone["torchrun"].status == "ok" and "not under torchrun" in alone["torchrun"].detail
    assert "torchrun --nproc_per_node 8" in alone["torchrun"].detail and "process group" not in alone

    cpu = _by_name(distributed_checks(_env(**TORCHRUN_2)))
    assert cpu["torchrun"].status == "ok" and cpu["torchrun"].detail == \
        "rank 1 of 2 (local rank 1 of 2), rendezvous 10.0.0.1:29500"
    assert cpu["torchrun"].values["world_size"] == 2
    assert cpu["process group"].status == "ok" and "gloo on CPU for 2" in cpu["process group"].detail
    assert "gpu per process" not in cpu
    assert _by_name(distributed_checks(_env(gloo=False, **TORCHRUN_2)))["process group"].status == "fail"

    no_master = {k: v for k, v in TORCHRUN_2.items() if k != "MASTER_ADDR"}
    (bad,) = [c for c in distributed_checks(_env(**no_master)) if c.name == "torchrun"]
    assert bad.status == "fail" and bad.detail.startswith("MASTER_ADDR not set") and "torchrun" in bad.advice
    half = _by_name(distributed_checks(_env(RANK="0")))["torchrun"]
    assert half.status == "warn" and "RANK set without WORLD_SIZE: vlforge runs as one process" in half.detail
    assert _by_name(distributed_checks(_env(**{**TORCHRUN_2, "RANK": "2"})))["torchrun"].status == "fail"
    assert "not a whole number" in _by_name(distributed_checks(_env(**{**TORCHRUN_2, "WORLD_SIZE": "two"})))[
        "torchrun"].detail
    no_local = {k: v for k, v in TORCHRUN_2.items() if k != "LOCAL_RANK"}
    assert "every process on a node takes GPU 0" in _by_name(distributed_checks(_env(**no_local)))["torchrun"].detail


def test_one_gpu_per_process_and_nccl():
    from vlforge.doctor import distributed_checks

    eight = dict(TORCHRUN_2, WORLD_SIZE="16", RANK="9", LOCAL_WORLD_SIZE="8")
    ok = _by_name(distributed_checks(_env(gpus=8, **eight)))
    assert ok["process group"].status == "ok" and ok["process group"].detail == "NCCL 2.27.3 for 16 process(es)"
    assert ok["gpu per process"].status == "ok" and "this one: cuda:1" in ok["gpu per process"].detail
    shared = _by_name(distributed_checks(_env(gpus=4, **eight)))["gpu per process"]
    assert shared.status == "fail" and "8 processes on this node but 4 GPU(s)" in shared.detail
    assert "--nproc_per_node 4" in shared.advice
    idle = _by_name(distributed_checks(_env(gpus=8, **dict(eight, LOCAL_WORLD_SIZE="4"))))["gpu per process"]
    assert idle.status == "warn" and "4 GPU(s) idle" in idle.detail
    # a launcher that hides all GPUs but one from each process: local rank 3 has no cuda:3
    hidden = _by_name(distributed_checks(_env(gpus=1, **dict(eight, LOCAL_RANK="3"))))["gpu per process"]
    assert hidden.status == "fail" and "no cuda:3" in hidden.detail
    no_nccl = _by_name(distributed_checks(_env(gpus=8, nccl=False, **eight)))
    assert no_nccl["process group"].status == "fail" and no_nccl["multi-gpu"].status == "warn"


def _recipe_dist(env: dict, *overrides: str) -> dict:
    from vlforge.config import load_config
    from vlforge.doctor import distributed_recipe_checks

    cfg = load_config(SFTConfig, None, list(overrides))
    recipe = recipe_from_config(cfg, None, env["_cuda_available"], env["_gpu_count"])
    return _by_name(distributed_recipe_checks(cfg, env, recipe))


def test_recipe_distributed_section_resolved_and_refused_as_the_run_would():
    two = _env(**TORCHRUN_2)
    checks = _recipe_dist(two)
    assert checks["recipe distributed"].status == "ok"
    assert checks["recipe distributed"].detail == ("distributed.strategy=auto -> fsdp2 over 2 process(es) "
                                                   "(reshard_after_forward, no cpu offload)")
    assert checks["recipe fsdp2"].status == "ok" and checks["recipe optimizer"].status == "ok"

    checks = _recipe_dist(two, "precision.fp8.enabled=true", "optim.name=adamw8bit")
    fsdp2, optim = checks["recipe fsdp2"], checks["recipe optimizer"]
    assert fsdp2.status == "fail" and fsdp2.detail == "distributed.strategy=fsdp2 does not support precision.fp8.enabled yet"
    assert "distributed.strategy=none" in fsdp2.advice
    assert optim.status == "ok" and optim.detail.endswith("with FSDP2")  # 8-bit AdamW steps the shards

    refused = _recipe_dist(two, "distributed.strategy=none")["recipe distributed"]
    assert refused.status == "fail" and "torchrun started 2 processes" in refused.detail and "fsdp2" in refused.advice
    assert "recipe fsdp2" not in _recipe_dist(two, "distributed.strategy=none")
    pinned = _recipe_dist(two, "train.device=cuda:1")["recipe distributed"]
    assert pinned.status == "fail" and "use train.device=auto" in pinned.advice

    alone = _recipe_dist(_env(), "distributed.cpu_offload=true")["recipe distributed"]
    assert alone.status == "warn" and "cpu_offload=true is ignored" in alone.detail
    assert "distributed.strategy=fsdp2" in alone.advice
    one = _recipe_dist(_env(), "distributed.strategy=fsdp2", "distributed.cpu_offload=true")
    assert "fsdp2 over 1 process(es) (reshard_after_forward, cpu_offload)" in one["recipe distributed"].detail


def test_planned_strategy_is_what_init_world_does(monkeypatch):
    """The doctor's and --plan's resolution (train/distributed.planned_strategy, which init_world calls) against the real init_world."""
    from vlforge.config import DistributedConfig
    from vlforge.train.distributed import init_world, planned_strategy

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)  # restored (removed) after the test
    for strategy in ("auto", "none", "fsdp2"):
        world = init_world(DistributedConfig(strategy=strategy), "cpu")  # fsdp2: a gloo group of one
        try:
            assert planned_strategy(strategy, 1, "cpu") == (world.strategy, None)
        finally:
            world.close()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    for strategy, device in (("none", "cpu"), ("auto", "cuda:1")):
        _, problem = planned_strategy(strategy, 2, device)
        with pytest.raises(ConfigError) as e:
            init_world(DistributedConfig(strategy=strategy), device)
        assert str(e.value) == problem


def test_under_torchrun_other_ranks_print_only_their_failures(monkeypatch, capsys):
    for key, value in TORCHRUN_2.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("MASTER_ADDR")
    assert main(["doctor"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("[rank 1 of 2] [FAIL] torchrun: MASTER_ADDR not set")


def test_grpo_tools_are_checked_as_the_run_checks_them(tmp_path):
    """tools.names: doctor loads them and renders a tool turn with the model's chat template, as
    run_grpo does before any model loads; a bad spec or a template without tool messages fails."""
    tools = lambda *o: [c for c in recipe_checks(recipe_from_config(  # noqa: E731
        load_recipe_config(None, ["model.preset=tiny", *o]), None, False, 0), _libs()) if c.name == "recipe tools"]
    (ok,) = tools("tools.names=[calculator]")
    assert ok.status == "ok" and "calculator" in ok.detail
    (bad,) = tools("tools.names=[calculator, nope]")
    assert bad.status == "fail" and "unknown tool 'nope'" in bad.detail
    # with tools.processes a worker process loads them too: a tool file it cannot import fails
    good = "def f(x: int) -> str:\n    '''F.\n\n    Args:\n        x: X.\n    '''\n    return str(x)\n"
    (tmp_path / "t.py").write_text(good)
    (worker,) = tools(f"tools.names=['{tmp_path / 't.py'}:f']", "tools.processes=2")
    assert worker.status == "ok" and "a worker process loads them" in worker.detail
    in_worker = "import sys\nif getattr(sys.modules['__main__'].__spec__, 'name', '') == 'vlforge.tools.worker':\n"
    (tmp_path / "t.py").write_text(in_worker + "    raise ImportError('no')\n" + good)  # this process imports it
    (broken,) = tools(f"tools.names=['{tmp_path / 't.py'}:f']", "tools.processes=2")
    assert broken.status == "fail" and "worker process" in broken.detail and "ImportError('no')" in broken.detail
    from vlforge.config import ModelConfig
    from vlforge.model.load import load_model
    from vlforge.model.presets import TOKENIZER_DIR

    plain = tmp_path / "plain-template"  # a model whose chat template knows no tool messages
    model, processor = load_model(ModelConfig(preset="tiny"))
    tool_branch = "{%- elif message['role'] == 'tool' -%}"  # renders nothing for a tool message
    processor.chat_template = (TOKENIZER_DIR / "chat_template.jinja").read_text().replace(
        tool_branch, tool_branch + "{%- elif false -%}")
    model.save_pretrained(plain)
    processor.save_pretrained(plain)
    (none,) = tools(f"model.path={plain}", "model.preset=null", "tools.names=[calculator]")
    assert none.status == "fail" and "does not render tool messages" in none.detail
    (unchecked,) = tools(f"model.path={tmp_path / 'missing'}", "model.preset=null", "tools.names=[calculator]")
    assert unchecked.status == "skip" and "not checked" in unchecked.detail
    assert not tools()
