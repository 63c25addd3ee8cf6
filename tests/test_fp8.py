"""FP8 layer selection (pure logic on real module shapes), backend errors, torchao conversion.

The FP8 matmuls themselves need a GPU with compute capability >= 8.9: those tests are marked gpu.
"""

import pytest
import torch

from vlforge.config import ConfigError, FP8Config, ModelConfig
from vlforge.engine.fp8 import _missing_library, decide, fp8_backend, fp8_layer_plan, summarize
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
    from vlforge.engine.trainable import setup_model

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
    from vlforge.engine.fp8 import TorchaoBackend
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
    from vlforge.engine.hardware import fp8_problem

    if not torch.cuda.is_available() or fp8_problem(torch.device("cuda")):
        pytest.skip("needs a GPU with FP8 (compute capability >= 8.9)")
    from vlforge.data.dataset import load_dataset
    from vlforge.data.encode import collate
    from vlforge.engine.health import GradHealth
    from vlforge.engine.optim import build_optimizer
    from vlforge.model.tiers import param_groups
    from vlforge.engine.trainable import setup_model
    from vlforge.recipes.sft import train_step

    from helpers import tiny_sft_config

    losses = {}
    for fp8 in (False, True):
        cfg = tiny_sft_config(shapes_dir, tmp_path / str(fp8), "precision.mode=bf16", "train.device=cuda",
                              "tiers.method=full", f"precision.fp8.enabled={str(fp8).lower()}",
                              "precision.fp8.skip_small=false")
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


@pytest.mark.gpu
def test_transformer_engine_backend_on_gpu(shapes_dir, tmp_path):
    from vlforge.engine.hardware import fp8_problem

    if not torch.cuda.is_available() or fp8_problem(torch.device("cuda")):
        pytest.skip("needs a GPU with FP8 (compute capability >= 8.9)")
    te = pytest.importorskip("transformer_engine.pytorch",
                             reason="TransformerEngine is not installed (it must be built against the local torch "
                                    "and CUDA; not installable on the benchmark machine, which has no network)")
    from vlforge.data.dataset import load_dataset
    from vlforge.data.encode import collate
    from vlforge.engine.health import GradHealth
    from vlforge.engine.optim import build_optimizer
    from vlforge.model.tiers import param_groups, unwrap
    from vlforge.engine.trainable import setup_model
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
