"""FP8 layer selection (pure logic on real module shapes), backend errors, torchao conversion.

The FP8 matmuls themselves need a GPU with compute capability >= 8.9: those tests are marked gpu.
The TransformerEngine ones also need TE's PyTorch extension, built against the local torch
(bench/gpu_te.sh builds it on the GPU machine); without it they skip, saying why it did not import.
"""

import pytest
import torch

from vlforge.config import ConfigError, FP8Config, ModelConfig
from vlforge.train.fp8 import (
    _missing_library,
    decide,
    fp8_backend,
    fp8_layer_plan,
    fp8_state,
    load_fp8_state,
    summarize,
    te_problem,
    token_multiple,
)
from vlforge.train.manifest import write_manifest
from vlforge.model.load import build_meta_model


def _plan(preset: str, **cfg):
    model, _ = build_meta_model(ModelConfig(preset=preset))
    return fp8_layer_plan(model, FP8Config(enabled=True, **cfg))


def _converted_leaves(plan):
    return {name.split(".")[-1] if ".layers." in name else name for name, d in plan.items() if d.convert}


def test_8b_tensorwise_converts_the_big_decoder_linears_only():
    plan = _plan("qwen3vl-8b")
    assert _converted_leaves(plan) == {"q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert summarize(plan)["converted"] == 36 * 5
    k_proj = plan["model.language_model.layers.0.self_attn.k_proj"]
    assert not k_proj.convert and "too small" in k_proj.reason and "1024x4096" in k_proj.reason
    for name in ("lm_head", "model.visual.blocks.0.attn.qkv", "model.visual.merger.linear_fc1",
                 "model.visual.deepstack_merger_list.0.linear_fc2"):
        assert not plan[name].convert and "not included" in plan[name].reason, name


def test_2b_rowwise_thresholds_are_stricter_than_tensorwise():
    tensorwise, rowwise = _plan("qwen3vl-2b"), _plan("qwen3vl-2b", recipe="rowwise")
    assert _converted_leaves(tensorwise) == {"q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    # rowwise skips every layer with N <= 2048 (q, o, down on a 2048-wide model)
    assert _converted_leaves(rowwise) == {"gate_proj", "up_proj"}
    assert summarize(rowwise)["converted"] == 28 * 2


def test_tiny_is_all_too_small_unless_size_filter_is_off_and_excludes_apply():
    assert summarize(_plan("tiny"))["converted"] == 0
    plan = _plan("tiny", skip_small=False, include=[r".*"], exclude=[r"lm_head", r"\.k_proj$"])
    assert plan["model.visual.blocks.0.attn.qkv"].convert  # include reaches the vision tower
    assert "excluded by 'lm_head'" in plan["lm_head"].reason
    assert not plan["model.language_model.layers.0.self_attn.k_proj"].convert
    assert plan["model.language_model.layers.0.self_attn.v_proj"].convert


def test_dims_must_be_multiples_of_16():
    cfg = FP8Config(enabled=True, include=[".*"], skip_small=False)
    assert decide("x", 4096, 4104, cfg).reason == "dims 4096x4104 not multiples of 16"
    assert decide("x", 4096, 4096, cfg).convert


def test_fp8_on_cpu_fails_before_loading_with_advice(shapes_dir, tmp_path):
    from vlforge.train.trainable import setup_model

    from helpers import tiny_sft_config

    cfg = tiny_sft_config(shapes_dir, tmp_path, "precision.mode=bf16", "precision.fp8.enabled=true",
                          "model.preset=qwen3vl-32b")  # would take minutes to build: the check comes first
    with pytest.raises(ConfigError, match=r"compute capability >= 8\.9.*precision\.fp8\.enabled=false"):
        setup_model(cfg)
    with pytest.raises(ConfigError, match="no GPU"):
        fp8_backend(FP8Config(enabled=True), torch.device("cpu"))


def test_fp16_with_fp8_is_refused():
    from vlforge.config import PrecisionConfig

    with pytest.raises(ConfigError, match="precision.mode=bf16"):
        PrecisionConfig(mode="fp16", fp8=FP8Config(enabled=True))


def test_missing_transformer_engine_says_how_to_install():
    pytest.importorskip("torchao")
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("TransformerEngine is installed here")
    message = _missing_library(FP8Config(enabled=True, backend="te"))
    assert "pip install" in message and "transformer_engine" in message and "backend=torchao" in message
    assert _missing_library(FP8Config(enabled=True, backend="torchao")) is None


def test_torchao_converts_exactly_the_planned_base_layers_under_lora(tiny):
    pytest.importorskip("torchao")
    import copy

    from torchao.float8.float8_linear import Float8Linear

    from vlforge.config import TiersConfig
    from vlforge.train.fp8 import TorchaoBackend
    from vlforge.model.tiers import apply_plan, build_plan, unwrap

    model = copy.deepcopy(tiny[0])
    keys_before = set(model.state_dict())
    model = apply_plan(model, build_plan(model, TiersConfig()))
    cfg = FP8Config(enabled=True, skip_small=False, exclude=[r"\.v_proj$"])
    core = unwrap(model)
    plan = fp8_layer_plan(core, cfg)
    converted = TorchaoBackend(cfg).convert(core, plan)
    assert converted == summarize(plan)["converted"] > 0
    for name, module in core.named_modules():
        canonical = name.replace(".base_layer", "")
        if "lora_" in name:
            assert not isinstance(module, Float8Linear), name  # adapters stay high precision
        elif canonical in plan and isinstance(module, torch.nn.Linear):  # not peft's wrapper of the same name
            assert isinstance(module, Float8Linear) == plan[canonical].convert, name
    # q_proj's frozen base is converted inside peft's LoRA layer
    assert isinstance(core.model.language_model.layers[0].self_attn.q_proj.base_layer, Float8Linear)
    assert not isinstance(core.model.language_model.layers[0].self_attn.v_proj.base_layer, Float8Linear)
    merged_keys = {k.replace(".base_layer", "") for k in core.state_dict() if "lora_" not in k}
    assert merged_keys == keys_before  # checkpoints keep the plain model's parameter names


@pytest.mark.gpu
def test_fp8_training_step_matches_bf16_on_gpu(shapes_dir, tmp_path):
    from vlforge.train.hardware import fp8_problem

    if not torch.cuda.is_available() or fp8_problem(torch.device("cuda")):
        pytest.skip("needs a GPU with FP8 (compute capability >= 8.9)")
    pytest.importorskip("torchao")
    from vlforge.data.dataset import load_dataset
    from vlforge.data.encode import collate
    from vlforge.train.health import GradHealth
    from vlforge.train.optim import build_optimizer
    from vlforge.model.tiers import param_groups
    from vlforge.train.trainable import setup_model
    from vlforge.recipes.sft import train_step

    from helpers import tiny_sft_config

    losses = {}
    for fp8 in (False, True):
        cfg = tiny_sft_config(shapes_dir, tmp_path / str(fp8), "precision.mode=bf16", "train.device=cuda",
                              "tiers.method=full", f"precision.fp8.enabled={str(fp8).lower()}",
                              "precision.fp8.skip_small=false", f"compile.enabled={'auto' if fp8 else 'false'}")
        t = setup_model(cfg)
        assert t.token_multiple == (16 if fp8 else 1)
        data = load_dataset(cfg.data.train, t.processor, cfg.data)
        optimizer = build_optimizer(param_groups(t.model, t.plan, 0.0), cfg.optim, "cuda")
        health = GradHealth(t.model, t.plan, cfg.health)
        rows = [train_step(t, [collate([data[i] for i in range(8 * k, 8 * k + 8)], data.encoder.pad_id,
                                       multiple=t.token_multiple)], optimizer, t.policy.grad_scaler(), health, 1.0)
                for k in range(3)]
        assert not any(r["skipped"] for r in rows)
        losses[fp8] = [r["loss"] for r in rows]
    assert losses[True] == pytest.approx(losses[False], rel=0.05)


def _need_te():
    """transformer_engine.pytorch on an FP8 GPU, or skip saying what is missing."""
    from vlforge.train.hardware import fp8_problem

    if not torch.cuda.is_available() or fp8_problem(torch.device("cuda")):
        pytest.skip("needs a GPU with FP8 (compute capability >= 8.9)")
    if problem := te_problem():
        pytest.skip(f"TransformerEngine does not import here ({problem}); bench/gpu_te.sh builds it on the GPU machine")
    import transformer_engine.pytorch as te

    return te


@pytest.mark.gpu
def test_transformer_engine_backend_on_gpu(shapes_dir, tmp_path):
    te = _need_te()
    from vlforge.data.dataset import load_dataset
    from vlforge.data.encode import collate
    from vlforge.train.health import GradHealth
    from vlforge.train.optim import build_optimizer
    from vlforge.model.tiers import param_groups, unwrap
    from vlforge.train.trainable import setup_model
    from vlforge.recipes.sft import train_step

    from helpers import tiny_sft_config

    cfg = tiny_sft_config(shapes_dir, tmp_path, "precision.mode=bf16", "train.device=cuda", "tiers.method=full",
                          "precision.fp8.enabled=true", "precision.fp8.backend=te", "precision.fp8.skip_small=false",
                          "precision.fp8.te.recipe=delayed", "precision.fp8.te.fp8_format=HYBRID")
    t = setup_model(cfg)
    layer = unwrap(t.model).model.language_model.layers[0]
    assert isinstance(layer.self_attn.q_proj, te.Linear) and isinstance(layer.mlp.down_proj, te.Linear)
    data = load_dataset(cfg.data.train, t.processor, cfg.data)
    optimizer = build_optimizer(param_groups(t.model, t.plan, 0.0), cfg.optim, "cuda")
    health = GradHealth(t.model, t.plan, cfg.health)
    for k in range(2):
        row = train_step(t, [collate([data[i] for i in range(8 * k, 8 * k + 8)], data.encoder.pad_id, multiple=16)],
                         optimizer, t.policy.grad_scaler(), health, 1.0)
        assert not row["skipped"] and row["loss"] > 0


def test_te_converts_only_inside_its_autocast_groups():
    plan = _plan("tiny", backend="te", skip_small=False, include=[".*"])
    assert "no TE autocast group" in plan["lm_head"].reason
    assert plan["model.visual.blocks.0.attn.qkv"].convert
    assert plan["model.language_model.layers.0.mlp.up_proj"].convert


def test_token_multiple_follows_the_plan():
    assert token_multiple(_plan("qwen3vl-8b")) == 16
    assert token_multiple(_plan("tiny")) == 1  # nothing converted: no padding
    assert token_multiple({}) == 1  # FP8 off


def test_fp8_state_is_empty_without_te_layers_and_refuses_a_mismatch(tiny):
    assert fp8_state(tiny[0]) == {}
    assert load_fp8_state(tiny[0], {}) == 0
    with pytest.raises(RuntimeError, match="same precision.fp8 settings"):
        load_fp8_state(tiny[0], {"model.language_model.layers.0.mlp.up_proj.scale_fwd": torch.ones(3)})


def test_doctor_te_check_only_runs_where_te_imports():
    from vlforge.doctor import te_checks

    gpu = {"index": 0, "fp8": True}
    assert te_checks([gpu], {"transformer_engine": {"available": False, "version": None}}) == []


def _rel(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["delayed", "current"])
@pytest.mark.parametrize("rows", [(4, 32), (3, 5)])  # 128 rows, and 15: not a multiple of 8, padded inside
def test_te_linear_matches_the_bf16_layer_within_fp8_tolerance(recipe, rows):
    te = _need_te()
    from vlforge.config import TERecipeConfig
    from vlforge.train.fp8 import te_autocast, te_linear_from, te_recipe

    torch.manual_seed(0)
    ref = torch.nn.Linear(256, 512, device="cuda", dtype=torch.bfloat16)
    layer = te_linear_from(ref)
    assert isinstance(layer, te.Linear) and torch.equal(layer.weight, ref.weight) and torch.equal(layer.bias, ref.bias)
    fp8_recipe = te_recipe(TERecipeConfig(recipe=recipe, fp8_format="HYBRID"))
    for _ in range(3):  # delayed scaling: the later steps use the scales from the amax history
        x = torch.randn(*rows, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(*rows, 512, device="cuda", dtype=torch.bfloat16)
        y_ref = ref(x)
        (dx_ref,) = torch.autograd.grad(y_ref, x, grad)
        ref.weight.grad = None
        with te_autocast(fp8_recipe):
            y = layer(x)
        assert y.shape == y_ref.shape
        (dx,) = torch.autograd.grad(y, x, grad)
        # e4m3 operands keep 4 significant bits (~2-3% rms error each), e5m2 gradients 3 bits;
        # a wrong weight, transpose or scale gives errors near 1
        assert _rel(y, y_ref) < 0.06, _rel(y, y_ref)
        assert _rel(dx, dx_ref) < 0.15, _rel(dx, dx_ref)
    if rows == (3, 5):  # the padding is what makes unaligned rows work: plain te.Linear refuses them
        plain = te.Linear(256, 512, params_dtype=torch.bfloat16, device="cuda")
        with pytest.raises((ValueError, AssertionError, RuntimeError)), te_autocast(fp8_recipe):
            plain(torch.randn(15, 256, device="cuda", dtype=torch.bfloat16))


def _tiny_te_model(tiny, **fp8):
    import copy

    from vlforge.config import FP8Config
    from vlforge.train.fp8 import TEBackend

    model = copy.deepcopy(tiny[0]).to("cuda", torch.bfloat16)
    cfg = FP8Config(enabled=True, backend="te", skip_small=False, **fp8)
    plan = fp8_layer_plan(model, cfg)
    assert TEBackend(cfg).convert(model, plan) == summarize(plan)["converted"] > 0
    return model, plan


def _tiny_batch(shapes_dir, tmp_path, processor, n):
    from vlforge.data.dataset import load_dataset
    from vlforge.data.encode import collate

    from helpers import tiny_sft_config

    cfg = tiny_sft_config(shapes_dir, tmp_path)
    data = load_dataset(cfg.data.train, processor, cfg.data)
    batch = collate([data[i] for i in range(n)], data.encoder.pad_id)
    return {k: v.to("cuda") if torch.is_tensor(v) else v for k, v in batch.items()}


@pytest.mark.gpu
def test_te_runs_each_group_under_its_own_recipe(tiny, shapes_dir, tmp_path):
    te = _need_te()
    from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    from vlforge.config import TERecipeConfig

    model, plan = _tiny_te_model(tiny, include=[".*"], te=TERecipeConfig(recipe="delayed", amax_history_len=7),
                                 te_vision=TERecipeConfig(recipe="current", fp8_format="E4M3"))
    seen = {}

    def record(name):
        def hook(module, args):
            seen[name] = (FP8GlobalStateManager.is_fp8_enabled(), FP8GlobalStateManager.get_fp8_recipe())
        return hook

    te_names = {n for n, m in model.named_modules() if isinstance(m, te.Linear)}
    assert te_names == {n for n, d in plan.items() if d.convert}
    assert any(n.startswith("model.visual.") for n in te_names) and "lm_head" not in te_names
    for name in te_names:
        model.get_submodule(name).register_forward_pre_hook(record(name))
    batch = _tiny_batch(shapes_dir, tmp_path, tiny[1], 3)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = model(**{k: v for k, v in batch.items() if k != "labels"})
    assert torch.isfinite(out.logits).all()
    assert seen.keys() == te_names  # every converted layer ran, each inside an FP8 autocast
    for name, (enabled, recipe) in seen.items():
        assert enabled, name
        if name.startswith("model.visual."):
            assert isinstance(recipe, Float8CurrentScaling) and recipe.fp8_format.name == "E4M3", name
        else:
            assert isinstance(recipe, DelayedScaling) and recipe.amax_history_len == 7, name


@pytest.mark.gpu
def test_te_generation_with_an_unaligned_batch(tiny, shapes_dir, tmp_path):
    """Eval and rollouts decode one row per sequence: 3 rows reach the FP8 GEMMs each step."""
    te = _need_te()
    model, _ = _tiny_te_model(tiny)
    rows = []
    model.model.language_model.layers[0].mlp.up_proj.register_forward_pre_hook(
        lambda m, args: rows.append(args[0].numel() // args[0].shape[-1]))
    batch = _tiny_batch(shapes_dir, tmp_path, tiny[1], 3)
    prompt = {k: v for k, v in batch.items() if k != "labels"}
    model.eval()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        out = model.generate(**prompt, max_new_tokens=4, do_sample=False, min_new_tokens=4)
    assert out.shape == (3, prompt["input_ids"].shape[1] + 4)
    assert rows[1:] == [3, 3, 3] and isinstance(model.model.language_model.layers[0].mlp.up_proj, te.Linear)


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["lora", "full"])
def test_te_delayed_scaling_resume_is_exact(shapes_dir, tmp_path, method):
    _need_te()
    import json
    import shutil

    from vlforge.recipes.sft import run_sft

    from helpers import tiny_sft_config

    def run(out, *extra):
        cfg = tiny_sft_config(shapes_dir, out, "precision.mode=bf16", "train.device=cuda", f"tiers.method={method}",
                              "precision.fp8.enabled=true", "precision.fp8.backend=te", "precision.fp8.skip_small=false",
                              "precision.fp8.te.recipe=delayed", "train.max_steps=4", "train.save_every=2",
                              "log.every=1", "data.val=null", "optim.schedule=constant", *extra)
        run_sft(cfg)
        return {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
                if "loss" in r}

    first = run(tmp_path / "a")
    state = torch.load(tmp_path / "a" / "checkpoint-2" / "fp8_state.pt", weights_only=True)
    assert state and all(k.startswith("model.language_model.layers.") for k in state)
    history = state["model.language_model.layers.0.mlp.up_proj.amax_history_fwd"]
    assert history.shape[0] == 16 and (history > 0).any()  # te.amax_history_len: the amaxes seen so far
    resumed = run(tmp_path / "b", f"train.resume={tmp_path / 'a' / 'checkpoint-2'}")
    assert resumed[3] == first[3]  # same weights, same scales: the same step-3 forward, bit for bit
    assert resumed[4] == pytest.approx(first[4], rel=1e-3)
    # without the amax history the resumed run quantizes step 3 with fresh scales: not the same run
    bare = tmp_path / "bare" / "checkpoint-2"
    shutil.copytree(tmp_path / "a" / "checkpoint-2", bare)
    (bare / "fp8_state.pt").unlink()
    write_manifest(bare)  # a checkpoint saved without the state, not a damaged one (its manifest would name the file)
    assert run(tmp_path / "c", f"train.resume={bare}")[3] != first[3]


@pytest.mark.gpu
def test_doctor_runs_a_te_fp8_matmul():
    _need_te()
    from vlforge.doctor import FP8_TOLERANCE, collect_gpus, collect_libraries, te_checks

    checks = te_checks(collect_gpus(True), collect_libraries())
    assert checks and all(c.status == "ok" for c in checks), [c.to_dict() for c in checks]
    assert all(0 < c.values["max_rel_error"] < FP8_TOLERANCE for c in checks)
    assert "transformer_engine 2." in checks[0].name
