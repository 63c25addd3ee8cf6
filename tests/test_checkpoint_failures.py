"""Checkpoints that cannot be written or resumed: the run's estimate of a checkpoint's size, the
start-of-run warning when they will not fit, a save the disk refuses (a real write failure: the
process's file-size limit), and a resume under a config that trains other parameters."""

import os
import resource
import signal
import subprocess
import sys

import pytest
import torch

from vlforge.config import ConfigError
from vlforge.train.checkpoint import GB, checkpoint_bytes, checkpoints_held, space_problem
from vlforge.train.trainable import setup_model
from vlforge.recipes.sft import run_sft

from helpers import tiny_sft_config


@pytest.mark.parametrize("method,extra", [("full", []), ("lora", []),
                                          ("full", ["precision.mode=bf16", "precision.master_weights=optimizer"])],
                         ids=["full", "lora", "full-masters-in-optimizer"])
def test_the_estimate_is_the_size_of_the_checkpoint_written(shapes_dir, tmp_path, method, extra):
    cfg = tiny_sft_config(shapes_dir, tmp_path / "run", f"tiers.method={method}", "train.max_steps=1", "eval.every=0",
                          "data.val=null", *extra)
    run_sft(cfg)
    ckpt = tmp_path / "run" / "checkpoint-1"
    # the weights and the optimizer state; the tokenizer, schedule and RNG files (~50 KB) are left out
    written = sum(f.stat().st_size for f in [*ckpt.glob("*.safetensors"), ckpt / "optimizer.pt"])
    torch.manual_seed(0)
    t = setup_model(cfg)
    estimate = checkpoint_bytes(t.model, cfg.optim.name, t.policy.masters_in_optimizer)
    assert 0.93 * written < estimate <= written, (estimate, written)  # the files' headers and pickling: a few %


def test_checkpoints_held_at_the_fullest_moment():
    assert checkpoints_held(saves_left=10, existing=0, keep_last=2) == 3  # 2 finished + 1 being written
    assert checkpoints_held(saves_left=1, existing=0, keep_last=2) == 1  # only the final save
    assert checkpoints_held(saves_left=5, existing=2, keep_last=2) == 1  # a resume: two already on disk
    assert checkpoints_held(saves_left=5, existing=1, keep_last=3) == 3
    assert checkpoints_held(saves_left=0, existing=2, keep_last=2) == 0


def test_space_problem_says_how_much_is_missing_and_what_to_do(tmp_path):
    assert space_problem(free=int(100 * GB), per_checkpoint=int(30 * GB), held=3, out=tmp_path) is None
    warn = space_problem(free=int(50 * GB), per_checkpoint=int(30 * GB), held=3, out=tmp_path)
    assert f"{tmp_path} has 50.0 GB free" in warn and "~30.0 GB each" in warn and "~90.0 GB" in warn
    assert "train.keep_last" in warn and "train.output_dir" in warn
    assert "not even the first save fits" in space_problem(free=int(10 * GB), per_checkpoint=int(30 * GB), held=3,
                                                          out=tmp_path)


def test_the_run_warns_at_its_start_when_its_checkpoints_will_not_fit(shapes_dir, tmp_path, monkeypatch, capsys):
    import vlforge.train.run as run

    common = ["train.max_steps=1", "eval.every=0", "data.val=null"]
    run_sft(tiny_sft_config(shapes_dir, tmp_path / "roomy", *common))  # this disk has room for ~5 MB
    assert "checkpoints take" not in capsys.readouterr().out
    real = run.shutil.disk_usage
    monkeypatch.setattr(run.shutil, "disk_usage", lambda p: real(p)._replace(free=1000))  # a disk with 1 kB left
    run_sft(tiny_sft_config(shapes_dir, tmp_path / "run", *common))
    out = capsys.readouterr().out
    assert "warning:" in out and "not even the first save fits" in out


def _file_size_limit(limit: int):
    def apply():  # in the child before exec: writes past `limit` bytes fail with EFBIG instead of killing it
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


@pytest.mark.parametrize("strategy", ["none", "fsdp2"])  # fsdp2: one process, DCP's sharded save (gloo)
def test_a_save_the_disk_refuses_stops_the_run_clearly_and_keeps_the_finished_checkpoint(shapes_dir, tmp_path,
                                                                                         strategy):
    out = tmp_path / "run"
    common = ["tiers.method=full", "train.save_every=1", "eval.every=0", "data.val=null",
              f"distributed.strategy={strategy}"]
    run_sft(tiny_sft_config(shapes_dir, out, *common, "train.max_steps=2"))
    files = sorted(f for f in (out / "checkpoint-2").rglob("*") if f.is_file())
    kept = {f: f.read_bytes() for f in files}
    limit = 2 * 2**20 if strategy == "fsdp2" else None  # DCP writes many small files: any write past 2 MB fails
    if limit is None:
        optimizer = (out / "checkpoint-2" / "optimizer.pt").stat().st_size
        model = (out / "checkpoint-2" / "model.safetensors").stat().st_size
        assert model < optimizer  # the limit below lets the weights through and stops the optimizer state
        limit = (model + optimizer) // 2

    # the same run resumed through the CLI (its own config.yaml) under a file-size limit
    cmd = [sys.executable, "-m", "vlforge", "sft", str(out / "config.yaml"), "train.max_steps=3", "train.resume=auto"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                          preexec_fn=_file_size_limit(limit), timeout=300)
    assert proc.returncode == 4, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"could not write checkpoint-3 in {out}" in proc.stderr
    assert f"the finished checkpoint {out / 'checkpoint-2'} is kept" in proc.stderr and "train.resume=auto" in proc.stderr
    assert not list(out.glob(".tmp-checkpoint-*")), "the torn copy is removed"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    assert {f: f.read_bytes() for f in files} == kept  # the finished checkpoint untouched

    # with room again, the run goes on from the kept checkpoint
    run_sft(tiny_sft_config(shapes_dir, out, *common, "train.max_steps=3", "train.resume=auto"))
    assert (out / "checkpoint-3" / "trainer_state.json").is_file()


@pytest.mark.parametrize("strategy", ["none", "fsdp2"])  # fsdp2: one process, DCP's sharded checkpoint
@pytest.mark.parametrize("method, change", [("full", "tiers.vision.train=false"),
                                            ("lora", "tiers.vision.last_n_blocks=1")])
def test_resuming_under_a_config_that_trains_other_parameters_is_refused_clearly(shapes_dir, tmp_path, method, change,
                                                                                strategy):
    common = [f"tiers.method={method}", "eval.every=0", "data.val=null", "train.max_steps=1",
              f"distributed.strategy={strategy}"]
    run_sft(tiny_sft_config(shapes_dir, tmp_path, *common))
    saved_with = (tmp_path / "config.yaml").read_text()
    with pytest.raises(ConfigError, match=r"cannot resume from .*checkpoint-1: .*another config.*config\.yaml"):
        run_sft(tiny_sft_config(shapes_dir, tmp_path, *common, change, "train.max_steps=2", "train.resume=auto"))
    assert (tmp_path / "config.yaml").read_text() == saved_with  # the one the message names: the checkpoint's


def test_a_sharded_resume_of_the_same_config_goes_on_when_a_tier_had_no_gradient_yet(tmp_path):
    """Text-only rows with the vision tier trained: its parameters have no optimizer state when the
    checkpoint is written (no image reached them), which is not another config: the resume goes on,
    their moments fresh as in the uninterrupted run, and the losses are the uninterrupted run's."""
    import json

    data = tmp_path / "text.jsonl"
    data.write_text("".join(json.dumps({"text": f"What is {i} plus {i}?", "answer": str(2 * i)}) + "\n"
                            for i in range(16)))
    common = ["model.preset=tiny", f"data.train={data}", "data.val=null", "precision.mode=fp32", "train.device=cpu",
              "train.batch_size=4", "log.progress=false", "optim.warmup_steps=0", "optim.schedule=constant",
              "tiers.method=full", "tiers.vision.train=true", "distributed.strategy=fsdp2", "eval.every=0",
              "train.save_every=1"]
    from vlforge.config import SFTConfig, load_config

    straight, split = tmp_path / "straight", tmp_path / "split"
    run_sft(load_config(SFTConfig, None, [*common, f"train.output_dir={straight}", "train.max_steps=3"]))
    run_sft(load_config(SFTConfig, None, [*common, f"train.output_dir={split}", "train.max_steps=1"]))
    run_sft(load_config(SFTConfig, None, [*common, f"train.output_dir={split}", "train.max_steps=3",
                                          "train.resume=auto"]))
    losses = lambda d: [json.loads(x)["loss"] for x in (d / "metrics.jsonl").read_text().splitlines() if "loss" in x]
    assert losses(split)[-2:] == pytest.approx(losses(straight)[-2:], rel=1e-5)
