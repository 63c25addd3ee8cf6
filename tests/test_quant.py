"""Quantization plan (pure logic), real bitsandbytes NF4 / int8 loads on CPU, and QLoRA training."""

import pytest
import torch

from vlforge.config import ConfigError, ModelConfig, QuantConfig
from vlforge.model.load import build_meta_model, load_model
from vlforge.model.quant import from_pretrained_kwargs, quant_plan, verify

bnb = pytest.importorskip("bitsandbytes")


def test_plan_quantizes_every_language_linear_and_nothing_else_on_8b():
    model, _ = build_meta_model(ModelConfig(preset="qwen3vl-8b"))
    plan = quant_plan(model, QuantConfig(language="nf4"))
    nf4 = {n for n, m in plan.items() if m == "nf4"}
    assert len(nf4) == 36 * 7
    assert all(n.startswith("model.language_model.layers.") for n in nf4)
    untouched = set(plan) - nf4
    assert "lm_head" in untouched
    assert {n for n in untouched if n.startswith("model.visual.blocks.")} == \
        {n for n in plan if n.startswith("model.visual.blocks.")}  # the whole vision tower
    assert any("deepstack_merger_list" in n for n in untouched) and any(".merger." in n for n in untouched)


def test_quant_config_guards():
    with pytest.raises(ConfigError, match="allow_4bit_vision"):
        QuantConfig(vision="nf4")
    assert QuantConfig(vision="nf4", allow_4bit_vision=True).vision == "nf4"
    with pytest.raises(ConfigError, match="one backend"):
        QuantConfig(language="nf4", vision="fp8")
    with pytest.raises(ConfigError, match="cannot be mixed"):
        QuantConfig(language="nf4", projector="int8")
    assert QuantConfig.from_flag("nf4") == QuantConfig(language="nf4")
    assert not QuantConfig.from_flag("none").enabled
    with pytest.raises(ConfigError, match="choose"):
        QuantConfig.from_flag("fp4")


def test_skip_list_is_exactly_the_unquantized_linears():
    model, _ = build_meta_model(ModelConfig(preset="tiny"))
    plan = quant_plan(model, QuantConfig(language="nf4"))
    qc = from_pretrained_kwargs(QuantConfig(language="nf4"), plan)["quantization_config"]
    assert qc.load_in_4bit and qc.bnb_4bit_quant_type == "nf4" and qc.bnb_4bit_use_double_quant
    assert qc.bnb_4bit_compute_dtype == torch.bfloat16
    assert set(qc.llm_int8_skip_modules) == {n for n, m in plan.items() if m == "none"}


@pytest.mark.parametrize("method,cls", [("nf4", "Linear4bit"), ("int8", "Linear8bitLt")])
def test_real_quantized_load_keeps_vision_and_projector_unquantized(method, cls):
    model, _ = load_model(ModelConfig(preset="tiny"), dtype=torch.bfloat16, quant=QuantConfig(language=method))
    report = verify(model, QuantConfig(language=method))
    assert report["linears"][f"language:{method}"] == 2 * 7  # 2 decoder layers x q,k,v,o,gate,up,down
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            quantized = type(module).__name__ == cls
            assert quantized == name.startswith("model.language_model.layers."), name
    for name, p in model.named_parameters():
        if name.startswith("model.visual."):
            assert p.dtype in (torch.bfloat16, torch.float16), name  # never upcast, never 4-bit
    with pytest.raises(ConfigError, match="plan not met"):
        verify(model, QuantConfig())  # a model that does not match its plan is refused


def test_nf4_language_model_needs_less_memory():
    plain, _ = load_model(ModelConfig(preset="tiny"), dtype=torch.bfloat16)
    nf4, _ = load_model(ModelConfig(preset="tiny"), dtype=torch.bfloat16, quant=QuantConfig(language="nf4"))
    lm_bytes = lambda m: sum(p.numel() * p.element_size() for n, p in m.named_parameters()
                             if n.startswith("model.language_model.layers.") and "norm" not in n)
    assert lm_bytes(nf4) <= lm_bytes(plain) / 3.5  # 4 bits vs 16, plus small absmax stats outside params


def test_qlora_trains_adapters_only_and_leaves_vision_in_bf16(shapes_dir, tmp_path):
    from vlforge.data.dataset import load_dataset
    from vlforge.data.encode import collate
    from vlforge.train.health import GradHealth
    from vlforge.train.optim import build_optimizer
    from vlforge.model.tiers import param_groups
    from vlforge.train.trainable import setup_model
    from vlforge.recipes.sft import train_step

    from helpers import tiny_sft_config

    cfg = tiny_sft_config(shapes_dir, tmp_path, "precision.mode=bf16", "tiers.method=lora", "quant.language=nf4",
                          "activation_checkpointing.enabled=true")
    t = setup_model(cfg)
    data = load_dataset(cfg.data.train, t.processor, cfg.data)
    optimizer = build_optimizer(param_groups(t.model, t.plan, 0.0), cfg.optim, "cpu")
    health = GradHealth(t.model, t.plan, cfg.health)
    before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    for k in range(2):  # LoRA B starts at zero: A moves from the second step
        row = train_step(t, [collate([data[i] for i in range(4 * k, 4 * k + 4)], data.encoder.pad_id)],
                         optimizer, t.policy.grad_scaler(), health, 1.0)
        assert not row["skipped"]
    for name, p in t.model.named_parameters():
        changed = not torch.equal(before[name], p.detach())
        assert changed == ("lora_" in name), name
        if "lora_" in name:
            assert p.dtype == torch.float32
        elif ".visual." in name:
            assert p.dtype == torch.bfloat16, name  # peft's k-bit preparation would have made these fp32
        elif "language_model.layers." in name and "norm" not in name and name.endswith("base_layer.weight"):
            assert p.dtype == torch.uint8, name  # packed NF4


def test_full_fine_tuning_of_a_quantized_model_is_refused(shapes_dir, tmp_path):
    from vlforge.train.trainable import setup_model

    from helpers import tiny_sft_config

    with pytest.raises(ConfigError, match="tiers.method=lora"):
        setup_model(tiny_sft_config(shapes_dir, tmp_path, "tiers.method=full", "quant.language=nf4"))


def test_qlora_checkpoint_loads_on_its_nf4_base_and_exports_merged_unquantized(shapes_dir, tmp_path):
    from transformers import Qwen3VLForConditionalGeneration

    from vlforge.model.export import export
    from vlforge.recipes.sft import run_sft
    from vlforge.infer.model import InferenceModel

    from helpers import tiny_sft_config

    run_sft(tiny_sft_config(shapes_dir, tmp_path / "run", "precision.mode=bf16", "tiers.method=lora",
                            "quant.language=nf4", "train.max_steps=1", "data.val=null"))
    ckpt = tmp_path / "run" / "checkpoint-1"
    engine = InferenceModel.load(str(ckpt), device="cpu")  # quant=None: the run's own NF4 base
    assert engine.quant_report["linears"]["language:nf4"] == 14
    assert not InferenceModel.load(str(ckpt), quant=QuantConfig(), device="cpu").quant_report  # asked: bf16
    export(ckpt, tmp_path / "merged", merge=True)  # merged into the unquantized base, never into NF4
    merged = Qwen3VLForConditionalGeneration.from_pretrained(tmp_path / "merged", local_files_only=True)
    assert getattr(merged.config, "quantization_config", None) is None
    verify(merged, QuantConfig())


def test_fp8_quantization_is_refused_on_a_cpu_before_loading(tmp_path, capsys):
    """The hardware check lives with the callers (model/ is below train/hardware.py): each of
    infer, export and a QLoRA-style training config refuses FP8 weights on a CPU, naming nf4/int8."""
    from vlforge.cli import main
    from vlforge.config import SFTConfig, load_config
    from vlforge.train.trainable import setup_model

    assert main(["infer", "tiny", "--quant", "fp8", "--device", "cpu", "--prompt", "hi"]) == 2
    assert "nf4 or int8" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "no-checkpoint"), "--out", str(tmp_path / "x"), "--quant", "fp8",
                 "--device", "cpu"]) == 2
    assert "nf4 or int8" in capsys.readouterr().err
    cfg = load_config(SFTConfig, None, ["model.preset=tiny", "train.device=cpu", "quant.language=fp8"])
    with pytest.raises(ConfigError, match="nf4 or int8"):
        setup_model(cfg)
