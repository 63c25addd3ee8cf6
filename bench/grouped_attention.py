"""GroupCache's decode attention alone: which SDPA kernel serves G rows' queries against one prompt's KV.

    python bench/grouped_attention.py            # 2B shapes (16 query / 8 KV heads, head dim 128)
    python bench/grouped_attention.py --q-heads 32 --kv-heads 8   # 8B

The engine's grouped decode (generate/cache.py `_decode_attention_grouped`) runs per group one SDPA
call of G x (q heads / kv heads) query rows against the prompt's keys followed by the G rows'
interleaved generated keys, masked so a row sees the prompt and its own tokens. In the 2B profile of
docs/benchmarks-log.md 2026-12-03 ("Batched joins") that call took ~23 us a layer (cudnn's flash kernel) where its KV bytes take
~2.5 us at HBM speed. This times the same call through each SDPA backend torch offers for a masked
call (cudnn, efficient, math), with a boolean and an additive mask, and flex_attention (compiled),
at the step's shapes: P groups x G rows, Lk positions read, timed inside a CUDA graph as the
engine runs them (the earlier 2026-12-03 numbers were eager, launch cost included). Prints one JSON
line per case.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def grouped_mask(P: int, G: int, qpk: int, prompt: int, generated: int, Lk: int, device) -> torch.Tensor:
    """[P, 1, G*qpk, Lk] bool: the prompt's positions, then each row's own interleaved tokens."""
    pos = torch.arange(Lk, device=device)
    member = torch.arange(G, device=device).repeat_interleave(qpk)  # query row -> its member
    own = (pos[None] >= prompt) & ((pos[None] - prompt) % G == member[:, None]) & \
        (pos[None] < prompt + G * generated)
    keep = (pos[None] < prompt) | own
    return keep[None, None].expand(P, 1, -1, -1).contiguous()


def time_us(fn, iters: int = 50, replays: int = 10) -> tuple[float, str]:
    """GPU time per call: `iters` calls captured in one CUDA graph, replayed (as the engine's step
    runs), so the host's launch cost is not in it; eager back-to-back calls if capture fails."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(iters):
                fn()
        run, how, calls = graph.replay, "graph", iters * replays
    except RuntimeError:  # a kernel choice that cannot be captured: eager, launch cost included
        torch.cuda.synchronize()
        run, how, calls, replays = fn, "eager", iters * replays, iters * replays
    start.record()
    for _ in range(replays):
        run()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / calls, how


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--q-heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=330)
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    P, G, Hkv, D = args.groups, args.group, args.kv_heads, args.head_dim
    qpk = args.q_heads // Hkv
    for generated in (16, 128, 256):
        Lk = 512 * -(-(args.prompt + G * (generated + 8)) // 512)  # the engine's bucket for G = 8
        q = torch.randn(P, Hkv, G * qpk, D, device=dev, dtype=dt)
        k, v = (torch.randn(P, Hkv, Lk, D, device=dev, dtype=dt) for _ in range(2))
        keep = grouped_mask(P, G, qpk, args.prompt, generated, Lk, dev)
        additive = torch.zeros(keep.shape, device=dev, dtype=dt).masked_fill(~keep, float("-inf"))
        reference = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=keep)
        cases = {}

        def sdpa(mask, backend=None):
            if backend is None:
                return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

            def call():
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            return call

        cases["default, bool mask"] = sdpa(keep)
        cases["default, additive mask"] = sdpa(additive)
        cases["cudnn, bool"] = sdpa(keep, SDPBackend.CUDNN_ATTENTION)
        cases["efficient, bool"] = sdpa(keep, SDPBackend.EFFICIENT_ATTENTION)
        cases["efficient, additive"] = sdpa(additive, SDPBackend.EFFICIENT_ATTENTION)
        cases["math, bool"] = sdpa(keep, SDPBackend.MATH)
        try:
            from torch.nn.attention.flex_attention import flex_attention

            flex = torch.compile(flex_attention)
            keep_PQL = keep[:, 0]

            def mask_mod(score, b, h, q_idx, kv_idx):
                return torch.where(keep_PQL[b, q_idx, kv_idx], score, float("-inf"))

            cases["flex (compiled), score_mod"] = lambda: flex(q, k, v, score_mod=mask_mod)
        except Exception as e:  # noqa: BLE001 -- a missing backend is a result, not a failure
            print(json.dumps({"case": "flex", "error": repr(e)[:200]}))
        kv_bytes = 2 * P * Hkv * Lk * D * 2
        for name, fn in cases.items():
            try:
                out = fn()
                err = (out.float() - reference).abs().max().item()
                us, how = time_us(fn)
                print(json.dumps({"generated": generated, "Lk": Lk, "case": name, "us": round(us, 2), "timed": how,
                                  "max_err": err, "kv_us_at_4.8TB/s": round(1e6 * kv_bytes / 4.8e12, 2)}))
            except Exception as e:  # noqa: BLE001
                print(json.dumps({"generated": generated, "Lk": Lk, "case": name, "error": repr(e)[:200]}))


if __name__ == "__main__":
    main()
