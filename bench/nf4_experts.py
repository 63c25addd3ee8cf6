"""One MoE layer's experts in bf16 vs NF4 (quant.experts): weight bytes and time per call by tokens.

    python bench/nf4_experts.py                       # 30B-A3B's shapes (128 experts of 2048 -> 768, top-8)
    python bench/nf4_experts.py --device cpu --tokens 1 4 15 64 --repeats 2

transformers' own Qwen3-VL-MoE experts module with the published shapes and random bf16 weights,
quantized by model/quant.quantize_experts. Each call routes `tokens` tokens to top-k experts drawn
at random (a decode step of 1-8 tokens routes at most half as many (token, expert) pairs as there
are experts and takes the routed path, model/nf4.routed_pays: only those experts' NF4 blocks are
dequantized; more tokens dequantize the whole stacks). Times are medians of --repeats warm calls
(one call first). Prints one JSON line per token count: bf16 ms, NF4 ms, NF4 through transformers' forward on the whole
dequantized stacks (what the routed path replaces), and whether the routed path ran.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import Qwen3VLMoeTextConfig
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextExperts

from vlforge.model.nf4 import routed_pays
from vlforge.model.quant import EXPERT_WEIGHTS, expert_state_bytes, quantize_experts


def timed(fn, device: torch.device, repeats: int) -> float:
    fn()  # warm
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


class Layer(torch.nn.Module):
    """The experts module as a model's child, so quant.expert_modules finds it."""

    def __init__(self, config):
        super().__init__()
        self.experts = Qwen3VLMoeTextExperts(config)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8, 15, 16, 64, 512, 4096])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--kernel", default="grouped_mm", choices=["grouped_mm", "batched_mm", "eager"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    device = torch.device(args.device)
    config = Qwen3VLMoeTextConfig(num_experts=args.experts, hidden_size=args.hidden,
                                  moe_intermediate_size=args.intermediate, num_experts_per_tok=args.top_k)
    config._experts_implementation = args.kernel
    torch.manual_seed(0)
    bf16 = Layer(config).to(device, torch.bfloat16)
    for name in EXPERT_WEIGHTS:
        torch.nn.init.normal_(getattr(bf16.experts, name), std=0.02)
    nf4 = Layer(config).to(device, torch.bfloat16)
    nf4.load_state_dict(bf16.state_dict())
    quantize_experts(nf4, device)
    bf16_bytes = sum(getattr(bf16.experts, n).numel() * 2 for n in EXPERT_WEIGHTS)
    nf4_bytes = sum(nf4.experts.parametrizations[n].original.numel() for n in EXPERT_WEIGHTS) + expert_state_bytes(nf4)
    print(json.dumps({"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                      "torch": torch.__version__, "experts": args.experts, "hidden": args.hidden,
                      "intermediate": args.intermediate, "top_k": args.top_k, "kernel": args.kernel,
                      "bf16_gb": bf16_bytes / 1e9, "nf4_gb": nf4_bytes / 1e9}), flush=True)
    for tokens in args.tokens:
        hidden = torch.randn(tokens, args.hidden, device=device, dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(args.experts, device=device)[:args.top_k] for _ in range(tokens)])
        weights = torch.softmax(torch.randn(tokens, args.top_k, device=device), -1).to(torch.bfloat16)
        with torch.no_grad():
            ms_bf16 = timed(lambda: bf16.experts(hidden, ids, weights), device, args.repeats)
            ms_nf4 = timed(lambda: nf4.experts(hidden, ids, weights), device, args.repeats)
            # transformers' forward on the whole dequantized stacks: what the routed path replaces (cached:
            # its eager loop reads the stacks once per expert, as the module's call caches them)
            whole = type(nf4.experts).forward

            def whole_stacks():
                with torch.nn.utils.parametrize.cached():
                    return whole(nf4.experts, hidden, ids, weights)

            ms_whole = timed(whole_stacks, device, args.repeats)
            err = (nf4.experts(hidden, ids, weights).float() - bf16.experts(hidden, ids, weights).float()).norm()
            ref = bf16.experts(hidden, ids, weights).float().norm()
        print(json.dumps({"tokens": tokens, "pairs": tokens * args.top_k,
                          "routed": routed_pays(tokens * args.top_k, args.experts), "bf16_ms": round(ms_bf16, 3),
                          "nf4_ms": round(ms_nf4, 3), "nf4_whole_ms": round(ms_whole, 3),
                          "nf4_over_bf16": round(ms_nf4 / ms_bf16, 2),
                          "nf4_rel_err": round((err / ref).item(), 4)}), flush=True)


if __name__ == "__main__":
    main()
