"""precision.master_weights=optimizer: bf16 working copies of the linear weights, fp32 masters in
MasterWeightAdamW (train/optim.py). Its update against torch.optim.AdamW, the working copies against
the masters, a tiny SFT run against master_weights=fp32 (the same forward bits), gradient
accumulation in fp32, an exact resume, and the refusals."""

import json

import pytest
import torch
from torch import nn

from vlforge.config import ConfigError, PrecisionConfig
from vlforge.train.optim import MasterWeightAdamW


def _groups(params, lr=1e-2):
    return [{"params": params[:2], "lr": lr, "weight_decay": 0.1}, {"params": params[2:], "lr": lr / 2,
                                                                     "weight_decay": 0.0}]


def _params(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in ((8, 4), (16,), (3, 5), (7,))]


@pytest.mark.parametrize("clip", [None, 3.0])
def test_the_update_is_torch_adamw(clip):
    """fp32 parameters (their own masters): the same values as torch's AdamW over 6 steps with a
    changing lr, decay on one group, and the clip as a gradient divisor (fused AdamW's grad_scale)."""
    ours, ref = _params(), _params()
    opt = MasterWeightAdamW(_groups(ours), {}, betas=(0.9, 0.95), eps=1e-8)
    torch_opt = torch.optim.AdamW(_groups(ref), betas=(0.9, 0.95), eps=1e-8, foreach=False)
    g = torch.Generator().manual_seed(1)
    for step in range(6):
        for a, b in zip(ours, ref):
            grad = torch.randn(a.shape, generator=g)
            a.grad, b.grad = grad.clone(), grad / clip if clip else grad.clone()
        for o in (opt, torch_opt):
            for group in o.param_groups:
                group["lr"] *= 0.7  # a schedule: a new lr every step (tensors in the update: no new graph)
        if clip:
            opt.grad_scale = torch.tensor(clip)
        opt.step()
        torch_opt.step()
        opt.__dict__.pop("grad_scale", None)
        for a, b in zip(ours, ref):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    state = opt.state[ours[0]]
    assert state["step"] == 6 and state["exp_avg"].dtype == torch.float32 and "master" not in state


def test_a_tensor_without_gradients_keeps_its_own_step_count():
    """A tensor that got no gradient in some steps (a vision block on text-only batches) is corrected
    for its own number of steps, as torch's AdamW does per tensor."""
    ours, ref = _params(), _params()
    opt = MasterWeightAdamW(_groups(ours), {})
    torch_opt = torch.optim.AdamW(_groups(ref), foreach=False)
    for step in range(4):
        for i, (a, b) in enumerate(zip(ours, ref)):
            a.grad = b.grad = None if (i == 1 and step < 2) else torch.full(a.shape, 0.1 * (step + 1))
        opt.step()
        torch_opt.step()
    assert opt.state[ours[1]]["step"] == 2 and opt.state[ours[0]]["step"] == 4
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_working_copies_are_the_rounded_fp32_masters():
    """bf16 parameters: the masters step as fp32 AdamW on the bf16 gradients widened (what autocast's
    cast gave fp32 parameters), and each working copy is its master rounded to bf16."""
    masters32 = _params()
    working = [nn.Parameter(m.detach().to(torch.bfloat16)) for m in masters32]
    masters = {w: m.detach().clone() for w, m in zip(working, masters32)}
    opt = MasterWeightAdamW(_groups(working), masters)
    ref = torch.optim.AdamW(_groups(masters32), foreach=False)
    g = torch.Generator().manual_seed(2)
    for _ in range(4):
        for w, m in zip(working, masters32):
            w.grad = torch.randn(w.shape, generator=g).to(torch.bfloat16)
            m.grad = w.grad.float()
        opt.step()
        ref.step()
    for w, m in zip(working, masters32):
        master = opt.state[w]["master"]
        assert master.dtype == torch.float32 and w.dtype == torch.bfloat16
        torch.testing.assert_close(master, m.detach(), rtol=1e-6, atol=1e-7)
        assert torch.equal(w.detach(), master.to(torch.bfloat16))


def test_held_gradients_sum_in_fp32():
    """Accumulation: a small gradient added to a large one keeps its low bits (bf16 sums lose them)."""
    w = nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    opt = MasterWeightAdamW([{"params": [w], "lr": 0.0, "weight_decay": 0.0}], {w: torch.zeros(4)})
    w.grad = torch.full((4,), 256.0, dtype=torch.bfloat16)
    opt.hold_gradients()
    assert torch.equal(w.grad, torch.zeros(4, dtype=torch.bfloat16))  # kept in place, zeroed
    for _ in range(4):  # each 1.0 vanishes against 256 in bf16 (8 bits of mantissa)
        w.grad.add_(1.0)
        opt.hold_gradients()
    w.grad.add_(1.0)
    opt.fold_held_gradients()
    # the fp32 sum 261 rounded once to bf16 (260); summed in bf16 every 1.0 would have vanished: 256
    assert w.grad.tolist() == [torch.tensor(261.0).bfloat16().item()] * 4 == [260.0] * 4


def _run(shapes_dir, out, *extra, config=False):
    from helpers import tiny_sft_config

    from vlforge.recipes.sft import run_sft

    cfg = tiny_sft_config(shapes_dir, out, "precision.mode=bf16", "tiers.method=full", "train.max_steps=4",
                          "data.val=null", "train.seed=3", *extra)
    run_sft(cfg)
    if config:
        return cfg
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
            if '"loss"' in line and '"grad_norm"' in line]


@pytest.mark.parametrize("accum", [1, 2])
def test_sft_trains_as_fp32_masters_do(shapes_dir, tmp_path, accum):
    """A tiny bf16 SFT run: with master_weights=optimizer the forward computes on the same bf16
    values autocast cast the fp32 masters to, so the first step's loss and gradient norm are the
    same bits, and later steps differ only by the update's rounding (CPU: torch's foreach AdamW vs
    ours). The run's linear weights are bf16 and its saved optimizer state holds fp32 masters."""
    extra = (f"train.grad_accum={accum}", "train.batch_size=2")
    fp32 = _run(shapes_dir, tmp_path / "fp32", *extra)
    ours = _run(shapes_dir, tmp_path / "ours", "precision.master_weights=optimizer", "train.save_every=4", *extra)
    # accumulated: the fp32 sum is rounded to bf16 once (fp32 masters keep it fp32): 2^-9 per element
    assert fp32[0]["loss"] == ours[0]["loss"]
    assert fp32[0]["grad_norm"] == pytest.approx(ours[0]["grad_norm"], rel=1e-5 if accum == 1 else 2e-4)
    for a, b in zip(fp32, ours):
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-3) and not b["skipped"]
    state = torch.load(tmp_path / "ours" / "checkpoint-4" / "optimizer.pt", weights_only=True)["state"]
    masters = [s["master"] for s in state.values() if "master" in s]
    assert masters and all(m.dtype == torch.float32 for m in masters)


def test_sft_accumulates_micro_batch_gradients_in_fp32(shapes_dir, tmp_path, monkeypatch):
    """grad_accum=4 (at 1 or 2 a bf16 sum rounded once equals the fp32 sum rounded once): the gradient
    the update reads (MasterWeightAdamW.step) is each micro-batch's bf16 gradient, as it reached its
    weight (a tensor hook: before accumulation), summed in fp32 in backward order and rounded to bf16
    once, bit for bit; summed in bf16 as autograd accumulates it (three roundings) it would differ."""
    from vlforge.recipes import sft as recipe

    micro: dict[str, list[torch.Tensor]] = {}
    names: dict[torch.Tensor, str] = {}
    setup_model = recipe.setup_model

    def spy_setup(cfg, **kwargs):  # the real model, hooks that only record
        t = setup_model(cfg, **kwargs)
        for n, p in t.model.named_parameters():
            if p.requires_grad and p.dtype == torch.bfloat16:
                names[p] = n
                p.register_hook(lambda g, n=n: micro.setdefault(n, []).append(g.detach().clone()))
        return t

    seen = []
    step = MasterWeightAdamW.step

    def spy_step(self, closure=None):
        seen.append({names[p]: p.grad.clone() for g in self.param_groups for p in g["params"] if p in names})
        return step(self, closure)

    monkeypatch.setattr(recipe, "setup_model", spy_setup)
    monkeypatch.setattr(MasterWeightAdamW, "step", spy_step)
    _run(shapes_dir, tmp_path / "run", "precision.master_weights=optimizer", "train.grad_accum=4",
         "train.batch_size=1", "train.max_steps=1")
    [grads] = seen
    assert names and set(grads) == set(micro) == set(names.values())
    differs = 0
    for n, got in grads.items():
        parts = micro[n]
        assert len(parts) == 4 and all(g.dtype == torch.bfloat16 for g in parts), n
        fp32, bf16 = parts[0].float(), parts[0]
        for g in parts[1:]:
            fp32, bf16 = fp32 + g.float(), bf16 + g
        assert torch.equal(got, fp32.to(torch.bfloat16)), n
        differs += int((bf16 != got).sum())
    assert differs > 0  # the gradients' values do round differently summed in bf16


def test_resume_continues_exactly_and_other_masters_are_refused(shapes_dir, tmp_path):
    """4 steps in one go equal 2 + a resume from checkpoint-2 (the fp32 masters come back from the
    optimizer state, not from the bf16 model files); a checkpoint of the other kind is refused."""
    from safetensors.torch import load_file

    mw = ("precision.master_weights=optimizer", "train.save_every=2", "optim.schedule=constant")
    _run(shapes_dir, tmp_path / "whole", *mw)
    _run(shapes_dir, tmp_path / "split", *mw, "train.max_steps=2")
    _run(shapes_dir, tmp_path / "split", *mw, f"train.resume={tmp_path / 'split' / 'checkpoint-2'}")
    whole, split = (load_file(tmp_path / d / "checkpoint-4" / "model.safetensors") for d in ("whole", "split"))
    assert whole.keys() == split.keys() and all(torch.equal(whole[k], split[k]) for k in whole)
    assert {v.dtype for v in whole.values()} == {torch.bfloat16, torch.float32}  # linears bf16, norms fp32
    masters = [torch.load(tmp_path / d / "checkpoint-4" / "optimizer.pt", weights_only=True)["state"]
               for d in ("whole", "split")]
    assert all(v.dtype == torch.float32 for s in masters[1].values() for v in s.values() if torch.is_tensor(v))
    assert all(torch.equal(a["master"], b["master"]) for a, b in zip(masters[0].values(), masters[1].values())
               if "master" in a)
    _run(shapes_dir, tmp_path / "fp32", "train.save_every=2", "train.max_steps=2")
    for src, mode in ((tmp_path / "fp32", "optimizer"), (tmp_path / "whole", "fp32")):
        with pytest.raises(ConfigError, match="master"):
            _run(shapes_dir, tmp_path / f"other-{mode}", f"precision.master_weights={mode}",
                 f"train.resume={src / 'checkpoint-2'}")


def test_refusals(shapes_dir, tmp_path):
    from helpers import tiny_sft_config

    from vlforge.train.trainable import refuse_bad_combinations

    with pytest.raises(ConfigError, match="precision.mode=bf16"):
        PrecisionConfig(mode="fp16", master_weights="optimizer")
    cfg = tiny_sft_config(shapes_dir, tmp_path, "precision.mode=bf16", "precision.master_weights=optimizer",
                          "optim.name=adamw8bit")
    with pytest.raises(ConfigError, match="optim.name=adamw"):  # before any weights load
        refuse_bad_combinations(cfg, torch.device("cpu"))


def test_a_gradient_dropped_after_it_was_held_stays_dropped():
    """drop_keepalive_grads sets a text-only step's vision gradients to None after the last backward:
    the fold must not bring their held sums back (AdamW's momentum and decay would move them)."""
    w = nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    opt = MasterWeightAdamW([{"params": [w], "lr": 0.1, "weight_decay": 0.1}], {w: torch.zeros(4)})
    w.grad = torch.ones(4, dtype=torch.bfloat16)
    opt.hold_gradients()
    w.grad = None
    opt.step()
    assert w.grad is None and not opt.state[w] and torch.equal(w.detach(), torch.zeros(4, dtype=torch.bfloat16))


@pytest.mark.parametrize("accum", [1, 4])
def test_plan_counts_the_held_gradient_sums(shapes_dir, tmp_path, accum):
    """--plan: with gradient accumulation, 4 bytes a working weight of fp32 sums (and none without)."""
    from helpers import tiny_sft_config

    from vlforge.train.memory import memory_estimate
    from vlforge.model.load import build_meta_model
    from vlforge.model.tiers import build_plan

    cfg = tiny_sft_config(shapes_dir, tmp_path, "precision.mode=bf16", "precision.master_weights=optimizer",
                          "tiers.method=full", f"train.grad_accum={accum}")
    model, _ = build_meta_model(cfg.model)
    est = memory_estimate(model, build_plan(model, cfg.tiers), cfg)
    linears = sum(m.weight.numel() + (m.bias.numel() if m.bias is not None else 0)
                  for m in model.modules() if type(m) is nn.Linear)
    # a tied lm_head is the embedding's weight: it keeps fp32, no sum
    tied = model.lm_head.weight.numel() if model.lm_head.weight is model.get_input_embeddings().weight else 0
    assert est["held_gradient_sums"] == (4 * (linears - tied) if accum > 1 else 0)


@pytest.mark.gpu
def test_the_compiled_update_on_cuda_equals_eager():
    """On CUDA the update is compiled (inductor: one kernel per tensor); the same values as eager."""
    def make(compiled):
        g = torch.Generator().manual_seed(0)
        ws = [nn.Parameter(torch.randn(s, generator=g).to("cuda", torch.bfloat16)) for s in ((256, 64), (64,), (3, 7))]
        ws.append(nn.Parameter(torch.randn(5, generator=g).cuda()))
        masters = {w: w.detach().float() for w in ws if w.dtype == torch.bfloat16}
        return ws, MasterWeightAdamW(_groups(ws), masters, compiled=compiled)

    (a, opt_a), (b, opt_b) = make(False), make(True)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        for x, y in zip(a, b):
            x.grad = torch.randn(x.shape, generator=g).to("cuda", x.dtype)
            y.grad = x.grad.clone()
        opt_b.grad_scale = torch.tensor(2.0, device="cuda")
        opt_a.grad_scale = opt_b.grad_scale
        opt_a.step()
        opt_b.step()
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
        if "master" in opt_a.state[x]:
            torch.testing.assert_close(opt_a.state[x]["master"], opt_b.state[y]["master"], rtol=1e-6, atol=1e-7)


def test_the_plan_names_the_working_copies():
    """--plan's precision table: trainable linears bf16 with their masters in the optimizer; the tied
    embedding, norms and frozen weights as with fp32 masters."""
    from vlforge.config import TiersConfig
    from vlforge.train.precision import precision_plan
    from vlforge.model.load import build_meta_model
    from vlforge.model.tiers import build_plan

    from vlforge.config import ModelConfig

    model, _ = build_meta_model(ModelConfig(preset="tiny"))
    table = {r["modules"]: r["storage"] for r in precision_plan(
        model, build_plan(model, TiersConfig(method="full")), PrecisionConfig(master_weights="optimizer"))["table"]}
    assert table["model.language_model.layers.*.self_attn.q_proj"] == "bf16 + fp32 master in the optimizer"
    assert table["model.language_model.embed_tokens"] == table["model.language_model.norm"] == "fp32"


def _auto_cfg(shapes_dir, tmp_path, *extra):
    from helpers import tiny_sft_config

    return tiny_sft_config(shapes_dir, tmp_path, "precision.mode=bf16", "tiers.method=full", *extra)


def test_auto_chooses_optimizer_only_where_it_was_measured(shapes_dir, tmp_path):
    """precision.master_weights=auto (the default): optimizer-held masters for SFT full fine-tuning of a
    dense model in bf16 with AdamW on one CUDA process; fp32 masters, naming why, for anything else."""
    from vlforge.config import GRPOConfig, load_config
    from vlforge.train.precision import auto_master_weights

    cfg = _auto_cfg(shapes_dir, tmp_path)
    assert cfg.precision.master_weights == "auto"
    assert auto_master_weights(cfg, "cuda", "none", moe=False)[0] == "optimizer"
    other = {"a cpu device": ("cpu", "none", False, ()), "strategy=fsdp2": ("cuda", "fsdp2", False, ()),
             "MoE": ("cuda", "none", True, ()), "tiers.method=lora": ("cuda", "none", False, ("tiers.method=lora",)),
             "precision.mode=fp32": ("cuda", "none", False, ("precision.mode=fp32",)),
             "optim.name=adamw8bit": ("cuda", "none", False, ("optim.name=adamw8bit",))}
    for why, (device, strategy, moe, overrides) in other.items():
        choice, reason = auto_master_weights(_auto_cfg(shapes_dir, tmp_path, *overrides), device, strategy, moe)
        assert choice == "fp32" and why in reason, (why, reason)
    grpo = load_config(GRPOConfig, None, ["precision.mode=bf16", "tiers.method=full"])
    choice, reason = auto_master_weights(grpo, "cuda", "none", moe=False)
    assert choice == "fp32" and "GRPO" in reason


def test_auto_is_settled_into_the_config_and_a_resume_keeps_the_checkpoints_form(shapes_dir, tmp_path, capsys):
    """A run with auto records what it chose (config.yaml, trainer_state.json) and prints why; a resume
    with auto keeps the form its checkpoint was saved in (here optimizer-held masters, which auto
    would not choose on a CPU), continuing exactly as the explicit setting does."""
    import yaml

    mw = ("train.save_every=2", "optim.schedule=constant")
    cfg = _run(shapes_dir, tmp_path / "fresh", *mw, "train.max_steps=2", config=True)
    assert cfg.precision.master_weights == "auto"  # the caller's config is left as given
    config = (tmp_path / "fresh" / "config.yaml").read_text()
    assert yaml.safe_load(config)["precision"]["master_weights"] == "fp32"
    assert "\n# precision.master_weights auto: fp32 (a cpu device" in config.split("\nmodel:")[0]  # the header
    assert "precision.master_weights auto: fp32" in capsys.readouterr().out
    _run(shapes_dir, tmp_path / "explicit", *mw, "precision.master_weights=optimizer")
    _run(shapes_dir, tmp_path / "split", *mw, "precision.master_weights=optimizer", "train.max_steps=2")
    state = json.loads((tmp_path / "split" / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["master_weights"] == "optimizer"
    _run(shapes_dir, tmp_path / "split", *mw, f"train.resume={tmp_path / 'split' / 'checkpoint-2'}")  # auto
    assert "optimizer (the form of the checkpoint this run resumes)" in capsys.readouterr().out
    assert yaml.safe_load((tmp_path / "split" / "config.yaml").read_text())["precision"]["master_weights"] == \
        "optimizer"
    from safetensors.torch import load_file

    whole, split = (load_file(tmp_path / d / "checkpoint-4" / "model.safetensors") for d in ("explicit", "split"))
    assert all(torch.equal(whole[k], split[k]) for k in whole)


def test_a_sharded_resume_of_an_optimizer_masters_checkpoint_is_refused_by_name(shapes_dir, tmp_path):
    """auto follows the checkpoint's form, and optimizer-held masters train on one process only: a
    sharded resume of such a checkpoint is refused, saying what to do (never a silent bf16 reduction)."""
    from vlforge.config import ConfigError
    from vlforge.train.precision import settle_master_weights

    cfg = _auto_cfg(shapes_dir, tmp_path)
    with pytest.raises(ConfigError, match="resume it on one process, or `vlforge export` it"):
        settle_master_weights(cfg, "cuda", "fsdp2", moe=False, saved="optimizer")
    precision, note = settle_master_weights(cfg, "cuda", "fsdp2", moe=False, saved="fp32")
    assert precision.master_weights == "fp32" and "checkpoint" in note and cfg.precision.master_weights == "auto"
