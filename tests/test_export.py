"""Export: merged LoRA directories load in plain transformers with the unmerged model's logits."""

import pytest
import torch
from transformers import AutoProcessor, Qwen3VLForConditionalGeneration

from vlforge.config import ConfigError, QuantConfig
from vlforge.data.dataset import load_dataset
from vlforge.data.encode import collate
from vlforge.model.export import export
from vlforge.recipes.sft import run_sft

from helpers import tiny_sft_config


@pytest.fixture(scope="module")
def lora_run(shapes_dir, tmp_path_factory):
    """A tiny LoRA run whose adapters moved away from zero (high lr), in fp32."""
    out = tmp_path_factory.mktemp("lora_run")
    cfg = tiny_sft_config(shapes_dir, out, "tiers.method=lora", "tiers.language.lr=0.02", "tiers.projector.lr=0.02",
                          "tiers.vision.lr=0.02", "train.max_steps=3", "data.val=null")
    run_sft(cfg)
    return cfg, out / "checkpoint-3"


def _logits(model, batch):
    with torch.no_grad():
        return model(**batch).logits.float()


def _batch(cfg, processor):
    data = load_dataset(cfg.data.train, processor, cfg.data)
    return collate([data[i] for i in range(3)], data.encoder.pad_id)


def _unmerged(cfg, ckpt):
    from peft import PeftModel

    from vlforge.model.load import load_model

    base, processor = load_model(cfg.model, dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(ckpt)).eval(), processor


def test_merged_export_loads_in_plain_transformers_with_the_same_logits(lora_run, tmp_path):
    cfg, ckpt = lora_run
    reference, processor = _unmerged(cfg, ckpt)
    batch = _batch(cfg, processor)
    expected = _logits(reference, batch)
    with reference.disable_adapter():  # the adapters matter, or the comparison proves nothing
        assert (expected - _logits(reference, batch)).abs().max() > 1e-3

    result = export(ckpt, tmp_path / "merged32", merge=True, dtype=torch.float32)
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja", "processor_config.json",
            "generation_config.json"} <= set(result["files"])
    plain = Qwen3VLForConditionalGeneration.from_pretrained(tmp_path / "merged32", local_files_only=True).eval()
    AutoProcessor.from_pretrained(tmp_path / "merged32", local_files_only=True)  # loads with no vlforge code
    torch.testing.assert_close(_logits(plain, batch), expected, rtol=1e-4, atol=1e-4)

    export(ckpt, tmp_path / "merged16", merge=True)  # the default: bf16 weights
    half = Qwen3VLForConditionalGeneration.from_pretrained(tmp_path / "merged16", local_files_only=True).eval()
    assert next(half.parameters()).dtype == torch.bfloat16
    diff = (_logits(half, batch) - expected).abs().max()
    assert diff < 0.05 * expected.abs().max()  # bf16 rounding of the merged weights only


def test_adapter_only_export_reloads(lora_run, tmp_path):
    from peft import PeftModel

    from vlforge.model.load import load_model

    cfg, ckpt = lora_run
    export(ckpt, tmp_path / "adapter")
    base, processor = load_model(cfg.model, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    reference, _ = _unmerged(cfg, ckpt)
    batch = _batch(cfg, processor)
    torch.testing.assert_close(_logits(model, batch), _logits(reference, batch))
    assert (tmp_path / "adapter" / "vlforge_base.json").is_file()


def test_export_refuses_to_overwrite_and_to_quantize_an_adapter(lora_run, tmp_path):
    _, ckpt = lora_run
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("someone's file")
    with pytest.raises(ConfigError, match="not empty"):
        export(ckpt, tmp_path / "taken", merge=True)
    assert (tmp_path / "taken" / "x").read_text() == "someone's file"
    with pytest.raises(ConfigError, match="needs --merge"):
        export(ckpt, tmp_path / "q", quant=QuantConfig(language="nf4"))
    with pytest.raises(ConfigError, match="neither adapter_config.json"):
        export(tmp_path / "taken", tmp_path / "out")


def test_nf4_export_writes_a_directory_transformers_loads(lora_run, tmp_path):
    pytest.importorskip("bitsandbytes")
    from vlforge.model.quant import verify

    _, ckpt = lora_run
    export(ckpt, tmp_path / "nf4", merge=True, quant=QuantConfig(language="nf4"))
    model = Qwen3VLForConditionalGeneration.from_pretrained(tmp_path / "nf4", local_files_only=True)
    assert model.config.quantization_config.bnb_4bit_quant_type == "nf4"
    assert verify(model, QuantConfig(language="nf4"))["linears"]["language:nf4"] == 14


def test_full_checkpoint_export(shapes_dir, tmp_path):
    cfg = tiny_sft_config(shapes_dir, tmp_path / "run", "tiers.method=full", "train.max_steps=1", "data.val=null")
    run_sft(cfg)
    result = export(tmp_path / "run" / "checkpoint-1", tmp_path / "full", dtype=torch.float32)
    assert result["kind"] == "full" and "optimizer.pt" not in result["files"]
    trained = Qwen3VLForConditionalGeneration.from_pretrained(tmp_path / "run" / "checkpoint-1").eval()
    exported = Qwen3VLForConditionalGeneration.from_pretrained(tmp_path / "full").eval()
    processor = AutoProcessor.from_pretrained(tmp_path / "full")
    batch = _batch(cfg, processor)
    torch.testing.assert_close(_logits(exported, batch), _logits(trained, batch))


def test_exports_get_the_umasks_modes(lora_run, tmp_path):
    """Other users of a shared machine can read an export as they could any file the user writes
    (mkdtemp alone would leave the merged directory 0700, safetensors its weights 0600)."""
    import os
    import stat

    def modes(root):
        return {stat.S_IMODE(p.stat().st_mode) for p in root.rglob("*") if p.is_file()}, stat.S_IMODE(root.stat().st_mode)

    _, ckpt = lora_run
    old = os.umask(0o022)
    try:
        export(ckpt, tmp_path / "adapter")
        assert modes(tmp_path / "adapter") == ({0o644}, 0o755)
        os.umask(0o027)  # the umask's modes, not fixed ones
        export(ckpt, tmp_path / "merged", merge=True)
        assert modes(tmp_path / "merged") == ({0o640}, 0o750)
    finally:
        os.umask(old)


def test_runs_and_adapter_exports_load_from_any_directory(shapes_dir, tmp_path, monkeypatch):
    """A run given relative model and data paths stores them resolved, so its checkpoint (and its
    adapter export, through vlforge_base.json) load from another working directory."""
    import shutil

    from vlforge.config import ModelConfig
    from vlforge.model.load import load_model
    from vlforge.infer.model import InferenceModel, Request

    work = tmp_path / "work"
    model, processor = load_model(ModelConfig(preset="tiny"))
    model.save_pretrained(work / "base")
    processor.save_pretrained(work / "base")
    shutil.copytree(shapes_dir, work / "data")
    monkeypatch.chdir(work)
    run_sft(tiny_sft_config(shapes_dir, "run", "model.preset=null", "model.path=base", "data.train=data/train.jsonl",
                            "data.val=null", "tiers.method=lora", "tiers.language.lr=0.02", "train.max_steps=1"))
    export("run/checkpoint-1", "adapter")

    monkeypatch.chdir(tmp_path)  # somewhere else
    ask = Request([{"role": "user", "content": [{"type": "text", "text": "what colour?"}]}], max_new_tokens=4)
    answers = [InferenceModel.load(str(work / src), device="cpu", dtype=torch.float32).generate([ask])[0].text
               for src in ("run/checkpoint-1", "adapter")]
    assert answers[0] == answers[1]
