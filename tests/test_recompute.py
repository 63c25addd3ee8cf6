"""activation_checkpointing.enabled=auto: the pure decision from the memory estimate, what a run
says and records, and the out-of-memory redo one notch further (train/recompute.py)."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from helpers import tiny_sft_config
from vlforge.config import GRPOConfig, load_config, load_recipe_config
from vlforge.train.activations import NOTCHES, activation_estimate, plan_tokens
from vlforge.train.memory import GB
from vlforge.train.recompute import (Recompute, choose_recompute, longest_micro_batch, next_notch,
                                     recompute_needs)


def _needs(recipe: str, tokens: int) -> dict[int, float]:
    from vlforge.model.load import build_meta_model
    from vlforge.model.tiers import build_plan

    cfg = load_recipe_config(f"configs/{recipe}.yaml")
    meta, _ = build_meta_model(cfg.model)
    return recompute_needs(meta, build_plan(meta, cfg.tiers), cfg, tokens)


@pytest.mark.parametrize("recipe,small_gb,every", [("qwen3vl-2b-full", 50, 2), ("qwen3vl-8b-lora", 32, 1),
                                                    ("qwen3vl-2b-lora", 24, 4)])
def test_auto_recomputes_nothing_on_80_gb_and_more_on_a_smaller_gpu(recipe, small_gb, every):
    """The shipped recipes at batch 8 of ~516-token samples (a 448x448 image, a prompt and an answer,
    the shapes of docs/benchmarks.md's recipe runs): an 80 GB GPU holds their activations, so nothing is
    recomputed; on a smaller one, the least recomputation that fits. (Measured on one H100, the same
    shapes: 2B full 45.3 GB without recomputation, 33.8 GB with every block; 8B LoRA 66.3 / 22.3 GB.)"""
    needs = _needs(recipe, 8 * 516)
    assert needs[0] > needs[4] > needs[2] > needs[1]  # each notch keeps less
    big = choose_recompute(needs, capacity=79 * GB, device_total=80 * GB, tokens=8 * 516)
    assert (big.every, big.auto) == (0, True) and "nothing recomputed" in big.why
    small = choose_recompute(needs, capacity=(small_gb - 0.5) * GB, device_total=small_gb * GB, tokens=8 * 516)
    assert small.every == every and "would not" in small.why  # and says why not less


def test_the_decision_is_the_least_recomputation_that_fits():
    needs = {0: 60 * GB, 4: 50 * GB, 2: 40 * GB, 1: 30 * GB}
    picked = [choose_recompute(needs, capacity=c * GB, device_total=50 * GB, tokens=4096).every
              for c in (70, 56, 46, 36, 20)]  # margin: 5 GB of 50
    assert picked == [0, 4, 2, 1, 1]
    assert "exceeds" in choose_recompute(needs, 20 * GB, 50 * GB, 4096).why
    assert [next_notch(n) for n in NOTCHES] == [4, 2, 1, None]


def test_longest_micro_batch_padded_packed_and_budgeted():
    lengths = [10, 300, 50, 200, 120]
    assert longest_micro_batch(lengths, 2, packed=False, max_tokens=None) == 600  # padded to the longest
    assert longest_micro_batch(lengths, 2, packed=True, max_tokens=None) == 500
    assert longest_micro_batch(lengths, 8, packed=True, max_tokens=256) == 256


def test_activations_shrink_with_each_notch_and_plan_shows_them(capsys):
    from vlforge.cli import main

    cfg = load_recipe_config("configs/qwen3vl-2b-full.yaml")
    config = _meta_config(cfg)
    rows = [activation_estimate(config, cfg, plan_tokens(cfg), every)["total"] for every in NOTCHES]
    assert rows == sorted(rows, reverse=True) and rows[0] > 2 * rows[-1]
    main(["sft", "configs/qwen3vl-2b-full.yaml", "--plan", "--json"])
    est = json.loads(capsys.readouterr().out)["memory"]
    assert [a["every"] for a in est["activations"]] == list(NOTCHES)
    assert est["activations"][0]["tokens"] == 8 * 2048  # batch_size x data.max_length
    assert isinstance(load_config(GRPOConfig, None, []), GRPOConfig) and plan_tokens(GRPOConfig()) > 0


def _meta_config(cfg):
    from vlforge.model.load import build_meta_model

    return build_meta_model(cfg.model)[0].config


def test_estimate_matches_the_saved_tensors_of_the_tiny_model(shapes_dir, tmp_path):
    """The per-token estimate against what autograd really keeps: every tensor saved for backward in
    the tiny model's decoder layers, counted once per storage, at two lengths (the slope: per token),
    fp32 on the CPU. Within 25% (the fitted coefficients are exact to 3% on the 2B/8B shapes; at
    the tiny widths small per-token tensors weigh more)."""
    from vlforge.train.activations import block_bytes, stacks
    from vlforge.train.trainable import setup_model

    cfg = tiny_sft_config(shapes_dir, tmp_path, "tiers.method=full", "tiers.vision.train=false")
    t = setup_model(cfg)
    layer = t.model.model.language_model.layers[0]
    rotary = t.model.model.language_model.rotary_emb

    def saved(length: int) -> int:
        storages = {}
        x = torch.randn(1, length, layer.hidden_size, requires_grad=True)
        pos = torch.arange(length)[None].expand(3, 1, length)
        with torch.autograd.graph.saved_tensors_hooks(
                lambda s: storages.setdefault(s.untyped_storage().data_ptr(), s.untyped_storage().nbytes()) and s,
                lambda s: s):
            layer(x, position_embeddings=rotary(x, pos), attention_mask=None, position_ids=pos)
        return sum(storages.values())

    measured = (saved(256) - saved(128)) / 128
    language, _ = stacks(t.model.config, cfg)
    estimated = block_bytes(language, residual_bytes=4, compute_bytes=4)
    assert abs(estimated - measured) / measured < 0.25, (estimated, measured)


def test_a_run_says_and_records_what_auto_chose(shapes_dir, tmp_path, capsys):
    from vlforge.recipes.sft import run_sft

    cfg = tiny_sft_config(shapes_dir, tmp_path / "run", "eval.every=0", "train.max_steps=1")
    assert cfg.activation_checkpointing.enabled == "auto"  # the default
    run_sft(cfg)
    out = capsys.readouterr().out
    assert "activation_checkpointing: nothing recomputed (auto: nothing on cpu" in out
    text = (tmp_path / "run" / "config.yaml").read_text()
    assert text.startswith("# activation_checkpointing: nothing recomputed (auto: nothing on cpu")
    assert yaml.safe_load(text)["activation_checkpointing"] == {"enabled": False}
    assert cfg.activation_checkpointing.enabled == "auto"  # the caller's config is left as given


def test_every_shipped_recipe_says_auto():
    from pathlib import Path

    for path in sorted(Path("configs").glob("*.yaml")):
        assert load_recipe_config(path).activation_checkpointing.enabled == "auto", path.name


class _OOMOnce:
    """A forward hook on the tiny model's first decoder layer raising a real torch.OutOfMemoryError
    at its `at`-th call, once (a GPU's allocator raises the same type)."""

    def __init__(self, at: int, wrapped: bool = False):
        self.calls, self.at, self.raised, self.wrapped = 0, at, 0, wrapped

    def __call__(self, module, args):
        self.calls += 1
        if self.calls == self.at:
            self.raised += 1
            oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
            if self.wrapped:  # as torch.compile raises an allocation's failure while it compiles or autotunes
                raise RuntimeError("backend compiler failed") from oom
            raise oom


def _run(shapes_dir, out, *extra, oom_at: int | None = None, capsys=None, wrapped: bool = False):
    """A 3-step run of the tiny model (LoRA dropout on: the redo must draw the same masks); its
    losses, the batches each step saw and the hook."""
    import vlforge.recipes.sft as sft
    from vlforge.model.tiers import unwrap

    cfg = tiny_sft_config(shapes_dir, out, "eval.every=0", "train.max_steps=3", "train.grad_accum=2",
                          "train.batch_size=2", *extra)
    seen, flags, hook = [], [], _OOMOnce(oom_at, wrapped) if oom_at else None
    real_step = sft.train_step

    def step(t, micro, *args, **kwargs):
        if hook and not hook.calls:
            unwrap(t.model).model.language_model.layers[0].register_forward_pre_hook(hook)
        seen.append([b["input_ids"].sum().item() for b in micro])
        flags.append([block.gradient_checkpointing for block in unwrap(t.model).model.language_model.layers])
        return real_step(t, micro, *args, **kwargs)

    sft.train_step = step
    try:
        result = sft.run_sft(cfg)
    finally:
        sft.train_step = real_step
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return result, [r["loss"] for r in rows if "loss" in r], seen, hook, flags


def test_an_out_of_memory_step_is_redone_one_notch_further(shapes_dir, tmp_path, capsys):
    """A real torch.OutOfMemoryError in the second step's first forward: that step is redone once
    with 1 of every 4 blocks recomputed, on the same micro-batches; the step count, data order and
    losses are an uninterrupted run's that recomputes 1 of every 4 blocks from its start; the move is
    said and recorded in config.yaml."""
    _, ref_losses, ref_seen, _, ref_flags = _run(shapes_dir, tmp_path / "ref", "activation_checkpointing.enabled=true",
                                      "activation_checkpointing.every=4")
    capsys.readouterr()
    # the hook counts layer-0 forwards: 2 micro-batches a step, so call 3 is the second step's first
    result, losses, seen, hook, flags = _run(shapes_dir, tmp_path / "oom", oom_at=3)
    out = capsys.readouterr().out
    assert hook.raised == 1 and result["final_step"] == 3
    # the tiny model's 2 layers: none recomputed, then layer 0 (1 of every 4), as the reference throughout
    assert flags == [[False, False]] * 2 + [[True, False]] * 2 and ref_flags == [[True, False]] * 3
    assert seen[1] == seen[2] and seen[:1] + seen[2:] == ref_seen  # redone on the same batches, none lost
    assert "out of memory in a step" in out and "1 of every 4 blocks recomputed, the step redone" in out
    text = (tmp_path / "oom" / "config.yaml").read_text()
    assert yaml.safe_load(text)["activation_checkpointing"] == {"enabled": True, "every": 4}
    assert "then out of memory in a step" in text.splitlines()[0]
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)


def test_an_out_of_memory_raised_through_a_compiler_error_is_redone_too(shapes_dir, tmp_path, capsys):
    """torch.compile reports an allocation that fails while it compiles as its own error raised from the
    OutOfMemoryError: the step is redone a notch further all the same; an error with no
    OutOfMemoryError behind it is not."""
    result, _, seen, hook, flags = _run(shapes_dir, tmp_path / "wrapped", oom_at=3, wrapped=True)
    assert hook.raised == 1 and result["final_step"] == 3 and seen[1] == seen[2]
    assert flags[2] == [True, False] and "out of memory in a step (CUDA out of memory" in capsys.readouterr().out
    import vlforge.train.recompute as recompute

    assert recompute.out_of_memory(RuntimeError("x")) is None


def test_an_explicit_choice_does_not_move_on_out_of_memory(shapes_dir, tmp_path):
    with pytest.raises(torch.OutOfMemoryError):
        _run(shapes_dir, tmp_path / "run", "activation_checkpointing.enabled=false", oom_at=1)


@pytest.mark.gpu
def test_a_real_cuda_out_of_memory_is_recovered(shapes_dir, tmp_path, capsys):
    """On a GPU: the peaks of the same 2-step run without and with every block recomputed are
    measured; the process is then allowed the memory halfway between them, so a run starting with
    nothing recomputed runs out of memory for real, and finishes one or more notches further."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from vlforge.recipes.sft import run_sft
    import vlforge.train.recompute as recompute

    def config(name, *extra):
        # eager: the subject is the recomputation, and a compile per run would take most of the test's time
        return tiny_sft_config(shapes_dir, tmp_path / name, "train.device=cuda", "eval.every=0",
                               "compile.enabled=false", "train.max_steps=2", "train.batch_size=32", *extra)

    peaks = []
    for enabled in ("false", "true"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        run_sft(config(enabled, f"activation_checkpointing.enabled={enabled}"))
        peaks.append(torch.cuda.max_memory_allocated())
    assert peaks[0] > peaks[1]
    torch.cuda.empty_cache()
    decide = recompute._auto  # start at the first notch, whatever the estimate says
    recompute._auto = lambda *a: Recompute(0, "nothing recomputed, for the test", auto=True)
    torch.cuda.set_per_process_memory_fraction((peaks[0] + peaks[1]) / 2 / torch.cuda.get_device_properties(0).total_memory)
    try:
        result = run_sft(config("auto"))
    except torch.OutOfMemoryError as e:  # not recovered: say where, with the two peaks
        raise AssertionError(f"peaks {peaks}: {capsys.readouterr().out[-3000:]}") from e
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        recompute._auto = decide
    out = capsys.readouterr().out
    assert result["final_step"] == 2 and "out of memory in a step" in out, (peaks, out[-3000:])


def _grpo(shapes_dir, tmp_path, name, *extra, oom: bool = False):
    """A one-step GRPO run of the tiny model (two mini-batch updates); with `oom`, the first training
    forward (grad enabled: not a rollout's) raises a real torch.OutOfMemoryError once."""
    from test_grpo import grpo_config
    from vlforge.model.tiers import unwrap
    from vlforge.recipes import grpo as recipe

    cfg = grpo_config(shapes_dir, tmp_path / name, tmp_path, *extra)
    raised, real_update = [], recipe.update

    def hook(module, args):
        if torch.is_grad_enabled() and not raised:
            raised.append(1)
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    def update(t, *args, **kwargs):
        if oom and not raised:
            unwrap(t.model).model.language_model.layers[0].register_forward_pre_hook(hook)
        return real_update(t, *args, **kwargs)

    recipe.update = update
    try:
        recipe.run_grpo(cfg)
    finally:
        recipe.update = real_update
    rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return rows[-1], raised


def test_grpo_redoes_an_out_of_memory_mini_batch_one_notch_further(shapes_dir, tmp_path, capsys):
    ref, _ = _grpo(shapes_dir, tmp_path, "ref", "activation_checkpointing.enabled=true",
                   "activation_checkpointing.every=4")
    row, raised = _grpo(shapes_dir, tmp_path, "oom", oom=True)
    out = capsys.readouterr().out
    assert raised == [1]
    assert "1 of every 4 blocks recomputed, the step redone" in out
    assert yaml.safe_load((tmp_path / "oom" / "config.yaml").read_text())["activation_checkpointing"] == {
        "enabled": True, "every": 4}
    for key in ("loss", "grad_norm", "reward_mean"):
        torch.testing.assert_close(row[key], ref[key], rtol=1e-5, atol=1e-6, msg=key)
