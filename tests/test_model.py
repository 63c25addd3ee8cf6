import torch
from PIL import Image

from vlforge.config import ModelConfig
from vlforge.data.encode import Encoder, ImageLimits, open_images
from vlforge.data.jsonl import read_jsonl
from vlforge.model.load import build_meta_model, load_model


def test_tiny_is_transformers_qwen3vl_and_small(tiny):
    model, processor = tiny
    assert type(model).__name__ == "Qwen3VLForConditionalGeneration"
    assert type(processor).__name__ == "Qwen3VLProcessor"
    n = sum(p.numel() for p in model.parameters())
    assert 100_000 < n < 1_000_000
    assert model.config.image_token_id == processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")


def test_save_and_load_through_model_path_gives_identical_logits(tiny, tmp_path, shapes_dir):
    model, processor = tiny
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    loaded, loaded_processor = load_model(ModelConfig(path=str(tmp_path)))
    sample = read_jsonl(shapes_dir / "val.jsonl")[0]
    text = processor.apply_chat_template(sample.messages, tokenize=False)
    batch = processor(text=[text], images=open_images(sample), return_tensors="pt")
    batch2 = loaded_processor(text=[text], images=open_images(sample), return_tensors="pt")
    assert torch.equal(batch["input_ids"], batch2["input_ids"])
    assert torch.equal(batch["pixel_values"], batch2["pixel_values"])
    with torch.no_grad():
        a = model(**batch).logits
        b = loaded(**batch2).logits
    assert torch.equal(a, b)


def test_encoder_token_ids_match_the_qwen3vl_processor(tiny):
    """Our length-planning tokenization must equal what transformers' processor produces."""
    _, processor = tiny
    enc = Encoder(processor, ImageLimits(32 * 32, 1024 * 1024))
    images = [Image.new("RGB", (64, 48), "red"), Image.new("RGB", (200, 96), "blue")]
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"},
                                             {"type": "text", "text": "Which is red?"}]},
                {"role": "assistant", "content": "the first"}]
    ours = enc.token_ids(messages, [im.size for im in images])
    text = processor.apply_chat_template(messages, tokenize=False)
    theirs = processor(text=[text], images=images, return_tensors="pt",
                       size={"shortest_edge": 32 * 32, "longest_edge": 1024 * 1024})["input_ids"][0].tolist()
    assert ours == theirs


def test_published_presets_have_published_sizes():
    model, _ = build_meta_model(ModelConfig(preset="qwen3vl-8b"))
    n = sum(p.numel() for p in model.parameters())
    assert 8.7e9 < n < 8.8e9  # Qwen3-VL-8B-Instruct has 8.77B parameters
    model, _ = build_meta_model(ModelConfig(preset="qwen3vl-2b"))
    unique = {id(p): p for p in model.parameters()}  # tied embeddings
    assert 2.0e9 < sum(p.numel() for p in unique.values()) < 2.3e9
