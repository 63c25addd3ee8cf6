import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from vlforge.config import ConfigError
from vlforge.train.optim import lr_factor
from vlforge.recipes.sft import run_sft

from helpers import tiny_sft_config


def final_weights(out_dir, step):
    return load_file(out_dir / f"checkpoint-{step}" / "model.safetensors")


def test_batch8_accum1_equals_batch2_accum4(shapes_dir, tmp_path):
    common = ["tiers.method=full", "train.max_steps=2", "eval.every=0", "data.val=null"]
    run_sft(tiny_sft_config(shapes_dir, tmp_path / "a", *common, "train.batch_size=8", "train.grad_accum=1"))
    run_sft(tiny_sft_config(shapes_dir, tmp_path / "b", *common, "train.batch_size=2", "train.grad_accum=4"))
    a, b = final_weights(tmp_path / "a", 2), final_weights(tmp_path / "b", 2)
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=2e-6, rtol=1e-5, msg=name)
    la = [r["loss"] for r in map(json.loads, (tmp_path / "a/metrics.jsonl").read_text().splitlines())]
    lb = [r["loss"] for r in map(json.loads, (tmp_path / "b/metrics.jsonl").read_text().splitlines())]
    assert la == pytest.approx(lb, rel=1e-5)


def test_run_outputs_metrics_eval_and_refuses_to_overwrite(shapes_dir, tmp_path):
    cfg = tiny_sft_config(shapes_dir, tmp_path, "train.max_steps=3", "train.save_every=1", "train.keep_last=2",
                          "eval.every=2")
    result = run_sft(cfg)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3]
    for r in train_rows:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s"} <= set(r) and r["tokens_per_s"] > 0
    ev = json.loads((tmp_path / "eval.json").read_text())
    assert ev["step"] == 3 and ev["n"] == 4 and 0 <= ev["accuracy"] <= 1 and ev["loss"] > 0
    assert [h["step"] for h in ev["history"]] == [2, 3]
    assert result["eval"]["accuracy"] == ev["accuracy"]
    # keep_last=2: only the two newest complete checkpoints remain, no temporary directories
    assert sorted(p.name for p in tmp_path.iterdir() if "checkpoint" in p.name) == ["checkpoint-2", "checkpoint-3"]
    assert (tmp_path / "loss.png").stat().st_size > 1000
    assert (tmp_path / "config.yaml").exists()
    with pytest.raises(ConfigError, match="is not empty"):
        run_sft(cfg)
    cfg.train.overwrite = True
    run_sft(cfg)


def test_lr_schedule_warmup_and_decay():
    assert lr_factor(0, 100, 10, "cosine", 0.0) == pytest.approx(0.1)
    assert lr_factor(9, 100, 10, "cosine", 0.0) == pytest.approx(1.0)
    assert lr_factor(10, 100, 10, "cosine", 0.0) == pytest.approx(1.0)
    assert lr_factor(55, 100, 10, "cosine", 0.0) == pytest.approx(0.5)
    assert lr_factor(100, 100, 10, "linear", 0.1) == pytest.approx(0.1)
    assert lr_factor(50, 100, 0, "constant", 0.0) == 1.0


def _cli(shapes_dir, out_dir, *extra):
    return [sys.executable, "-m", "vlforge", "sft", str(__import__("pathlib").Path(__file__).parent / "resume.yaml"),
            f"data.train={shapes_dir / 'train.jsonl'}", f"train.output_dir={out_dir}", *extra]


@pytest.mark.slow  # three CLI runs: 35-60 s per method on 2 shared cores
@pytest.mark.parametrize("method", ["full", "lora"])
def test_resume_after_sigkill_equals_uninterrupted_run(shapes_dir, tmp_path, method):
    steps = 30
    args = [f"tiers.method={method}", f"train.max_steps={steps}"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    subprocess.run(_cli(shapes_dir, tmp_path / "straight", *args), check=True, env=env, capture_output=True)

    killed = tmp_path / "killed"
    proc = subprocess.Popen(_cli(shapes_dir, killed, *args), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and not (killed / "checkpoint-10").exists():
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (killed / "checkpoint-10").exists() and not (killed / f"checkpoint-{steps}").exists(), \
        "the run was not killed mid-way"
    subprocess.run(_cli(shapes_dir, killed, *args, "train.resume=auto"), check=True, env=env, capture_output=True)

    name = "model.safetensors" if method == "full" else "adapter_model.safetensors"
    a = load_file(tmp_path / "straight" / f"checkpoint-{steps}" / name)
    b = load_file(killed / f"checkpoint-{steps}" / name)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    losses = lambda d: [r["loss"] for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines())]
    assert losses(tmp_path / "straight") == losses(killed)  # no duplicated or missing steps in the log


@pytest.mark.parametrize("method", ["full", "lora"])
def test_gradient_checkpointing_gives_the_same_gradients(shapes_dir, tmp_path, method):
    """Same gradients with and without; and no hook left on the input embeddings (transformers adds
    one making their output require grad, which non-reentrant checkpointing does not need and whose
    requires_grad_() broke the compiled rollout decode step into pieces on torch 2.11)."""
    from vlforge.data.dataset import load_dataset
    from vlforge.data.encode import collate
    from vlforge.train.losses import sft_loss_sum
    from vlforge.train.trainable import setup_model
    from vlforge.model.tiers import unwrap

    grads = []
    for ckpt in ("false", "true"):
        cfg = tiny_sft_config(shapes_dir, tmp_path / ckpt, f"tiers.method={method}",
                              f"activation_checkpointing.enabled={ckpt}")
        torch.manual_seed(0)  # the same LoRA initialisation both times
        t = setup_model(cfg)
        assert not unwrap(t.model).get_input_embeddings()._forward_hooks
        data = load_dataset(cfg.data.train, t.processor, cfg.data)
        loss, _ = sft_loss_sum(t.model, collate([data[i] for i in range(4)], data.encoder.pad_id))
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in t.model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], atol=1e-6, rtol=1e-5, msg=n)


def test_selective_checkpointing_recomputes_one_block_in_n_with_the_same_gradients(shapes_dir, tmp_path):
    """activation_checkpointing.every=2: every other decoder layer and vision block runs its forward
    again in backward (counted), the others once; the gradients are those of no checkpointing."""
    from vlforge.data.dataset import load_dataset
    from vlforge.data.encode import collate
    from vlforge.train.losses import sft_loss_sum
    from vlforge.train.trainable import setup_model

    runs = {}
    for name, extra in (("plain", []), ("every2", ["activation_checkpointing.enabled=true",
                                                    "activation_checkpointing.every=2"])):
        cfg = tiny_sft_config(shapes_dir, tmp_path / name, "tiers.method=full", *extra)
        t = setup_model(cfg)
        core = t.model
        blocks = [*core.model.language_model.layers, *core.model.visual.blocks]
        calls = [0] * len(blocks)
        for i, block in enumerate(blocks):  # on the block's MLP: transformers recomputes `forward`, inside the hooks
            block.mlp.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
        data = load_dataset(cfg.data.train, t.processor, cfg.data)
        loss, _ = sft_loss_sum(t.model, collate([data[i] for i in range(4)], data.encoder.pad_id))
        loss.backward()
        grads = {n: p.grad.clone() for n, p in t.model.named_parameters() if p.grad is not None}
        runs[name] = (grads, calls, len(core.model.language_model.layers))
    (plain, plain_calls, _), (every2, calls, n_text) = runs["plain"], runs["every2"]
    assert set(plain_calls) == {1}
    for stack in (calls[:n_text], calls[n_text:]):  # per stack: blocks 0, 2, 4, ... recomputed
        assert stack == [2 if i % 2 == 0 else 1 for i in range(len(stack))] and len(stack) >= 2
    for n in plain:
        torch.testing.assert_close(every2[n], plain[n], atol=1e-6, rtol=1e-5, msg=n)


def test_activation_memory_budget_is_applied_to_the_training_forward_only(shapes_dir, tmp_path):
    """compile.activation_memory_budget: torch's partitioner budget inside the step's forward (where
    compiled layers are compiled), not process-wide; refused from the config unless compile=true."""
    import torch._functorch.config as functorch_config

    from vlforge.config import SFTConfig, load_config
    from vlforge.train.trainable import setup_model

    default = functorch_config.activation_memory_budget
    cfg = tiny_sft_config(shapes_dir, tmp_path / "run", "compile.enabled=true",
                          "compile.activation_memory_budget=0.4")
    t = setup_model(cfg)  # layers wrapped for compile (compiled at their first call, which this test never makes)
    assert t.forward(lambda model: functorch_config.activation_memory_budget) == 0.4
    assert functorch_config.activation_memory_budget == default
    for bad, match in (("compile.activation_memory_budget=0", "activation_memory_budget"),
                       ("compile.activation_memory_budget=0.5 compile.enabled=false", "acts on compiled layers"),
                       ("compile.activation_memory_budget=0.5", "set compile.enabled=true"),  # auto: refused
                       ("activation_checkpointing.every=2", "activation_checkpointing.enabled=true too"),
                       ("activation_checkpointing.every=0", "activation_checkpointing.every must be >= 1")):
        with pytest.raises(ConfigError, match=match):
            load_config(SFTConfig, None, bad.split())


def test_vision_blocks_compile_with_the_decoder_layers_and_an_eager_trainable_tower_keeps_the_loop(shapes_dir, tmp_path):
    """compile.vision (auto: with compiled decoder layers and the varlen vision attention)
    wraps each vision block for torch.compile; model.attention.vision=auto leaves a trainable tower
    whose blocks run eager on transformers' per-image loop (measured faster there), a frozen one
    (LoRA on the language model) and compiled ones on varlen; compile.vision=true needs compile.enabled=true."""
    from vlforge.config import SFTConfig, load_config
    from vlforge.train.trainable import setup_model
    from vlforge.model.tiers import unwrap
    from vlforge.model.varlen import VISION_ATTENTION

    def setup(*overrides):
        t = setup_model(tiny_sft_config(shapes_dir, tmp_path / "run", *overrides))
        core = unwrap(t.model).model
        return ({b._compiled_call_impl is not None for b in core.language_model.layers},
                {b._compiled_call_impl is not None for b in core.visual.blocks}, core.visual.config._attn_implementation)

    assert setup("compile.enabled=true") == ({True}, {True}, VISION_ATTENTION)
    assert setup_model(tiny_sft_config(shapes_dir, tmp_path / "run", "compile.enabled=true")).compiled == (
        "decoder layers", "vision blocks")  # what the run's first line reports
    assert setup("compile.enabled=true", "compile.vision=false") == ({True}, {False}, "sdpa")
    assert setup("compile.enabled=false") == ({False}, {False}, "sdpa")  # full: the tower trains, eager
    assert setup("compile.enabled=false", "model.attention.vision=varlen") == ({False}, {False}, VISION_ATTENTION)
    assert setup("compile.enabled=true", "model.attention.vision=sdpa") == ({True}, {False}, "sdpa")
    assert setup("compile.enabled=false", "tiers.method=lora")[1:] == ({False}, "sdpa")  # LoRA on vision blocks
    assert setup("compile.enabled=false", "tiers.method=lora", "tiers.vision.train=false")[1:] == (
        {False}, VISION_ATTENTION)  # a frozen tower: forward only, as in inference
    for bad in ("compile.vision=true", "compile.vision=true compile.enabled=false"):
        with pytest.raises(ConfigError, match="compile.vision compiles the vision blocks"):
            load_config(SFTConfig, None, bad.split())


def test_tensorboard_events_are_written(shapes_dir, tmp_path):
    pytest.importorskip("tensorboard")
    run_sft(tiny_sft_config(shapes_dir, tmp_path, "log.tensorboard=true", "data.val=null"))
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_resuming_an_older_checkpoint_sets_later_ones_aside(shapes_dir, tmp_path):
    from vlforge.recipes.sft import run_sft

    from helpers import tiny_sft_config

    def run(*extra):
        return run_sft(tiny_sft_config(shapes_dir, tmp_path / "run", "tiers.method=lora", "optim.schedule=constant",
                                       "train.max_steps=6", "train.save_every=2", "train.keep_last=3",
                                       "data.val=null", *extra))

    run()
    first = load_file(tmp_path / "run" / "checkpoint-6" / "adapter_model.safetensors")
    run(f"train.resume={tmp_path / 'run' / 'checkpoint-2'}")
    aside = [p for p in (tmp_path / "run").iterdir() if p.name.startswith("superseded-2-")]
    assert len(aside) == 1 and sorted(p.name for p in aside[0].iterdir()) == ["checkpoint-4", "checkpoint-6"]
    # the new branch's checkpoints are the ones kept (not pruned in favour of the old 4 and 6)
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4",
                                                                               "checkpoint-6"]
    again = load_file(tmp_path / "run" / "checkpoint-6" / "adapter_model.safetensors")
    assert all(torch.equal(first[k], again[k]) for k in first)  # an exact resume reproduces the branch
