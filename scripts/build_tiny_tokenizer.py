"""Build the byte-level BPE tokenizer shipped with the `tiny` preset.

Run once by a developer (the output is committed under vlforge/model/assets/tiny_tokenizer/):
    python scripts/build_tiny_tokenizer.py

It is a Qwen2-style tokenizer (same pre-tokenizer regex, byte-level, Qwen's special tokens and
chat format) trained on a small English corpus plus the synthetic shapes vocabulary, so that the
tiny model exercises exactly the code path of real Qwen3-VL tokenizers while staying small.
Byte-level BPE can encode any text, so user data never fails to tokenize, it just gets more tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from vlforge.data.synth import COLOURS, POSITIONS, SHAPES, question_templates

OUT = Path(__file__).resolve().parents[1] / "vlforge" / "model" / "assets" / "tiny_tokenizer"
VOCAB_SIZE = 768

# Qwen2/Qwen3 pre-tokenizer split pattern.
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
]
# Added (non-special) tokens, as in Qwen3: reasoning/answer tags used by GRPO format rewards.
ADDED_TOKENS = ["<think>", "</think>", "<answer>", "</answer>"]

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' or 'image' in part -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

ENGLISH = """
The quick brown fox jumps over the lazy dog. A picture is worth a thousand words.
You are a helpful assistant. Describe the image. What is in this picture? Answer the question.
Please answer with a single word. How many objects are there? Which one is larger?
The answer is yes. The answer is no. There are two cats on the table and one dog under it.
Think step by step, then give the final answer. Left, right, top, bottom, center, middle.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 100 1000 3.14 -2 1/2 50%.
Colours: red green blue yellow orange purple black white gray pink brown cyan magenta.
Shapes: circle square triangle rectangle star line dot ellipse polygon diamond.
"""


def corpus() -> list[str]:
    lines = [line for line in ENGLISH.strip().splitlines()]
    words = COLOURS + SHAPES + POSITIONS
    for template in question_templates():
        lines.append(template)
    lines += [" ".join(words)] * 20
    lines += ["<|im_start|>system\n", "<|im_start|>user\n", "<|im_start|>assistant\n"] * 20
    lines += [f"<think>{w}</think><answer>{w}</answer>" for w in words]
    return lines * 5


def main() -> None:
    tok = Tokenizer(models.BPE(byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(SPECIAL_TOKENS) - len(ADDED_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.add_tokens(ADDED_TOKENS)

    OUT.mkdir(parents=True, exist_ok=True)
    tok.save(str(OUT / "tokenizer.json"))
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "model_max_length": 4096,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "errors": "replace",
    }
    (OUT / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (OUT / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    print(f"wrote {OUT} ({tok.get_vocab_size()} tokens)")


if __name__ == "__main__":
    main()
