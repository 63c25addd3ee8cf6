"""Quantized inference: weights memory, peak memory, prefill latency and decode speed per method.

    python bench/quant_inference.py --preset qwen3vl-8b --quant none nf4 int8 fp8

Random weights of the published architecture (speed and memory do not depend on the values).
Request: one 448x448 image (196 image tokens) + a ~64-token question. Prefill latency is a
generate() of one token at batch 1; decode speed is (generate(1 + N) - generate(1)) / N at batch 1
and at batch 8, each after a full-length warm-up run (compiles and CUDA-graph captures happen
there). The language model is quantized; vision tower and projector stay bf16. One JSON line per
method. `--profile FILE`: one more batch-1 run of 16 tokens under torch's profiler, its top kernels
and operators by GPU time written to FILE (a text table), whether the decode ran as CUDA graphs in
the JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch
from PIL import Image

from vlforge.config import ModelConfig, QuantConfig
from vlforge.model.load import load_model
from vlforge.model.quant import verify
from vlforge.infer.model import InferenceModel, Request


def timed(engine: InferenceModel, requests: list[Request]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    engine.generate(requests)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3vl-8b")
    ap.add_argument("--quant", nargs="+", default=["none", "nf4", "int8", "fp8"])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--tmp", help="where a preset's random weights are written for the quantized reload "
                    "(model/load.py: quantizers act at from_pretrained); 30B-A3B needs ~62 GB: e.g. /dev/shm "
                    "on a machine with more RAM than free disk")
    ap.add_argument("--profile", help="write the batch-1 decode's profile (top operators by GPU time) here")
    args = ap.parse_args()
    if args.tmp:
        import tempfile

        tempfile.tempdir = args.tmp

    image = Image.frombytes("RGB", (448, 448), bytes(range(256)) * (448 * 448 * 3 // 256))
    question = " ".join(["describe the shapes and colours in this picture"] * 8)
    message = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    for method in args.quant:
        quant = QuantConfig.from_flag(method)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        model, processor = load_model(ModelConfig(preset=args.preset), dtype=torch.bfloat16, device="cuda", quant=quant)
        load_s = time.perf_counter() - start
        engine = InferenceModel(model, processor, torch.device("cuda"), args.preset,
                                 verify(model, quant) if quant.enabled else None)
        weights_gb = torch.cuda.memory_allocated() / 1e9
        one = lambda b, n: [Request(message, [image], max_new_tokens=n, min_new_tokens=n) for _ in range(b)]
        timed(engine, one(1, 1 + args.new_tokens))  # warm-up, full length (kernels, allocator, graph captures)
        timed(engine, one(8, 1 + args.new_tokens))
        prefill = min(timed(engine, one(1, 1)) for _ in range(3))
        decode1 = (timed(engine, one(1, 1 + args.new_tokens)) - prefill) / args.new_tokens
        prefill8 = timed(engine, one(8, 1))
        decode8 = (timed(engine, one(8, 1 + args.new_tokens)) - prefill8) / args.new_tokens
        graphs = None
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                timed(engine, one(1, 16))
            names = {e.key for e in prof.key_averages()}
            graphs = any("cudaGraphLaunch" in n for n in names)
            with open(f"{args.profile}.{method}.txt", "w") as f:
                f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40))
        print(json.dumps({
            "preset": args.preset, "quant": method, "weights_gb": round(weights_gb, 2),
            "peak_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2), "load_s": round(load_s, 1),
            "prefill_ms": round(prefill * 1e3, 1), "decode_tok_s_b1": round(1 / decode1, 1),
            "decode_tok_s_b8": round(8 / decode8, 1), "linears": engine.quant_report and engine.quant_report["linears"],
            "decode_graphs": graphs,
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}), flush=True)
        del engine, model
        gc.collect()


if __name__ == "__main__":
    main()
