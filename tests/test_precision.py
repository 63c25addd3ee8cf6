import math

import pytest
import torch

from vlforge.config import PrecisionConfig
from vlforge.data.dataset import load_dataset
from vlforge.data.encode import collate
from vlforge.train.health import GradHealth
from vlforge.train.optim import build_optimizer
from vlforge.train.precision import PrecisionPolicy
from vlforge.model.tiers import param_groups
from vlforge.train.trainable import setup_model
from vlforge.recipes.sft import train_step

from helpers import tiny_sft_config


@pytest.mark.parametrize("mode,frozen", [("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)])
def test_policy_storage_dtypes_and_a_finite_step(shapes_dir, tmp_path, mode, frozen):
    cfg = tiny_sft_config(shapes_dir, tmp_path, f"precision.mode={mode}", "tiers.method=lora")
    t = setup_model(cfg)
    for name, p in t.model.named_parameters():
        assert p.dtype == (torch.float32 if p.requires_grad else frozen), name  # fp32 master weights
    assert t.policy.uses_loss_scaling == (mode == "fp16")
    data = load_dataset(cfg.data.train, t.processor, cfg.data)
    optimizer = build_optimizer(param_groups(t.model, t.plan, 0.0), cfg.optim, "cpu")
    optimizer_state_dtypes = set()
    result = train_step(t, [collate([data[i] for i in range(4)], data.encoder.pad_id)], optimizer,
                        t.policy.grad_scaler(), GradHealth(t.model, t.plan, cfg.health), 1.0)
    assert math.isfinite(result["loss"]) and math.isfinite(result["grad_norm"])
    for state in optimizer.state.values():
        optimizer_state_dtypes |= {state["exp_avg"].dtype, state["exp_avg_sq"].dtype}
    assert optimizer_state_dtypes == {torch.float32}


def test_bf16_loss_is_close_to_fp32(shapes_dir, tmp_path):
    from vlforge.train.losses import sft_loss_sum

    losses = {}
    for mode in ("fp32", "bf16"):
        cfg = tiny_sft_config(shapes_dir, tmp_path / mode, f"precision.mode={mode}", "tiers.method=full")
        t = setup_model(cfg)
        data = load_dataset(cfg.data.train, t.processor, cfg.data)
        batch = collate([data[i] for i in range(8)], data.encoder.pad_id)
        with torch.no_grad(), t.policy.autocast():
            loss, n = sft_loss_sum(t.model, batch)
        assert loss.dtype == torch.float32  # the loss is computed in fp32 whatever the compute dtype
        losses[mode] = float(loss) / n
    assert losses["bf16"] == pytest.approx(losses["fp32"], rel=2e-2)


def test_non_finite_gradient_never_reaches_the_weights(shapes_dir, tmp_path):
    cfg = tiny_sft_config(shapes_dir, tmp_path, "precision.mode=fp32", "tiers.method=full")
    t = setup_model(cfg)
    data = load_dataset(cfg.data.train, t.processor, cfg.data)
    optimizer = build_optimizer(param_groups(t.model, t.plan, 0.0), cfg.optim, "cpu")
    before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    hook = t.model.lm_head.weight.register_hook(lambda g: g * float("nan"))
    result = train_step(t, [collate([data[i] for i in range(4)], data.encoder.pad_id)], optimizer,
                        t.policy.grad_scaler(), GradHealth(t.model, t.plan, cfg.health), 1.0)
    hook.remove()
    assert result["skipped"] and not math.isfinite(result["grad_norm"])
    for n, p in t.model.named_parameters():
        assert torch.equal(before[n], p.detach()), n


def test_autocast_is_off_for_fp32():
    with PrecisionPolicy(PrecisionConfig(mode="fp32"), "cpu").autocast():
        assert not torch.is_autocast_enabled("cpu")
    with PrecisionPolicy(PrecisionConfig(mode="bf16"), "cpu").autocast():
        assert torch.is_autocast_enabled("cpu")


# ----------------------------------------------------------------------------- per-module policy


OVERRIDES = ("precision.overrides=[{pattern: norm, storage: fp32, compute: fp32},"
             " {pattern: '^model\\.visual\\.blocks\\.0\\.', compute: fp32}]")


def test_policy_resolves_per_module_overrides_last_match_wins():
    from vlforge.config import ModuleOverride

    cfg = PrecisionConfig(mode="bf16", overrides=[ModuleOverride("norm", compute="fp32", storage="fp32"),
                                                  ModuleOverride(r"^model\.visual\.", storage="fp16"),
                                                  ModuleOverride(r"visual\.merger\.norm", compute="bf16")])
    policy = PrecisionPolicy(cfg, "cpu")
    assert policy.module_compute("model.language_model.layers.3.input_layernorm") == torch.float32
    assert policy.frozen_storage("model.language_model.layers.3.input_layernorm") == torch.float32
    assert policy.module_compute("model.language_model.layers.3.self_attn.q_proj") == torch.bfloat16
    assert policy.frozen_storage("model.language_model.layers.3.self_attn.q_proj") == torch.bfloat16
    # peft's wrapper names resolve like the plain model's
    assert policy.frozen_storage("base_model.model.model.visual.blocks.0.attn.qkv.base_layer") == torch.float16
    # the later merger rule brings compute back to bf16, and storage follows the later fp16 rule
    assert policy.module_compute("model.visual.merger.norm") == torch.bfloat16
    assert policy.frozen_storage("model.visual.merger.norm") == torch.float16
    # trainable weights are master weights whatever the module
    assert policy.param_dtype("model.visual.merger.norm", trainable=True) == torch.float32
    assert PrecisionPolicy(PrecisionConfig(master_weights="compute"), "cpu").master_dtype == torch.bfloat16


def test_overrides_change_storage_and_compute_of_the_matching_modules(shapes_dir, tmp_path):
    from vlforge.train.losses import sft_loss_sum

    cfg = tiny_sft_config(shapes_dir, tmp_path, "precision.mode=bf16", "tiers.method=lora", OVERRIDES)
    t = setup_model(cfg)
    seen = {}
    watch = {"model.language_model.layers.0.input_layernorm", "model.visual.blocks.0.attn.qkv.base_layer",
             "model.visual.blocks.1.attn.qkv.base_layer", "model.language_model.layers.0.self_attn.q_proj.base_layer"}
    for name, module in t.model.named_modules():
        short = name.removeprefix("base_model.model.")
        if short in watch:
            module.register_forward_hook(lambda m, i, o, n=short: seen.update({n: (o.dtype, m.weight.dtype)}))
    data = load_dataset(cfg.data.train, t.processor, cfg.data)
    with t.policy.autocast():
        loss, _ = sft_loss_sum(t.model, collate([data[i] for i in range(4)], data.encoder.pad_id))
    loss.backward()  # the mixed graph must differentiate
    assert seen["model.language_model.layers.0.input_layernorm"] == (torch.float32, torch.float32)
    assert seen["model.visual.blocks.0.attn.qkv.base_layer"] == (torch.float32, torch.float32)  # override
    assert seen["model.visual.blocks.1.attn.qkv.base_layer"] == (torch.bfloat16, torch.bfloat16)  # not matched
    assert seen["model.language_model.layers.0.self_attn.q_proj.base_layer"] == (torch.bfloat16, torch.bfloat16)


def test_an_fp32_attention_override_trains_and_generates_in_fp32(shapes_dir, tmp_path):
    """An override on a module holding others (`self_attn$`, compute fp32) runs all of it in fp32: its
    projections and norms are stored and computed in fp32 as the plan says (they inherit it; an own
    rule still wins), and a rollout keeps those layers' KV cache in fp32, so the engine's log-probs
    of its tokens are the trainer's (bf16 everywhere else). Both crashed before: q/k in fp32 met a
    bf16 v_proj in training, an fp32 query met the bf16 cache in decoding."""
    from vlforge.config import ModuleOverride, RolloutConfig
    from vlforge.data.encode import encode_prompt
    from vlforge.train.losses import sft_loss_sum
    from vlforge.generate.engine import Engine
    from vlforge.rollout.groups import generate_groups
    from vlforge.rollout.logprobs import sequence_logprobs

    policy = PrecisionPolicy(PrecisionConfig(mode="bf16", overrides=[ModuleOverride(r"self_attn$", compute="fp32"),
                                                                     ModuleOverride(r"o_proj$", compute="bf16")]), "cpu")
    attn = "model.language_model.layers.1.self_attn"
    assert policy.module_compute(f"{attn}.k_proj") == policy.module_compute(f"{attn}.q_norm") == torch.float32
    assert policy.frozen_storage(f"{attn}.v_proj") == torch.float32
    assert policy.module_compute(f"{attn}.o_proj") == torch.bfloat16  # its own rule wins over the parent's
    assert policy.module_compute("model.language_model.layers.1.mlp.up_proj") == torch.bfloat16

    cfg = tiny_sft_config(shapes_dir, tmp_path, "precision.mode=bf16", "tiers.method=lora",
                          "precision.overrides=[{pattern: 'self_attn$', compute: fp32}]")
    t = setup_model(cfg)
    data = load_dataset(cfg.data.train, t.processor, cfg.data)
    with t.policy.autocast():
        loss, _ = sft_loss_sum(t.model, collate([data[i] for i in range(4)], data.encoder.pad_id))
    loss.backward()
    prompts = collate([encode_prompt(data.encoder, data.samples[i]) for i in range(2)], data.encoder.pad_id,
                      left_pad=True)
    rollout_cfg = RolloutConfig(group_size=3, max_new_tokens=6, temperature=1.0)
    with torch.no_grad(), t.policy.autocast(), t.policy.inference_weights(t.model):
        engine = Engine(t.model)
        rollout = generate_groups(engine, data.encoder, prompts, [len(data.samples[i].images) for i in range(2)],
                                  rollout_cfg, seed=3)
        logp, _ = sequence_logprobs(t.model, rollout, rollout_cfg.temperature)
    cache = engine.runner.cache
    assert {k.dtype for k in cache.keys} == {torch.float32}  # every layer's attention is fp32 here
    real = rollout.response_mask.bool()
    torch.testing.assert_close(logp[real], rollout.logprobs[real], atol=1e-5, rtol=0)  # measured: 5e-7


def test_master_weights_in_compute_dtype(shapes_dir, tmp_path):
    cfg = tiny_sft_config(shapes_dir, tmp_path, "precision.mode=bf16", "precision.master_weights=compute",
                          "tiers.method=full")
    t = setup_model(cfg)
    assert {p.dtype for p in t.model.parameters()} == {torch.bfloat16}


def test_plan_shows_storage_and_compute_per_module(shapes_dir, tmp_path):
    from vlforge.cli import main

    import contextlib
    import io
    import json

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["sft", "configs/qwen3vl-2b-full.yaml", "--plan", "--json", OVERRIDES]) == 0
    rows = {r["modules"]: r for r in json.loads(buf.getvalue())["precision"]["table"]}
    assert rows["model.language_model.layers.*.input_layernorm"]["storage"] == "fp32"
    assert rows["model.language_model.layers.*.input_layernorm"]["compute"] == "fp32"
    assert rows["model.language_model.layers.*.mlp.up_proj"]["compute"] == "bf16"
    assert rows["model.language_model.layers.*.mlp.up_proj"]["count"] == 28


# ----------------------------------------------------------------------------- fp16 loss scaling


def test_fp16_scaler_skips_an_inf_step_backs_off_and_recovers(shapes_dir, tmp_path):
    cfg = tiny_sft_config(shapes_dir, tmp_path, "precision.mode=fp16", "tiers.method=lora",
                          "precision.loss_scale.init_scale=1024", "precision.loss_scale.growth_interval=1")
    t = setup_model(cfg)
    data = load_dataset(cfg.data.train, t.processor, cfg.data)
    optimizer = build_optimizer(param_groups(t.model, t.plan, 0.0), cfg.optim, "cpu")
    scaler, health = t.policy.grad_scaler(), GradHealth(t.model, t.plan, cfg.health, "fp16")
    batch = lambda k: [collate([data[i] for i in range(4 * k, 4 * k + 4)], data.encoder.pad_id)]
    trainable = [p for p in t.model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in trainable]
    hook = trainable[0].register_hook(lambda g: g * float("inf"))  # an fp16 overflow, injected
    bad = train_step(t, batch(0), optimizer, scaler, health, 1.0)
    hook.remove()
    assert bad["skipped"] and bad["loss_scale"] == 1024 and scaler.get_scale() == 512  # backed off
    assert all(torch.equal(b, p) for b, p in zip(before, trainable))  # the weights did not move
    good = train_step(t, batch(1), optimizer, scaler, health, 1.0)
    assert not good["skipped"] and math.isfinite(good["grad_norm"])
    assert scaler.get_scale() == 1024  # grew again after growth_interval finite steps
    assert any(not torch.equal(b, p) for b, p in zip(before, trainable))
    assert health.bad_streak == 0


def test_grpo_loss_terms_are_fp32_before_scaling():
    from vlforge.rl import agg_loss, kl_penalty, policy_loss

    logp = torch.randn(2, 5, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = policy_loss(logp, logp.detach() + 0.01, torch.ones(2), torch.ones(2, 5))
        kl = agg_loss(kl_penalty(logp, logp.detach() - 0.02, "k3"), torch.ones(2, 5), "token-mean")
    assert loss.dtype == torch.float32 and kl.dtype == torch.float32


# ----------------------------------------------------------------------------- checkpoints across precisions


@pytest.mark.parametrize("mode,master", [("fp16", "fp32"), ("bf16", "compute")])
def test_checkpoint_keeps_dtypes_and_resume_is_exact(shapes_dir, tmp_path, mode, master):
    from safetensors.torch import load_file

    from vlforge.recipes.sft import run_sft

    def run(out, steps, *extra):
        cfg = tiny_sft_config(shapes_dir, out, f"precision.mode={mode}", f"precision.master_weights={master}",
                              "tiers.method=full", "tiers.vision.train=false", "optim.schedule=constant",
                              "precision.loss_scale.init_scale=256", "precision.loss_scale.growth_interval=2",
                              f"train.max_steps={steps}", "eval.every=0", "data.val=null", *extra)
        return run_sft(cfg)

    run(tmp_path / "straight", 6)
    run(tmp_path / "split", 3)
    saved = load_file(tmp_path / "split" / "checkpoint-3" / "model.safetensors")
    frozen = torch.float16 if mode == "fp16" else torch.bfloat16
    trained = torch.float32 if master == "fp32" else torch.bfloat16
    for name, tensor in saved.items():
        vision_tower = name.startswith("model.visual.") and "merger" not in name  # frozen; the projector trains
        assert tensor.dtype == (frozen if vision_tower else trained), name  # no silent upcast
    if mode == "fp16":
        assert torch.load(tmp_path / "split" / "checkpoint-3" / "scaler.pt")["scale"] > 0
    run(tmp_path / "split", 6, "train.resume=auto")
    a = load_file(tmp_path / "straight" / "checkpoint-6" / "model.safetensors")
    b = load_file(tmp_path / "split" / "checkpoint-6" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_unsafe_precision_combinations_are_refused(shapes_dir, tmp_path):
    from vlforge.config import ConfigError, ModuleOverride

    with pytest.raises(ConfigError, match="master_weights=fp32"):
        PrecisionConfig(mode="fp16", master_weights="compute")
    with pytest.raises(ConfigError, match="underflow"):
        PrecisionConfig(mode="bf16", overrides=[ModuleOverride("visual", compute="fp16")])
    with pytest.raises(ConfigError, match="cannot be combined"):
        setup_model(tiny_sft_config(shapes_dir, tmp_path, "tiers.method=lora", "quant.language=nf4",
                                    "precision.mode=bf16", "precision.fp8.enabled=true"))


def test_trainable_weights_of_an_fp32_compute_module_are_fp32():
    from vlforge.config import ModuleOverride

    policy = PrecisionPolicy(PrecisionConfig(mode="bf16", master_weights="compute",
                                             overrides=[ModuleOverride("norm", compute="fp32")]), "cpu")
    assert policy.param_dtype("model.language_model.norm", trainable=True) == torch.float32
    assert policy.param_dtype("model.language_model.layers.0.mlp.up_proj", trainable=True) == torch.bfloat16


def test_inference_weights_give_the_same_bits_and_give_the_masters_back(shapes_dir, tmp_path):
    """Full fine-tuning with fp32 masters under bf16 autocast: inside inference_weights the plain
    linears' weights are stored in bf16 (the embedding, which the tied lm_head shares, and the norms
    keep fp32), the forward gives the same bits, and afterwards the very same fp32 masters train on;
    a second entry refreshes the same copies (their addresses stay: captured graphs stay valid)."""
    cfg = tiny_sft_config(shapes_dir, tmp_path, "precision.mode=bf16", "tiers.method=full")
    t = setup_model(cfg)
    data = load_dataset(cfg.data.train, t.processor, cfg.data)
    batch = collate([data[i] for i in range(4)], data.encoder.pad_id)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    core = t.model
    q_proj = core.model.language_model.layers[0].self_attn.q_proj
    masters = {n: (p.data_ptr(), p.detach().clone()) for n, p in core.named_parameters()}
    master = q_proj.weight
    accumulator = master.view_as(master).grad_fn.next_functions[0][0]  # DDP's hooks hang on this node
    q_master = q_proj.weight.data  # an alias of the master's storage: it sees the training step
    with torch.no_grad(), t.policy.autocast():
        reference = core(**inputs).logits
        with t.policy.inference_weights(core):
            assert q_proj.weight.dtype == torch.bfloat16
            assert core.model.language_model.embed_tokens.weight.dtype == torch.float32
            assert core.model.language_model.norm.weight.dtype == torch.float32
            first_copy = q_proj.weight.data_ptr()
            inside = core(**inputs).logits
    assert torch.equal(inside, reference)
    assert q_proj.weight is master and master.view_as(master).grad_fn.next_functions[0][0] is accumulator
    for n, p in core.named_parameters():
        assert p.data_ptr() == masters[n][0] and torch.equal(p, masters[n][1]), n  # the same storage, untouched
    optimizer = build_optimizer(param_groups(t.model, t.plan, 0.0), cfg.optim, "cpu")
    train_step(t, [batch], optimizer, t.policy.grad_scaler(), GradHealth(t.model, t.plan, cfg.health), 1.0)
    assert q_proj.weight.dtype == torch.float32 and not torch.equal(q_proj.weight, masters[
        "model.language_model.layers.0.self_attn.q_proj.weight"][1])
    with torch.no_grad(), t.policy.inference_weights(core):
        assert q_proj.weight.data_ptr() == first_copy
        # the copy refreshed from the trained master
        assert torch.equal(q_proj.weight, q_master.to(torch.bfloat16))


def test_inference_weights_leave_compute_dtype_masters_alone(shapes_dir, tmp_path):
    cfg = tiny_sft_config(shapes_dir, tmp_path, "precision.mode=bf16", "tiers.method=lora")
    t = setup_model(cfg)
    lora_A = [m for n, m in t.model.named_modules() if n.endswith("q_proj.lora_A.default")][0]
    base = [m for n, m in t.model.named_modules() if n.endswith("q_proj.base_layer")][0]
    with t.policy.inference_weights(t.model):
        assert lora_A.weight.dtype == torch.bfloat16 and base.weight.dtype == torch.bfloat16  # LoRA's masters swapped
    assert lora_A.weight.dtype == torch.float32 and lora_A.weight.requires_grad
    cfg = tiny_sft_config(shapes_dir, tmp_path / "c", "precision.master_weights=compute", "tiers.method=full")
    t = setup_model(cfg)
    before = {n: p.data_ptr() for n, p in t.model.named_parameters()}
    with t.policy.inference_weights(t.model):
        assert all(p.data_ptr() == before[n] for n, p in t.model.named_parameters())  # nothing to swap


def test_an_override_that_matches_no_module_is_a_config_error(shapes_dir, tmp_path):
    """A typo in a pattern ('vision' for 'visual') would change nothing, silently: refused, at --plan
    too (on the meta model), naming the rule."""
    from vlforge.cli import main
    from vlforge.config import ConfigError

    overrides = "precision.overrides=[{pattern: norm, compute: fp32}, {pattern: vision, compute: fp32}]"
    with pytest.raises(ConfigError, match=r"precision.overrides\[1\].pattern 'vision' matches no module"):
        setup_model(tiny_sft_config(shapes_dir, tmp_path, "precision.mode=bf16", overrides))
    assert main(["sft", "configs/demo-sft.yaml", f"data.train={shapes_dir / 'train.jsonl'}", overrides, "--plan"]) == 2
