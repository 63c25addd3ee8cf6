"""Model presets: the `tiny` debug model and random-weight copies of the published architectures.

`tiny` is a real `Qwen3VLForConditionalGeneration` (a few hundred thousand parameters) with a
byte-level BPE tokenizer and Qwen chat template shipped in the package, wrapped in transformers'
own Qwen3-VL processor. It runs the whole pipeline on a laptop CPU in seconds.

The published presets copy the architecture of the Qwen3-VL Instruct checkpoints (layer counts,
widths, deepstack layers, tied embeddings) with random weights: speed and memory do not depend on
weight values, so benchmarks use them without any download.

The mixture-of-experts presets (`tiny-moe`, `qwen3vl-30b-a3b`, `qwen3vl-235b-a22b`) are
`Qwen3VLMoeForConditionalGeneration`s: every decoder layer's MLP is a router (`mlp.gate`) over
fused 3-D expert weights (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]);
the vision tower and projector are the dense model's.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from transformers import AutoTokenizer, Qwen3VLConfig, Qwen3VLMoeConfig, Qwen3VLProcessor

from vlforge.config import ConfigError
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

TOKENIZER_DIR = Path(str(resources.files("vlforge.model") / "assets" / "tiny_tokenizer"))

# (text kwargs, vision kwargs, tie_word_embeddings) of the published Qwen3-VL Instruct models.
_PUBLISHED = {
    "qwen3vl-2b": (
        dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8),
        dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, deepstack_visual_indexes=[5, 11, 17]),
        True,
    ),
    "qwen3vl-4b": (
        dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8),
        dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, deepstack_visual_indexes=[5, 11, 17]),
        True,
    ),
    "qwen3vl-8b": (
        dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8),
        dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, deepstack_visual_indexes=[8, 16, 24]),
        False,
    ),
    "qwen3vl-32b": (
        dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8),
        dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, deepstack_visual_indexes=[8, 16, 24]),
        False,
    ),
}
# The MoE checkpoints Qwen/Qwen3-VL-30B-A3B-Instruct and Qwen/Qwen3-VL-235B-A22B-Instruct, from their
# config.json on the Hugging Face hub (cross-checked with NVIDIA Megatron-Bridge's Qwen3-VL-MoE
# model args): every layer sparse (decoder_sparse_step 1, no mlp_only_layers), 128 experts, top-8,
# untied embeddings. intermediate_size is the dense-MLP width those configs carry (unused: no dense layer).
_PUBLISHED_MOE = {
    "qwen3vl-30b-a3b": (
        dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
             num_attention_heads=32, num_key_value_heads=4, num_experts=128, num_experts_per_tok=8),
        dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, deepstack_visual_indexes=[8, 16, 24]),
        False,
    ),
    "qwen3vl-235b-a22b": (
        dict(hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536, num_hidden_layers=94,
             num_attention_heads=64, num_key_value_heads=4, num_experts=128, num_experts_per_tok=8),
        dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, deepstack_visual_indexes=[8, 16, 24]),
        False,
    ),
}
MOE_PRESETS = ("tiny-moe", *_PUBLISHED_MOE)
PRESETS = ("tiny", *_PUBLISHED, *MOE_PRESETS)
TINY_PRESETS = ("tiny", "tiny-moe")  # the 8x8-patch processor

# The tiny model sees 8x8-pixel patches (published models: 16x16) so that the 64x64 demo images
# still give 16 image tokens after the 2x2 spatial merge.
TINY_PATCH = 8


def tiny_tokenizer():
    return AutoTokenizer.from_pretrained(str(TOKENIZER_DIR), local_files_only=True)


def build_processor(tokenizer, patch_size: int) -> Qwen3VLProcessor:
    """transformers' own Qwen3-VL processor around our tokenizer, with Qwen3-VL's image settings."""
    common = dict(patch_size=patch_size, merge_size=2, temporal_patch_size=2,
                  image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    image_processor = Qwen2VLImageProcessor(
        size={"shortest_edge": 32 * 32, "longest_edge": 1024 * 1024}, **common)
    video_processor = Qwen3VLVideoProcessor(**common)
    chat_template = (TOKENIZER_DIR / "chat_template.jinja").read_text()
    return Qwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                            video_processor=video_processor, chat_template=chat_template)


def _token_ids(tokenizer) -> dict:
    ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in [
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>")]}
    return ids


def is_moe(config) -> bool:
    """Whether a (Qwen3-VL) model config is the mixture-of-experts architecture."""
    return getattr(config, "model_type", None) == "qwen3_vl_moe"


def preset_config(name: str, tokenizer) -> Qwen3VLConfig | Qwen3VLMoeConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown model.preset '{name}': choose one of {list(PRESETS)} or set model.path")
    rope = {"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_interleaved": True}
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    if name in TINY_PRESETS:
        vocab = (len(tokenizer) + 63) // 64 * 64
        text = dict(vocab_size=vocab, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    max_position_embeddings=4096, pad_token_id=pad,
                    # theta 1e4, not the published 5e6: with 16-dim heads and a 4x4 image grid, 5e6
                    # leaves the height/width M-RoPE components almost constant (no spatial signal).
                    rope_parameters={**rope, "rope_theta": 10_000.0, "mrope_section": [4, 2, 2]})
        vision = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=4, patch_size=TINY_PATCH,
                      out_hidden_size=64, num_position_embeddings=64, deepstack_visual_indexes=[0])
        if name == "tiny-moe":  # tiny's attention and vision; 8 experts of width 32, top-2, in both layers
            text.update(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1,
                        mlp_only_layers=[])
            return Qwen3VLMoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False,
                                    **_token_ids(tokenizer))
        return Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False,
                             **_token_ids(tokenizer))
    moe = name in _PUBLISHED_MOE
    text_kw, vision_kw, tie = (_PUBLISHED_MOE if moe else _PUBLISHED)[name]
    text = dict(vocab_size=151936, head_dim=128, max_position_embeddings=262144, pad_token_id=pad,
                rope_parameters={**rope, "mrope_section": [24, 20, 20]}, **text_kw)
    vision = dict(patch_size=16, out_hidden_size=text_kw["hidden_size"], num_position_embeddings=2304, **vision_kw)
    # Token ids follow the shipped tokenizer so the tiny tokenizer can drive random-weight benchmarks.
    return (Qwen3VLMoeConfig if moe else Qwen3VLConfig)(text_config=text, vision_config=vision, tie_word_embeddings=tie, **_token_ids(tokenizer))
