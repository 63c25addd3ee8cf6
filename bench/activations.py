"""What one Qwen3-VL decoder layer keeps for backward per token, counted, against the estimate of
vlforge/train/activations.py (its coefficients were fitted on these counts).

    python bench/activations.py                      # 2B and 8B shapes, full (fp32 masters) and LoRA (bf16 base)
    python bench/activations.py --shapes qwen3vl-2b --lengths 256 512

Every tensor autograd saves in one layer's forward (torch.autograd.graph.saved_tensors_hooks, each
storage once) under bf16 autocast on the CPU, at two lengths: the difference per token leaves out
what does not grow with the tokens (the weights' bf16 casts). Full: the layer's weights train in
fp32, the residual stream fp32; LoRA: peft adapters (r=8, dropout 0.1) on q/k/v/o of a frozen bf16
layer. Prints one JSON line per shape and method.
"""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import peft
import torch
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLTextConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextDecoderLayer, Qwen3VLTextRotaryEmbedding

from vlforge.train.activations import Stack, block_bytes

SHAPES = {"qwen3vl-2b": (2048, 6144, 16, 8), "qwen3vl-8b": (4096, 12288, 32, 8)}  # hidden, MLP, heads, KV heads


def saved_bytes(layer, config, length: int, dtype: torch.dtype) -> int:
    storages = {}
    rotary = Qwen3VLTextRotaryEmbedding(config)
    x = torch.randn(1, length, config.hidden_size, dtype=dtype, requires_grad=True)
    pos = torch.arange(length)[None].expand(3, 1, length)

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        layer(x, position_embeddings=rotary(x, pos), attention_mask=None, position_ids=pos)
    return sum(storages.values())


def layer_for(shape, method: str):
    hidden, mlp, heads, kv = shape
    config = Qwen3VLTextConfig(hidden_size=hidden, intermediate_size=mlp, num_attention_heads=heads,
                               num_key_value_heads=kv, head_dim=128, num_hidden_layers=1, vocab_size=128)
    config._attn_implementation = "sdpa"
    layer = Qwen3VLTextDecoderLayer(config, 0)
    if method == "full":
        return layer, config, torch.float32
    layer = layer.to(torch.bfloat16).requires_grad_(False)
    peft.inject_adapter_in_model(peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1,
                                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]), layer)
    for name, p in layer.named_parameters():
        if "lora_" in name:
            p.data = p.data.float()
            p.requires_grad_(True)
    return layer.train(), config, torch.bfloat16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--lengths", nargs=2, type=int, default=[256, 512])
    args = ap.parse_args()
    short, long = args.lengths
    for name in args.shapes:
        for method in ("full", "lora"):
            layer, config, dtype = layer_for(SHAPES[name], method)
            counted = (saved_bytes(layer, config, long, dtype) - saved_bytes(layer, config, short, dtype)) / (long - short)
            hidden, mlp, heads, kv = SHAPES[name]
            lora = 3 * hidden + heads * 128 if method == "lora" else 0
            stack = Stack(1, 0, hidden, mlp, kv * 128, lora, method == "lora", method == "full")
            estimate = block_bytes(stack, 4 if method == "full" else 2, 2)
            print(json.dumps(SimpleNamespace(shape=name, method=method, counted_bytes_per_token=counted,
                                             estimate=estimate, ratio=round(estimate / counted, 3)).__dict__))


if __name__ == "__main__":
    main()
