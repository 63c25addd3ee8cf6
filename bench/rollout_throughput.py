"""Rollout (generation) throughput of the GRPO engine on BASELINES.md's workload.

    python bench/rollout_throughput.py --preset qwen3vl-2b
    python bench/rollout_throughput.py --preset qwen3vl-30b-a3b --lora fused   # GRPO's policy: LoRA r=16 on
    python bench/rollout_throughput.py --preset qwen3vl-30b-a3b --lora peft    # attention + every expert
    python bench/rollout_throughput.py --preset qwen3vl-8b --lora peft --precision bf16 fp8   # FP8 rollouts (8B LoRA)
    python bench/rollout_throughput.py --preset qwen3vl-2b --precision bf16 fp8              # (2B, full)

8 prompts (one 448x448 image + ~64 prompt tokens each) x 8 samples = 64 sequences, 256 new
tokens sampled at temperature 1 (EOS disabled so every sequence runs the full length), bf16,
random weights. Warm: one full-length rollout first (CUDA graphs captured, the decode step
compiled: `first_run_s`), then the timed one (transformers' own generate on the same workload:
bench/generate.py's hf-dynamic / hf-static paths).
`--lora fused|peft`: the model carries a LoRA adapter as a GRPO policy does (r=16 on the language
attention, and on every expert of a MoE preset, router frozen; lora_B drawn so the update is not
zero), with expert LoRA fused (model/moe_lora.py) or through peft's folding ParamWrapper.
`--precision bf16 fp8`: each precision in turn in this process, on the same model, prompts and engine
(the peer in the same process); rollout.precision=fp8 (generate/fp8.py) runs the decoder projections on
FP8 copies, made once before its warm-up (`make_s`) and refreshed before the timed rollout (`refresh_s`,
what GRPO pays every step). Each precision also reports the mismatch GRPO logs as rollout/k3_kl: the
mean k3 KL over the timed rollout's tokens between its log-probs and the model's own teacher-forced
ones (the trainer's, bf16 weights), and the largest |log ratio|; after correction (rl.rollout_correction's
default cap and band, token level): the k3 KL over the tokens MIS keeps, the share MIS masks and the
share TIS truncates.
Prints one JSON line per precision with generated tokens/s, then the fp8/bf16 speed ratio.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time

import torch

from vlforge.config import ModelConfig, RolloutConfig, SFTConfig, load_config
from vlforge.data.encode import Encoder, ImageLimits, collate, encode_prompt
from vlforge.model.load import load_model
from vlforge.model.presets import MOE_PRESETS
from vlforge.model.tiers import apply_plan, build_plan
from vlforge.generate.engine import Engine
from vlforge.rl.correction import mismatch_stats, rollout_correction
from vlforge.rollout.groups import generate_groups
from vlforge.rollout.logprobs import sequence_logprobs
from vlforge.rollout.precision import refresh_rollout_weights, rollout_precision

from sft_throughput import synthetic_samples


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3vl-2b")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--lora", default="none", choices=["none", "fused", "peft"])
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run (--preset tiny; CPU times say nothing)")
    ap.add_argument("--precision", nargs="+", default=["bf16"], choices=["bf16", "fp8"],
                    help="rollout.precision; several: each in turn in this process")
    args = ap.parse_args()
    model, encoder, prompts = setup(args)
    engine = Engine(model)  # one engine: each precision's graphs are keyed by its plan
    rows = [timed_rollouts(args, model, encoder, prompts, engine, precision) for precision in args.precision]
    for row in rows:
        print(json.dumps(row))
    speed = {r["precision"]: r["tokens_per_s"] for r in rows}
    if {"bf16", "fp8"} <= speed.keys():
        print(json.dumps({"fp8_over_bf16": speed["fp8"] / speed["bf16"]}))


def setup(args):
    """The preset's random-weight bf16 model (with a LoRA adapter if asked), its encoder and the prompts."""
    model, processor = load_model(ModelConfig(preset=args.preset), dtype=torch.bfloat16, device=args.device)
    if args.lora != "none":
        moe = args.preset in MOE_PRESETS
        tiers = load_config(SFTConfig, None, [
            "tiers.language.r=16", "tiers.language.alpha=32", "tiers.projector.train=false", "tiers.vision.train=false",
            f"tiers.language.experts={str(moe).lower()}", f"tiers.expert_lora={args.lora}"]).tiers
        model = apply_plan(model, build_plan(model, tiers)).to(torch.bfloat16)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(std=1e-3)
    model.eval()
    encoder = Encoder(processor, ImageLimits(3136, 448 * 448))
    encoder.im_end_id, encoder.end_ids = -1, []  # never stop early: measure full-length decoding
    with tempfile.TemporaryDirectory() as tmp:
        samples = synthetic_samples(args.prompts, tmp, 448, random.Random(0))
        prompts = collate([encode_prompt(encoder, s) for s in samples], encoder.pad_id, left_pad=True)
    return model, encoder, {k: v.to(args.device) for k, v in prompts.items()}


def timed_rollouts(args, model, encoder, prompts, engine, precision: str) -> dict:
    """A warm-up rollout at full length, then the timed one; its speed and its log-prob gap to the model."""
    cfg = RolloutConfig(group_size=args.group, max_new_tokens=args.new_tokens, temperature=1.0, precision=precision)
    cuda = args.device != "cpu"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    make_s = refresh_rollout_weights(engine, cfg).get("rollout/fp8_refresh_s")  # fp8: the copies made
    start = time.perf_counter()
    with rollout_precision(engine, cfg):
        generate_groups(engine, encoder, prompts, [1] * args.prompts, cfg)  # warm-up at full length
    if cuda:
        torch.cuda.synchronize()
    first_run_s = time.perf_counter() - start
    refresh_s = refresh_rollout_weights(engine, cfg).get("rollout/fp8_refresh_s")  # fp8: a GRPO step's refresh
    start = time.perf_counter()
    with rollout_precision(engine, cfg):
        rollout = generate_groups(engine, encoder, prompts, [1] * args.prompts, cfg)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    generated = int(rollout.response_mask.sum())
    with torch.no_grad():  # the trainer's log-probs of the rollout's tokens (bf16 weights), in slices of 8
        logp = torch.cat([sequence_logprobs(model, rollout, cfg.temperature, list(range(s, min(s + 8, len(
            rollout.finished)))))[0] for s in range(0, len(rollout.finished), 8)])
    old, new, mask = logp.float(), rollout.logprobs.float(), rollout.response_mask
    gap = mismatch_stats(old, new, mask)
    # after correction (rl.rollout_correction's defaults, token level): the gap over the tokens MIS keeps,
    # and the shares MIS masks and TIS truncates
    _, kept, masked = rollout_correction(old, new, mask, "mis")
    kept_gap = mismatch_stats(old, new, kept)
    truncated = rollout_correction(old, new, mask, "tis")[2]
    return {"preset": args.preset, "sequences": args.prompts * args.group, "new_tokens": args.new_tokens,
            "generated_tokens": generated, "seconds": seconds, "tokens_per_s": generated / seconds,
            "ms_per_decode_step": 1000 * seconds / args.new_tokens, "first_run_s": first_run_s,
            "lora": args.lora, "precision": precision, "make_s": make_s, "refresh_s": refresh_s,
            "k3_kl": float(gap["k3_kl_sum"] / gap["tokens"]), "log_ratio_abs_max": float(gap["log_ratio_abs_max"]),
            "k3_kl_mis_kept": float(kept_gap["k3_kl_sum"] / kept_gap["tokens"].clamp(min=1)),
            "mis_masked_share": float(masked.sum() / gap["tokens"]),
            "tis_truncated_share": float(truncated.sum() / gap["tokens"]),
            "gpu": torch.cuda.get_device_name() if cuda else "cpu",
            "peak_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else None}


if __name__ == "__main__":
    main()
