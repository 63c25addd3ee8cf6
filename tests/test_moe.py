"""Qwen3-VL mixture-of-experts on CPU with the tiny-moe preset: load, plan, aux loss, train, GRPO, export, quant."""

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from transformers import Qwen3VLMoeForConditionalGeneration
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import load_balancing_loss_func

from vlforge.generate.engine import Engine
from vlforge.config import AttentionConfig, ConfigError, DataConfig, ModelConfig, QuantConfig, SFTConfig, load_config
from vlforge.data.dataset import load_dataset
from vlforge.data.encode import collate
from vlforge.train.losses import backbone_hidden
from vlforge.train.moe import Routing, load_balancing_loss, load_metrics, router_modules
from vlforge.model.load import build_meta_model, load_model
from vlforge.model.tiers import apply_plan, build_plan, plan_summary, unwrap

from helpers import tiny_sft_config


@pytest.fixture(scope="module")
def batch(tiny_moe, shapes_dir):
    data = load_dataset(str(shapes_dir / "val.jsonl"), tiny_moe[1], DataConfig())
    return collate([data[i] for i in range(3)], data.encoder.pad_id)


def _inputs(batch):
    return {k: v for k, v in batch.items() if k != "labels"}


def _logits(model, batch):
    with torch.no_grad():
        return model(**_inputs(batch)).logits


def _tiers(*overrides):
    return load_config(SFTConfig, None, ["tiers.vision.train=true", *overrides]).tiers


def test_tiny_moe_is_transformers_moe_with_the_routers_and_experts(tiny_moe, batch):
    model, processor = tiny_moe
    assert type(model) is Qwen3VLMoeForConditionalGeneration
    assert 100_000 < sum(p.numel() for p in model.parameters()) < 1_000_000
    mlp = model.model.language_model.layers[0].mlp
    assert mlp.experts.gate_up_proj.shape == (8, 64, 64) and mlp.experts.down_proj.shape == (8, 64, 32)
    assert mlp.gate.weight.shape == (8, 64) and mlp.gate.top_k == 2
    # our loss path (backbone, then lm_head) equals the HF forward's logits
    with torch.no_grad():
        ours = model.lm_head(backbone_hidden(model, batch))
    torch.testing.assert_close(ours, _logits(model, batch), rtol=0, atol=0)


def test_model_path_detects_moe_and_gives_identical_logits(tiny_moe, batch, tmp_path):
    model, processor = tiny_moe
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    loaded, _ = load_model(ModelConfig(path=str(tmp_path)))
    assert type(loaded) is Qwen3VLMoeForConditionalGeneration
    assert torch.equal(_logits(loaded, batch), _logits(model, batch))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConfigError, match="model_type"):
        load_model(ModelConfig(path=str(tmp_path)))


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_fast_experts_match_the_eager_reference_forward_and_backward(tiny_moe, batch, impl):
    eager = copy.deepcopy(tiny_moe[0])
    eager.set_experts_implementation("eager")
    fast = copy.deepcopy(tiny_moe[0])
    fast.set_experts_implementation(impl)
    assert fast.config.text_config._experts_implementation == impl
    outs = []
    for m in (eager, fast):
        logits = m(**_inputs(batch)).logits
        (logits.float() ** 2).mean().backward()
        outs.append((logits.detach(), {n: p.grad for n, p in m.named_parameters() if "experts" in n}))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-5, atol=1e-5)
    for n, g in outs[0][1].items():
        torch.testing.assert_close(outs[1][1][n], g, rtol=1e-4, atol=1e-6)


def test_experts_implementation_auto_is_grouped_mm_on_cuda_only():
    from vlforge.model.load import experts_implementation

    assert experts_implementation(ModelConfig(), torch.device("cuda")) == "grouped_mm"
    assert experts_implementation(ModelConfig(), torch.device("cpu")) == "eager"
    assert experts_implementation(ModelConfig(experts_implementation="batched_mm"), torch.device("cpu")) == "batched_mm"


def test_merged_equals_unmerged_for_attention_expert_lora_and_a_trained_router(tiny_moe, batch):
    model = copy.deepcopy(tiny_moe[0])
    plan = build_plan(model, _tiers("tiers.language.experts=true", "tiers.language.router=true"))
    peft_model = apply_plan(model, plan).eval()
    assert type(model.model.language_model.layers[0].mlp.experts).__qualname__ == "FusedExpertsLoRA"  # the default
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n or "modules_to_save" in n:
                p.add_(torch.randn_like(p) * 0.1)  # a trained adapter and router
    unmerged = _logits(peft_model, batch)
    with peft_model.disable_adapter():  # the experts' and router's changes matter
        assert (unmerged - _logits(peft_model, batch)).abs().max() > 1e-2
    merged = peft_model.merge_and_unload()
    assert type(merged) is Qwen3VLMoeForConditionalGeneration
    torch.testing.assert_close(_logits(merged, batch), unmerged, rtol=1e-5, atol=1e-5)


def test_plan_entries_and_counts_for_experts_and_router(tiny_moe):
    model = tiny_moe[0]
    plan = build_plan(model, _tiers("tiers.language.experts=true", "tiers.language.router=true"))
    experts = [e for e in plan if e.target == "parameter"]
    routers = [e for e in plan if e.module.endswith("mlp.gate")]
    # fused expert LoRA (the default) takes the tier's dropout; peft's own forward has none there
    assert len(experts) == 4 and all(e.dropout == 0.1 and e.expert_lora == "fused" for e in experts)
    # peft's A [r*E, in] + B [out, r*E]: gate_up in=H=64, out=2I=64; down in=I=32, out=H=64
    assert {e.module.rsplit(".", 1)[1]: e.params for e in experts} == {"gate_up_proj": 8 * 8 * 128,
                                                                       "down_proj": 8 * 8 * 96}
    assert [e.kind for e in routers] == ["full", "full"] and all(e.params == 8 * 64 for e in routers)
    peft_model = apply_plan(copy.deepcopy(model), plan)
    assert plan_summary(unwrap(peft_model), plan)["trainable_params"] == sum(
        p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert plan_summary(unwrap(peft_model), plan)["total_params"] == plan_summary(model, plan)["total_params"]
    # full fine-tuning: every language weight but the frozen router
    full = build_plan(model, _tiers("tiers.method=full"))
    assert not any("mlp.gate" in e.module for e in full)
    assert any(e.module.endswith("mlp.experts") for e in full)


def test_moe_keys_refused_where_they_mean_nothing(tiny, tiny_moe):
    with pytest.raises(ConfigError, match="dense"):
        build_plan(tiny[0], _tiers("tiers.language.experts=true"))
    with pytest.raises(ConfigError, match="only the language tier"):
        build_plan(tiny_moe[0], _tiers("tiers.vision.router=true"))
    with pytest.raises(ConfigError, match="full fine-tuning already trains the experts"):
        build_plan(tiny_moe[0], _tiers("tiers.method=full", "tiers.language.experts=true"))
    with pytest.raises(ConfigError, match="quant.experts"):
        QuantConfig(language="nf4", experts="int8")
    # the config's choices are only what works (--print-config, the Literal); a refused value says why
    with pytest.raises(ConfigError, match=r"quant.experts: 'fp8' is not one of \['auto', 'none', 'nf4'\]: .*NF4 only"):
        load_config(SFTConfig, None, ["quant.experts=fp8"])


def test_aux_loss_equals_transformers_and_the_switch_formula():
    torch.manual_seed(0)
    L, B, T, E, k = 3, 2, 5, 8, 2
    logits = [torch.randn(B * T, E, requires_grad=True) for _ in range(L)]
    mask = torch.ones(B, T)
    mask[0, :2] = 0
    ref = load_balancing_loss_func(tuple(logits), E, k, mask)
    torch.testing.assert_close(load_balancing_loss(logits, k, mask), ref)
    torch.testing.assert_close(load_balancing_loss(logits, k), load_balancing_loss_func(tuple(logits), E, k))
    # Switch Transformer (k=1, one layer): E * sum_e f_e P_e, f = share of tokens routed to e
    x = logits[0]
    f = torch.bincount(x.argmax(-1), minlength=E).float() / x.shape[0]
    P = x.softmax(-1).mean(0)
    torch.testing.assert_close(load_balancing_loss([x], 1), E * (f * P).sum())
    load_balancing_loss(logits, k, mask).backward()
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in logits)
    # the loss is the balanced value k when every token spreads evenly
    torch.testing.assert_close(load_balancing_loss([torch.zeros(16, E)], 1), torch.tensor(1.0))


def test_router_hooks_give_the_models_own_router_logits_and_aux_loss(tiny_moe, batch):
    model = tiny_moe[0]
    routing = Routing.of(model)
    assert routing.n_layers == 2 and routing.top_k == 2
    with torch.no_grad(), routing.capture(batch["attention_mask"]) as routed:
        out = model(**_inputs(batch), output_router_logits=True)
    for i, ref in enumerate(out.router_logits):
        assert torch.equal(routed.logits[i], ref)
    torch.testing.assert_close(routed.aux_loss(), out.aux_loss)
    with torch.no_grad():
        model(**_inputs(batch))  # outside capture: the hooks keep nothing
    assert routing.step_metrics() and not routing.step_metrics()  # one capture's load, then reset
    routing.remove()
    assert Routing.of(load_model(ModelConfig(preset="tiny"))[0]) is None  # dense: nothing to hook


def test_load_metrics_see_a_collapse():
    balanced = load_metrics(torch.full((2, 8), 10.0))
    assert balanced["moe/max_load_mean"] == pytest.approx(1 / 8) and balanced["moe/entropy_worst"] == pytest.approx(1)
    collapsed = torch.full((2, 8), 10.0)
    collapsed[1] = torch.tensor([40.0, 40.0, 0, 0, 0, 0, 0, 0])
    m = load_metrics(collapsed)
    assert m["moe/worst_layer"] == 1 and m["moe/max_load_worst"] == 0.5 and m["moe/unused_worst"] == 6
    assert m["moe/entropy_worst"] == pytest.approx(1 / 3)  # log 2 / log 8
    assert m["moe/entropy_worst_layer"] == m["moe/unused_worst_layer"] == 1
    # each worst is its own over layers: the busiest expert and lowest entropy (layer 5) and the most
    # unused experts (layer 9) need not be one layer; the model's layer index is reported
    split = torch.stack([torch.tensor([70.0, 2, 2, 2, 2, 2, 0, 0]), torch.tensor([20.0, 20, 20, 20, 0, 0, 0, 0])])
    m = load_metrics(split, layers=[5, 9])
    assert m["moe/worst_layer"] == 5 and m["moe/max_load_worst"] == pytest.approx(70 / 80)
    assert m["moe/unused_worst_layer"] == 9 and m["moe/unused_worst"] == 4
    assert m["moe/entropy_worst_layer"] == 5 and m["moe/entropy_worst"] < math.log(4) / math.log(8)  # layer 9's


def _spy_setup(monkeypatch, recipe):
    captured = {}
    original = recipe.setup_model

    def spy(c, **kwargs):
        t = original(c, **kwargs)
        captured["t"] = t
        captured["before"] = {n: p.detach().clone() for n, p in t.model.named_parameters()}
        return t

    monkeypatch.setattr(recipe, "setup_model", spy)
    return captured


@pytest.mark.parametrize("overrides", [
    ["tiers.method=lora", "tiers.language.experts=true"],  # router frozen (the default)
    ["tiers.method=lora", "tiers.language.experts=true", "tiers.language.router=true"],
    ["tiers.method=full", "tiers.language.router=false"],
])
def test_sft_step_changes_exactly_the_trainable_params_and_logs_expert_load(shapes_dir, tmp_path, monkeypatch,
                                                                            overrides):
    from vlforge.recipes import sft as recipe

    captured = _spy_setup(monkeypatch, recipe)
    cfg = tiny_sft_config(shapes_dir, tmp_path / "run", "model.preset=tiny-moe", "data.val=null",
                          "train.max_steps=2", "tiers.language.lr=0.01", "loss.router_aux_loss_coef=0.01", *overrides)
    recipe.run_sft(cfg)
    t, before = captured["t"], captured["before"]
    trainable = {n for n, p in t.model.named_parameters() if p.requires_grad}
    assert any("experts" in n for n in trainable)
    assert any("mlp.gate" in n for n in trainable) == ("tiers.language.router=true" in overrides)
    for n, p in t.model.named_parameters():
        changed = not torch.equal(before[n], p.detach())
        assert changed == p.requires_grad, f"{n}: trainable={p.requires_grad} changed={changed}"
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    for key in ["moe/aux_loss", "moe/max_load_mean", "moe/max_load_worst", "moe/entropy_mean", "moe/entropy_worst",
                "moe/unused_mean", "moe/unused_worst", "moe/worst_layer", "moe/entropy_worst_layer",
                "moe/unused_worst_layer"]:
        assert key in row, key
    assert 1.0 <= row["moe/aux_loss"] < 8.0 and 1 / 8 <= row["moe/max_load_worst"] <= 0.5


def test_aux_loss_gradient_reaches_the_router(shapes_dir, tmp_path, tiny_moe):
    """With only the aux loss the router still moves: the coefficient is wired into the backward."""
    from vlforge.train.moe import aux_term, capture

    model = copy.deepcopy(tiny_moe[0])
    routing = Routing.of(model, coef=1.0)
    data = load_dataset(str(shapes_dir / "val.jsonl"), tiny_moe[1], DataConfig())
    b = collate([data[i] for i in range(2)], data.encoder.pad_id)
    with capture(routing, b["attention_mask"]) as routed:
        model(**_inputs(b))
    aux_term(routing, routed, 1).backward()
    assert model.model.language_model.layers[1].mlp.gate.weight.grad.abs().sum() > 0
    assert "moe/aux_loss" in routing.step_metrics()


def _router_grads(monkeypatch, recipe, run, cfg) -> tuple[list[dict], list[dict]]:
    """Run `run(cfg)` and return (every backward's router gradients, metrics rows): hooks fire after
    each backward's accumulation, before clipping and the optimizer see the gradient."""
    grads: list[dict] = []
    original = recipe.setup_model

    def spy(c, **kwargs):
        t = original(c, **kwargs)
        for n, p in t.model.named_parameters():
            if "mlp.gate" in n and p.requires_grad:
                def keep(p, n=n):
                    if not grads or n in grads[-1]:  # a new backward
                        grads.append({})
                    grads[-1][n] = p.grad.detach().clone()
                p.register_post_accumulate_grad_hook(keep)
        return t

    monkeypatch.setattr(recipe, "setup_model", spy)
    run(cfg)
    rows = [json.loads(line) for line in (Path(cfg.train.output_dir) / "metrics.jsonl").read_text().splitlines()]
    return grads, rows


@pytest.mark.parametrize("recipe_name", ["sft", "grpo"])
def test_recipes_add_the_router_aux_loss_to_the_backward(shapes_dir, tmp_path, monkeypatch, recipe_name):
    """Through the recipe, not aux_term alone: from the same seed, coef > 0 changes the trained
    router's gradient of the step's first backward by coef x the aux loss's gradient (linear in coef,
    so 2 x coef doubles the change), while the logged task loss is the same and moe/aux_loss the
    aux term's value. Fails if the recipe stops adding the term (or adds it unscaled)."""
    import importlib

    recipe = importlib.import_module(f"vlforge.recipes.{recipe_name}")
    results = []
    for coef in (0.0, 0.5, 1.0):
        out = tmp_path / f"coef{coef}"
        common = ["model.preset=tiny-moe", "tiers.method=lora", "tiers.language.router=true",
                  f"loss.router_aux_loss_coef={coef}", "train.max_steps=1", "train.seed=0"]
        if recipe_name == "sft":
            cfg = tiny_sft_config(shapes_dir, out, *common, "data.val=null", "tiers.language.dropout=0.0")
            run = recipe.run_sft
        else:
            from test_grpo import grpo_config

            # one optimizer step over all 8 sequences: the logged loss is of the weights both runs start from
            cfg = grpo_config(shapes_dir, out, tmp_path, *common, "rl.mini_batch_size=8")
            run = recipe.run_grpo
        results.append(_router_grads(monkeypatch, recipe, run, cfg))
    (g0, rows0), (g1, rows1), (g2, rows2) = results
    first = [g[0] for g in (g0, g1, g2)]  # the first backward: same weights, same batch in every run
    assert first[0] and set(first[0]) == set(first[1]) == set(first[2])
    assert len(first[0]) == 2  # both MoE layers' routers are trained
    for n in first[0]:
        change = first[1][n] - first[0][n]
        assert change.abs().max() > 1e-6, f"{n}: the aux loss did not reach the router's gradient"
        torch.testing.assert_close(first[2][n] - first[0][n], 2 * change, rtol=1e-3, atol=1e-7)
    assert rows1[0]["loss"] == pytest.approx(rows0[0]["loss"], rel=1e-6)  # the task loss, logged apart
    assert rows1[0]["moe/aux_loss"] == pytest.approx(rows0[0]["moe/aux_loss"], rel=1e-6)
    assert 1.0 <= rows1[0]["moe/aux_loss"] < 8.0  # balanced routing gives top_k = 2


def test_grpo_rollout_logprobs_agree_with_the_trainer_on_moe(tiny_moe, shapes_dir):
    from vlforge.config import RolloutConfig
    from vlforge.data.encode import encode_prompt
    from vlforge.rollout.groups import generate_groups
    from vlforge.rollout.logprobs import sequence_logprobs

    model = copy.deepcopy(tiny_moe[0])
    model = apply_plan(model, build_plan(model, _tiers("tiers.language.experts=true"))).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.05)
    data = load_dataset(str(shapes_dir / "train.jsonl"), tiny_moe[1], DataConfig())
    prompts = collate([encode_prompt(data.encoder, data.samples[i]) for i in range(3)], data.encoder.pad_id,
                      left_pad=True)
    torch.manual_seed(0)
    with torch.no_grad():  # the generation engine's rollout: its log-probs are the trainer's
        rollout = generate_groups(Engine(model), data.encoder, prompts, [1, 1, 1],
                                  RolloutConfig(group_size=4, max_new_tokens=8, temperature=1.0))
        logp, _ = sequence_logprobs(model, rollout, 1.0)
    mask = rollout.response_mask.bool()
    assert mask.sum() > 12
    torch.testing.assert_close(logp[mask], rollout.logprobs[mask], atol=1e-5, rtol=1e-5)
    # the rollout's experts against the trainer's, token for token: test_router_replay.py
    # (test_recorded_routes_are_the_full_forwards_routes_exactly_in_fp32)


def test_grpo_step_on_moe_trains_experts_and_logs_expert_load(shapes_dir, tmp_path, monkeypatch):
    from test_grpo import grpo_config
    from vlforge.recipes import grpo as recipe

    captured = _spy_setup(monkeypatch, recipe)
    cfg = grpo_config(shapes_dir, tmp_path / "run", tmp_path, "model.preset=tiny-moe", "tiers.method=lora",
                      "tiers.language.experts=true", "loss.router_aux_loss_coef=0.01")
    recipe.run_grpo(cfg)
    t, before = captured["t"], captured["before"]
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["groups_trained"] > 0 and "moe/max_load_worst" in row and "moe/aux_loss" in row
    for n, p in t.model.named_parameters():
        changed = not torch.equal(before[n], p.detach())
        assert changed == p.requires_grad, f"{n}: trainable={p.requires_grad} changed={changed}"


@pytest.fixture(scope="module")
def moe_lora_run(shapes_dir, tmp_path_factory):
    from vlforge.recipes.sft import run_sft

    out = tmp_path_factory.mktemp("moe_lora_run")
    cfg = tiny_sft_config(shapes_dir, out, "model.preset=tiny-moe", "tiers.method=lora", "tiers.language.experts=true",
                          "tiers.language.router=true", "tiers.language.lr=0.02", "tiers.projector.lr=0.02",
                          "tiers.vision.lr=0.02", "train.max_steps=3", "data.val=null")
    run_sft(cfg)
    return cfg, out / "checkpoint-3"


def test_moe_merged_and_adapter_exports_load_with_the_unmerged_logits(moe_lora_run, batch, tmp_path):
    from peft import PeftModel

    from vlforge.model.export import export

    cfg, ckpt = moe_lora_run
    base, _ = load_model(cfg.model, dtype=torch.float32)
    reference = PeftModel.from_pretrained(base, str(ckpt)).eval()
    expected = _logits(reference, batch)
    with reference.disable_adapter():
        assert (expected - _logits(reference, batch)).abs().max() > 1e-3

    export(ckpt, tmp_path / "merged", merge=True, dtype=torch.float32)
    plain = Qwen3VLMoeForConditionalGeneration.from_pretrained(tmp_path / "merged", local_files_only=True).eval()
    torch.testing.assert_close(_logits(plain, batch), expected, rtol=1e-4, atol=1e-4)

    from vlforge.model.export import load_lora_checkpoint
    from vlforge.model.moe_lora import FusedExpertsLoRA

    served, _, _ = load_lora_checkpoint(ckpt, torch.float32, quant=QuantConfig())  # serve's unmerged load
    assert type(unwrap(served).model.language_model.layers[0].mlp.experts) is FusedExpertsLoRA
    torch.testing.assert_close(_logits(served.eval(), batch), expected, rtol=1e-5, atol=1e-5)

    result = export(ckpt, tmp_path / "adapter")
    assert result["kind"] == "adapter"
    base2, _ = load_model(cfg.model, dtype=torch.float32)
    adapter = PeftModel.from_pretrained(base2, str(tmp_path / "adapter")).eval()
    torch.testing.assert_close(_logits(adapter, batch), expected, rtol=0, atol=0)


def test_quant_plan_quantizes_attention_and_can_keep_experts_and_routers_plain(tiny_moe):
    """quant.experts=none: the attention alone is NF4 (the experts and routers stay in the load
    dtype); tests/test_moe_quant.py covers the NF4 experts that quant.language=nf4 gives by default."""
    from vlforge.model.quant import expert_plan, format_report, quant_plan, verify

    q = QuantConfig(language="nf4", experts="none")
    meta, _ = build_meta_model(ModelConfig(preset="tiny-moe"))
    plan = quant_plan(meta, q)
    nf4 = {n for n, m in plan.items() if m == "nf4"}
    assert nf4 == {f"model.language_model.layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "qkvo"}
    assert expert_plan(meta, q) == {f"model.language_model.layers.{i}.mlp.experts.{p}": "none" for i in range(2)
                                    for p in ("gate_up_proj", "down_proj")}
    assert set(expert_plan(meta, QuantConfig(language="nf4")).values()) == {"nf4"}  # auto follows the language
    assert set(expert_plan(meta, QuantConfig(language="int8")).values()) == {"none"}  # NF4 experts only
    assert not any("mlp.gate" in n for n in plan)  # the router is no nn.Linear: never quantized
    model, _ = load_model(ModelConfig(preset="tiny-moe"), dtype=torch.bfloat16, quant=q)
    report = verify(model, q)
    assert report["linears"]["language:nf4"] == 8 and report["linears"]["experts:none"] == 4
    assert "experts:none 4" in format_report(report)
    assert type(model.model.language_model.layers[0].mlp.experts.gate_up_proj.data) is torch.Tensor


def test_plan_json_on_30b_a3b_meta_shows_experts_and_router(capsys):
    from vlforge.cli import main

    args = ["sft", "configs/qwen3vl-8b-lora.yaml", "model.preset=qwen3vl-30b-a3b", "tiers.language.experts=true",
            "tiers.language.router=true", "activation_checkpointing.enabled=true", "--plan", "--json"]
    assert main(args) == 0
    plan = json.loads(capsys.readouterr().out)
    experts = [e for e in plan["modules"] if e["target"] == "parameter"]
    routers = [e for e in plan["modules"] if e["module"].endswith("mlp.gate")]
    assert len(experts) == 96 and len(routers) == 48
    gate_up = next(e for e in experts if e["module"].endswith("layers.0.mlp.experts.gate_up_proj"))
    assert gate_up["params"] == 8 * 128 * (2048 + 2 * 768) and routers[0]["params"] == 128 * 2048
    assert 31.0e9 < plan["total_params"] < 31.5e9  # 31.07B base + adapters
    assert plan["memory"]["expert_lora_copies"] == 0  # fused expert LoRA folds nothing
    assert main([*args, "tiers.expert_lora=peft"]) == 0  # peft's path keeps one layer's folded experts, bf16
    assert json.loads(capsys.readouterr().out)["memory"]["expert_lora_copies"] == pytest.approx(128 * 3 * 768 * 2048 * 2)


def test_packed_rows_give_the_padded_batchs_aux_loss_and_expert_load(tiny_moe, shapes_dir):
    """A packed row's router statistics count its real tokens only, as a padded batch's do: the same
    samples packed or padded give the same load-balancing loss and expert counts."""
    from vlforge.data.encode import pack
    from vlforge.train.inputs import real_tokens
    from vlforge.train.losses import sft_loss_sum
    from vlforge.train.moe import capture

    model = tiny_moe[0]
    routing = Routing.of(model, coef=1.0)
    data = load_dataset(str(shapes_dir / "val.jsonl"), tiny_moe[1], DataConfig())
    items = [data[i] for i in range(3)]
    results = []
    for b in (collate(items, data.encoder.pad_id), pack(items, data.encoder.pad_id, pad_to=512)):
        with torch.no_grad(), capture(routing, real_tokens(b)) as routed:
            sft_loss_sum(model, b)
        results.append((routed.aux_loss(), routed.counts()))
    (aux_padded, counts_padded), (aux_packed, counts_packed) = results
    assert counts_packed.sum() == counts_padded.sum() == sum(len(x["input_ids"]) for x in items) * 2 * \
        len(router_modules(model))  # top-2 of every real token, in every MoE layer
    torch.testing.assert_close(counts_packed, counts_padded)
    torch.testing.assert_close(aux_packed, aux_padded, rtol=1e-5, atol=1e-6)


def test_router_aux_loss_on_two_ranks_equals_one_process_accumulating(shapes_dir, tmp_path):
    """The load-balancing loss is a mean over micro-batches: 2 ranks x batch 2 make the update one
    process makes with batch 2 x accum 2 on the same samples (not world size x the router loss)."""
    import os
    import subprocess
    import sys

    from safetensors.torch import load_file

    from vlforge.recipes.sft import run_sft

    common = ["model.preset=tiny-moe", "precision.mode=fp32", "train.device=cpu", "log.progress=false", "data.val=null",
              "optim.schedule=constant", "optim.warmup_steps=0", "train.seed=0", "tiers.method=full",
              "tiers.vision.train=true", "tiers.language.router=true", "tiers.language.lr=0.01",
              "loss.router_aux_loss_coef=1.0", "train.max_steps=2", "train.save_every=2", "train.batch_size=2",
              f"data.train={shapes_dir / 'train.jsonl'}"]
    one = tmp_path / "one"
    run_sft(load_config(SFTConfig, None, [*common, f"train.output_dir={one}", "train.grad_accum=2"]))
    two = tmp_path / "two"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    config = tmp_path / "run.yaml"
    config.write_text(f"data: {{train: {shapes_dir / 'train.jsonl'}}}\n")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "vlforge", "sft", str(config), *common, f"train.output_dir={two}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [[json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()] for d in (one, two)]
    assert [r["moe/aux_loss"] for r in rows[1] if "moe/aux_loss" in r] == \
        pytest.approx([r["moe/aux_loss"] for r in rows[0] if "moe/aux_loss" in r], rel=1e-5)
    from vlforge.model.export import export

    export(two / "checkpoint-2", tmp_path / "consolidated", dtype=torch.float32)
    ours, theirs = load_file(tmp_path / "consolidated" / "model.safetensors"), \
        load_file(one / "checkpoint-2" / "model.safetensors")
    for name in ("model.language_model.layers.0.mlp.gate.weight", "model.language_model.layers.1.mlp.gate.weight"):
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-5, atol=1e-6, msg=name)


def test_flex_attention_is_refused_for_the_dense_model_with_the_reason():
    """transformers' dense Qwen3-VL class declares no flex_attention support (its MoE class does):
    a ConfigError naming the key, not a ValueError from inside from_pretrained."""
    with pytest.raises(ConfigError, match="model.attention.implementation=flex_attention"):
        load_model(ModelConfig(preset="tiny", attention=AttentionConfig(implementation="flex_attention")))
    model, _ = load_model(ModelConfig(preset="tiny-moe", attention=AttentionConfig(implementation="flex_attention")))
    assert model.config._attn_implementation == "flex_attention"


def _step_metrics_on_rank(rank: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    from vlforge.train.distributed import World

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        world = World(rank=rank, size=2, strategy="ddp")
        model = load_model(ModelConfig(preset="tiny-moe"))[0]
        routing = Routing.of(model, coef=0.01)
        if rank == 0:  # rank 1 counts nothing this step (GRPO: only padding forwards, never captured)
            with torch.no_grad(), routing.capture(None) as routed:
                model(input_ids=torch.arange(1, 9)[None])
            routing.record_aux(routed.aux_loss())
        row = routing.step_metrics(world)
        after = world.sums(float(rank + 1))  # the next collective must pair with its own kind
        torch.save((row, after), f"{out_dir}/{rank}.pt")
        dist.barrier()  # leave together (train/distributed.World.close says why)
    finally:
        dist.destroy_process_group()


def test_step_metrics_are_one_collective_on_every_rank_even_one_that_counted_nothing(tmp_path):
    """Several ranks: expert-load metrics are summed across ranks; a rank that counted no token must
    still join those sums, or its next collective pairs with the others' sums (gloo aborts on the
    size mismatch; NCCL hangs). Both ranks log the same row: rank 0's tokens."""
    import torch.multiprocessing as mp

    mp.start_processes(_step_metrics_on_rank, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2,
                       start_method="spawn", join=True)
    (row0, after0), (row1, after1) = (torch.load(tmp_path / f"{r}.pt") for r in (0, 1))
    assert row0 and row0 == row1 and "moe/aux_loss" in row0
    assert after0 == after1 == [3.0]
