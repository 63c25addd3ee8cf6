"""Generation throughput: generate/'s engine vs transformers' generate (dynamic and static cache), warm.

    python bench/generate.py --preset qwen3vl-2b --out gen-2b.jsonl
    python bench/generate.py --preset qwen3vl-8b --paths vlforge,vlforge-nocompile,hf-dynamic,hf-static

Paths: vlforge (the engine as GRPO uses it: CUDA graphs of a torch.compile'd step),
vlforge-nocompile (CUDA graphs of the eager layers), vlforge-noshare (64x256: SlotCache, every row
reading its own copy of its prompt's KV, instead of GroupCache), vlforge-unfused
(64x256: one GEMM per q/k/v and gate/up projection, as transformers, instead of generate/fused.py's
one GEMM per group), vision (the
vision tower alone on the 8 prompts' images; vision-sdpa: through transformers' per-image sdpa
loop), hf-dynamic / hf-static (transformers' generate with its dynamic or static cache; static is
auto-compiled; both with transformers' own vision attention).

Workload (one process, the same inputs for every path, random weights, bf16): 8 prompts (one
448x448 image + ~60 words each) x 8 samples = 64 sequences x 256 new tokens at temperature 1,
EOS never taken (every sequence runs the full length); then for the engine alone 32 prompts x 8
= 256 x 256, and a mixed-length run: 256 requests whose lengths are drawn from 16-512 (standing
in for EOS) through 64 slots (continuous batching), and `tail`: 64 rows at once (8 prompts x 8) with
lengths 16-512, with and without compaction (vlforge-nocompact: rows stay in their first slots); mixed
also runs with joins at every sync point (vlforge-joineach: Engine(join_share=0)).
Each case runs once in full before the timed
run (warm: CUDA graphs captured, torch.compile done; their time is reported as capture_s /
compile_s). Prints one JSON line per case (also appended to --out) and a table at the end.

floor_ms: the step time if each decode step only read the language model's weights and the
filled KV cache at 4.8 TB/s (H200 HBM3e); floor_frac = floor_ms / ms_per_step.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time

import torch

from vlforge.config import ModelConfig
from vlforge.data.encode import Encoder, ImageLimits, collate, encode_prompt
from vlforge.generate.engine import Engine
from vlforge.generate.forward import encode_images, vision_token_ids
from vlforge.generate.requests import GenRequest, prompts_of_batch
from vlforge.model.load import load_model

from sft_throughput import synthetic_samples, write_trace

HBM_BYTES_PER_S = 4.8e12


def lm_bytes(core) -> int:
    """Bytes of the weights a decode step reads: everything but the vision tower (embeddings read one row)."""
    visual = {id(p) for p in core.model.visual.parameters()}
    embed = core.model.language_model.embed_tokens.weight
    params = {id(p): p for p in core.parameters() if id(p) not in visual}
    total = sum(p.numel() * p.element_size() for p in params.values())
    if core.lm_head.weight is not embed:  # untied: the embedding table is not read per step
        total -= embed.numel() * embed.element_size()
    return total


def kv_bytes_per_token(core) -> int:
    cfg = core.config.text_config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 2  # K and V, bf16


def floor_ms(core, sequences: int, mean_len: float) -> float:
    return 1e3 * (lm_bytes(core) + sequences * mean_len * kv_bytes_per_token(core)) / HBM_BYTES_PER_S


def make_prompts(encoder, n: int, seed: int):
    with tempfile.TemporaryDirectory() as tmp:
        samples = synthetic_samples(n, tmp, 448, random.Random(seed))
        batch = collate([encode_prompt(encoder, s) for s in samples], encoder.pad_id, left_pad=True)
    return {k: v.cuda() for k, v in batch.items()}


def timed(fn):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - start


def run_engine(engine, encoder, requests, slots=None):
    return engine.generate(requests, stop_ids=[], banned_ids=vision_token_ids(encoder),
                           image_token_id=encoder.image_token_id, pad_id=encoder.pad_id, slots=slots)


def case_engine(name, core, engine, encoder, requests, slots=None):
    _, first_s = timed(lambda: run_engine(engine, encoder, requests, slots))  # warm-up: captures graphs
    capture_s = engine.stats.capture_s
    results, seconds = timed(lambda: run_engine(engine, encoder, requests, slots))
    st = engine.stats
    tokens = sum(len(r.tokens) for r in results)
    steps = max(st.steps, 1)
    sequences = min(len(results), slots or len(results))
    mean_len = sum(len(r.tokens) for r in results) / len(results) / 2 + float(
        sum(len(q.prompt.input_ids) for q in requests) / len(requests))
    ms = 1e3 * st.decode_s / steps
    floor = floor_ms(core, sequences, mean_len)
    return {"case": name, "path": "vlforge", "sequences": len(results), "slots": slots or len(results),
            "generated_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "ms_per_step": ms,
            "decode_steps": st.steps, "prefill_s": st.prefill_s, "prefills": st.prefills,
            "capture_s": capture_s, "first_run_s": first_s, "graphs": len(engine.runner.graphs),
            "row_steps": st.row_steps, "compactions": st.compactions,
            "peak_gb": torch.cuda.max_memory_allocated() / 1e9, "floor_ms": floor, "floor_frac": floor / ms}


def case_hf(name, core, encoder, prompts, group, new_tokens, cache_implementation=None):
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_k=0,
                  top_p=1.0, num_return_sequences=group, pad_token_id=encoder.pad_id)
    if cache_implementation:
        kwargs["cache_implementation"] = cache_implementation
    batch = {k: v for k, v in prompts.items() if k in ("input_ids", "attention_mask", "pixel_values",
                                                       "image_grid_thw", "mm_token_type_ids")}
    # the peer is plain transformers: its own per-image sdpa loop in the vision tower too
    vision = core.model.visual.config
    vision._attn_implementation, ours = "sdpa", vision._attn_implementation
    try:
        with torch.no_grad():
            _, first_s = timed(lambda: core.generate(**batch, **kwargs))  # warm-up (static: torch.compile)
            out, seconds = timed(lambda: core.generate(**batch, **kwargs))
    finally:
        vision._attn_implementation = ours
    n = out.shape[0]
    tokens = n * new_tokens
    ms = 1e3 * seconds / new_tokens
    floor = floor_ms(core, n, prompts["input_ids"].shape[1] + new_tokens / 2)
    return {"case": name, "path": f"hf-{cache_implementation or 'dynamic'}", "sequences": n, "slots": n,
            "generated_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "ms_per_step": ms,
            "decode_steps": new_tokens, "prefill_s": None, "prefills": 1,
            "compile_s": max(0.0, first_s - seconds), "first_run_s": first_s,
            "peak_gb": torch.cuda.max_memory_allocated() / 1e9, "floor_ms": floor, "floor_frac": floor / ms}


def case_vision(name, core, prompts, repeats: int = 5):
    """The vision tower over the prompts' images as the prefill runs it (encode_images), warm: the
    median of `repeats` timed runs."""
    grid = prompts["image_grid_thw"].cpu()
    run = lambda: encode_images(core, prompts["pixel_values"], grid, [1] * len(grid))  # noqa: E731
    with torch.no_grad():
        run()
        seconds = sorted(timed(run)[1] for _ in range(repeats))[repeats // 2]
    return {"case": name, "path": "vision", "images": len(grid), "seconds": seconds}


def profile_decode(engine, encoder, requests, path: str) -> None:
    """Where a decode step's time goes: the kernels (CUPTI records those a CUDA graph launches) of a
    warm run, grouped by name, as a table; the graphs of these shapes are already captured."""
    from torch.profiler import ProfilerActivity, profile

    run_engine(engine, encoder, requests)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run_engine(engine, encoder, requests)
        torch.cuda.synchronize()
    steps = max(engine.stats.steps, 1)
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=60, max_name_column_width=90)
    with open(path, "w") as f:
        f.write(f"{len(requests)} prompts x {requests[0].n} samples x {requests[0].max_new_tokens} tokens, "
                f"{steps} decode steps, decode {engine.stats.decode_s:.3f} s, prefill {engine.stats.prefill_s:.3f} s\n")
        f.write(table)
    write_trace(prof, path + ".trace.json.gz")



def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3vl-2b")
    ap.add_argument("--paths", default="vlforge,hf-dynamic,hf-static")
    ap.add_argument("--cases", default="64x256,256x256,mixed,tail")
    ap.add_argument("--sync-every", type=int, default=8)
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", default=None, help="after the 64x256 case: the GPU kernels of a 64x64 run, "
                    "by total time, written to this file (inside CUDA graphs too)")
    args = ap.parse_args()
    paths, cases = args.paths.split(","), args.cases.split(",")
    torch.manual_seed(0)
    model, processor = load_model(ModelConfig(preset=args.preset), dtype=torch.bfloat16, device="cuda")
    model.eval().requires_grad_(False)  # an inference model: the engine fuses its projections (generate/fused.py)
    core = model
    encoder = Encoder(processor, ImageLimits(3136, 448 * 448))
    engine = Engine(model, sync_every=args.sync_every, compile=True)
    # one set of KV buffers for every case (256 slots x the mixed run's longest row): no reallocation
    engine.reserve(256, 300 + 512)
    # and for the n = 8 cases (GroupCache: a prompt's KV once per group, its 8 rows' tokens interleaved)
    engine.reserve(256, 300 + 8 * 256, group=8)
    rows = []

    def emit(row):
        row = {"preset": args.preset, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
               "transformers": __import__("transformers").__version__, **row}
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")

    def requests_of(prompts, n_prompts, group, new_tokens):
        return [GenRequest(p, n=group, max_new_tokens=new_tokens, temperature=1.0, seed=1, first_row=b * group)
                for b, p in enumerate(prompts_of_batch(prompts, [1] * n_prompts))]

    def attempt(fn):  # one failing case is reported, the others still run
        try:
            emit(fn())
        except Exception as e:  # noqa: BLE001
            print(json.dumps({"preset": args.preset, "error": f"{type(e).__name__}: {e}"[:2000]}), flush=True)

    small = make_prompts(encoder, 8, 0)
    if "64x256" in cases:
        if "vlforge-nocompile" in paths:  # CUDA graphs of the eager layers (v1)
            plain = Engine(model, sync_every=args.sync_every, compile=False)
            plain.reserve(64, 300 + 256)
            attempt(lambda: {**case_engine("64x256", core, plain, encoder, requests_of(small, 8, 8, 256)),
                             "path": "vlforge-nocompile"})
            reference = run_engine(plain, encoder, requests_of(small, 8, 8, 256))
            del plain
        if "vlforge" in paths:
            attempt(lambda: case_engine("64x256", core, engine, encoder, requests_of(small, 8, 8, 256)))
            if "vlforge-nocompile" in paths:  # bf16 kernels differ: the same tokens at first, then drift
                ours = run_engine(engine, encoder, requests_of(small, 8, 8, 256))
                first = sum(int(a.tokens[0] == b.tokens[0]) for a, b in zip(ours, reference)) / len(ours)
                prefix = sum(int(torch.equal(a.tokens[:8], b.tokens[:8])) for a, b in zip(ours, reference)) / len(ours)
                print(json.dumps({"agreement_compiled_vs_eager_layers": {"first_token": first, "first_8": prefix}}))
            if args.profile:
                profile_decode(engine, encoder, requests_of(small, 8, 8, 64), args.profile)
        if "vlforge-unfused" in paths:  # one GEMM per projection, as transformers (the step compiles again)
            engine.fuse_projections = False
            attempt(lambda: {**case_engine("64x256", core, engine, encoder, requests_of(small, 8, 8, 256)),
                             "path": "vlforge-unfused"})
            engine.fuse_projections = True
        if "vision" in paths:  # the vision tower's share of the prefill: its 8 images alone, warm
            attempt(lambda: case_vision("64x256", core, small))
        if "vision-sdpa" in paths:  # the same through transformers' per-image sdpa loop (model.attention.vision=sdpa)
            config = core.model.visual.config
            config._attn_implementation, varlen = "sdpa", config._attn_implementation
            attempt(lambda: {**case_vision("64x256", core, small), "path": "vision-sdpa"})
            config._attn_implementation = varlen
        if "vlforge-noshare" in paths:  # SlotCache: each row reads its own copy of the prompt's KV (v3)
            engine.share_prompt = False
            attempt(lambda: {**case_engine("64x256", core, engine, encoder, requests_of(small, 8, 8, 256)),
                             "path": "vlforge-noshare"})
            engine.share_prompt = True
        if "hf-dynamic" in paths:
            attempt(lambda: case_hf("64x256", core, encoder, small, 8, 256))
        if "hf-static" in paths:
            attempt(lambda: case_hf("64x256", core, encoder, small, 8, 256, "static"))
    if "256x256" in cases and "vlforge" in paths:
        large = make_prompts(encoder, 32, 1)
        attempt(lambda: case_engine("256x256", core, engine, encoder, requests_of(large, 32, 8, 256)))
    if "mixed" in cases and "vlforge" in paths:
        large = make_prompts(encoder, 32, 1)
        rng = random.Random(2)
        mixed = [GenRequest(p, max_new_tokens=rng.randint(16, 512), temperature=1.0, seed=2, first_row=i)
                 for i, p in enumerate(prompts_of_batch(large, [1] * 32) * 8)]
        default_share = engine.join_share
        for share in (default_share, 0.0):  # joins batched (default) or at every sync point where a slot freed
            engine.join_share = share
            attempt(lambda: {**case_engine("mixed-16-512", core, engine, encoder, mixed, slots=64),
                             "path": "vlforge" if share else "vlforge-joineach"})
        engine.join_share = default_share
    if "tail" in cases and "vlforge" in paths:  # a GRPO round: 64 rows at once, EOS at 16-512 tokens
        rng = random.Random(3)
        tail = [GenRequest(p, max_new_tokens=rng.randint(16, 512), temperature=1.0, seed=3, first_row=i)
                for i, p in enumerate(prompts_of_batch(small, [1] * 8) * 8)]
        for compact in (True, False):  # running rows moved down into freed slots, or left where they started
            engine.compact = compact
            attempt(lambda: {**case_engine("tail-16-512", core, engine, encoder, tail),
                             "path": "vlforge" if compact else "vlforge-nocompact"})
        engine.compact = True

    print(f"\n{args.preset}  {torch.cuda.get_device_name()}")
    print(f"{'case':14} {'path':12} {'seqs':>5} {'tok/s':>8} {'ms/step':>8} {'prefill s':>9} {'capture s':>9} "
          f"{'peak GB':>8} {'floor':>6}")
    for r in rows:
        if "tokens_per_s" not in r:  # the vision tower alone
            print(f"{r['case']:14} {r['path']:12} {r['images']:>5} images: {r['seconds']:.3f} s")
            continue
        cap = r.get("capture_s", r.get("compile_s", 0.0))
        pre = "-" if r["prefill_s"] is None else f"{r['prefill_s']:.3f}"
        print(f"{r['case']:14} {r['path']:12} {r['sequences']:>5} {r['tokens_per_s']:>8.0f} {r['ms_per_step']:>8.2f} "
              f"{pre:>9} {cap:>9.1f} {r['peak_gb']:>8.1f} {r['floor_frac']:>6.0%}")


if __name__ == "__main__":
    main()
