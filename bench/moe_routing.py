"""MoE routing flips between GRPO's rollout and its trainer, with and without router replay.

    python bench/moe_routing.py                                  # H200: 30B-A3B, bf16, 8 prompts x 8 x 128
    python bench/moe_routing.py --preset tiny-moe --device cpu   # the same code path on a laptop

Random weights (the preset), bf16, 8 prompts (one 448x448 image + ~64 prompt tokens) x 8 samples,
128 new tokens at temperature 1 (EOS disabled: every sequence runs the full length). The rollout
records every token's top-k experts (rollout.router_replay); the trainer's forward
(sequence_logprobs, mini-batches of 16 sequences as GRPO runs it, no gradient) is then run

- as it is: `flip` = share of (token, layer) pairs whose top-k set differs from the rollout's
  (prompt tokens: the prefill's batched forward; response tokens: the decode steps), and the
  rollout-vs-trainer log-prob ratio exp(trainer - rollout) (mean, max, min) and KL (k1 as
  policy_loss's approx_kl, and k3) on the response tokens;
- with replay: the same numbers when the trainer runs the recorded experts.

Also the rollout's generated tokens/s with and without recording (warm, medians of --repeats).
Random weights route near-uniformly (router logits ~0, ties everywhere), so their flip rate is
an upper bound of a trained model's. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from dataclasses import replace

import torch

from vlforge.generate.engine import Engine
from vlforge.config import ModelConfig, RolloutConfig
from vlforge.data.encode import Encoder, ImageLimits, collate, encode_prompt
from vlforge.train.moe import Routing, capture, follow
from vlforge.generate.routes import NO_ROUTE
from vlforge.model.load import load_model
from vlforge.rollout.groups import generate_groups
from vlforge.rollout.logprobs import route_rows, sequence_logprobs

from sft_throughput import synthetic_samples


def trainer_pass(model, routing, rollout, replay: bool | None, mini: int, autocast) -> dict:
    """The trainer's log-probs [N, R] and per-(token, layer) flips of its own routes against the
    rollout's, split into prompt and response tokens. replay None: the rollout's routes not followed."""
    N, R = rollout.response_ids.shape
    P = rollout.prompt_ids.shape[1]
    logps, flips = [], {"prompt": [0, 0], "response": [0, 0]}
    for lo in range(0, N, mini):
        seqs = list(range(lo, min(lo + mini, N)))
        rows = route_rows(rollout, seqs)  # [L, n * (P + R), k]
        with torch.no_grad(), autocast(), follow(routing, rows if replay is not None else None, bool(replay)), \
                capture(routing, None) as routed:
            logps.append(sequence_logprobs(model, rollout, 1.0, seq_index=seqs)[0])
        own = torch.stack([routed.logits[i].float().topk(routing.top_k, -1).indices for i in sorted(routed.logits)])
        valid = rows[..., 0] != NO_ROUTE  # [L, n * (P + R)]
        differ = (own.sort(-1).values != rows.long().sort(-1).values).any(-1) & valid
        response = (torch.arange(P + R, device=valid.device) >= P).repeat(len(seqs))[None].expand_as(valid)
        for part, where in (("prompt", ~response), ("response", response)):
            flips[part][0] += int((differ & where).sum())
            flips[part][1] += int((valid & where).sum())
    routing.step_metrics()  # drop the counts kept for the step metrics
    mask = rollout.response_mask.bool()
    d = torch.cat(logps)[mask].double() - rollout.logprobs[mask].double()  # trainer - rollout
    ratio = d.exp()
    pairs = flips["prompt"][1] + flips["response"][1]
    return {"flip": (flips["prompt"][0] + flips["response"][0]) / max(pairs, 1),
            "flip_prompt": flips["prompt"][0] / max(flips["prompt"][1], 1),
            "flip_response": flips["response"][0] / max(flips["response"][1], 1),
            "ratio_mean": float(ratio.mean()), "ratio_max": float(ratio.max()), "ratio_min": float(ratio.min()),
            "kl_k1": float((-d).mean()), "kl_k3": float((ratio - d - 1).mean()),
            "logp_abs_diff_max": float(d.abs().max())}


def timed(fn, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3vl-30b-a3b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--image", type=int, default=448)
    ap.add_argument("--mini-batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="torch.compile the decode step (rollout.compile; "
                    "two compiles: with and without recording)")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16
    model, processor = load_model(ModelConfig(preset=args.preset), dtype=dtype, device=device)
    model.eval()
    routing = Routing.of(model)  # before anything runs the model (generate/routes.py: why)
    encoder = Encoder(processor, ImageLimits(3136, args.image * args.image))
    encoder.im_end_id, encoder.end_ids = -1, []  # never stop early
    with tempfile.TemporaryDirectory() as tmp:
        samples = synthetic_samples(args.prompts, tmp, args.image, random.Random(0))
        prompts = collate([encode_prompt(encoder, s) for s in samples], encoder.pad_id, left_pad=True)
    prompts = {k: v.to(device) for k, v in prompts.items()}
    plain = RolloutConfig(group_size=args.group, max_new_tokens=args.new_tokens, temperature=1.0,
                          compile=args.compile)
    record = replace(plain, router_replay="record")
    autocast = lambda: torch.autocast(device.type, dtype=dtype)  # noqa: E731  (GRPO's precision policy: bf16)

    engine = Engine(model)  # one for every rollout: its buffers and graphs reused, as GRPO's run does

    def rollout(cfg):
        torch.manual_seed(0)  # the same tokens recorded or not: recording changes no number
        with torch.no_grad(), autocast():
            return generate_groups(engine, encoder, prompts, [1] * args.prompts, cfg)

    first = {name: timed(lambda: rollout(cfg), device) for name, cfg in (("plain", plain), ("record", record))}
    seconds = {"plain": [], "record": []}
    for _ in range(args.repeats):  # alternating, so drifting clocks hit both
        for name, cfg in (("plain", plain), ("record", record)):
            seconds[name].append(timed(lambda: rollout(cfg), device))
    recorded = rollout(record)
    assert torch.equal(recorded.response_ids, rollout(plain).response_ids)
    generated = int(recorded.response_mask.sum())
    tps = {name: generated / statistics.median(s) for name, s in seconds.items()}

    row = {"preset": args.preset, "sequences": args.prompts * args.group, "new_tokens": args.new_tokens,
           "prompt_tokens": int(prompts["attention_mask"].sum(1).float().mean()), "dtype": "bf16",
           "compile": args.compile, "layers": int(recorded.routes.shape[0]), "top_k": routing.top_k,
           "no_replay": trainer_pass(model, routing, recorded, False, args.mini_batch, autocast),
           "replay": trainer_pass(model, routing, recorded, True, args.mini_batch, autocast),
           "rollout_tokens_per_s": tps["plain"], "rollout_tokens_per_s_recording": tps["record"],
           "recording_cost": 1 - tps["record"] / tps["plain"], "first_run_s": first,
           "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
           "peak_gb": torch.cuda.max_memory_allocated() / 1e9 if device.type == "cuda" else None,
           "weights": "random (near-uniform routing: an upper bound of a trained model's flips)"}
    print(json.dumps(row))


if __name__ == "__main__":
    main()
