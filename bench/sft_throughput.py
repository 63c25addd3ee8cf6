"""SFT step throughput, peak memory and the loss curve on the workload of shared/BASELINES.md.

    python bench/sft_throughput.py --preset qwen3vl-2b --method full
    python bench/sft_throughput.py --preset qwen3vl-8b --method lora
    python bench/sft_throughput.py --preset qwen3vl-2b --method full --fsdp        # FSDP2, world size 1
    python bench/sft_throughput.py --preset qwen3vl-8b --method full --grad-ckpt --override optim.name=adamw8bit
    python bench/sft_throughput.py --preset qwen3vl-8b --method full --steps 200 --curve fp8.json \
        --override precision.fp8.enabled=true precision.master_weights=compute
    python bench/sft_throughput.py --preset qwen3vl-30b-a3b --method lora --grad-ckpt     # MoE: LoRA attention + experts
    python bench/sft_throughput.py --preset qwen3vl-30b-a3b --method lora --grad-ckpt --override model.experts_implementation=eager

MoE presets (qwen3vl-30b-a3b, qwen3vl-235b-a22b) with --method lora train LoRA on attention and on
the fused experts (tiers.language.experts=true), router frozen; the experts run with
model.experts_implementation (auto: grouped_mm on CUDA). Gradient checkpointing is advised there:
without it peft's folded expert copies of every layer stay alive until backward (--plan shows it).

Each sample: one 448x448 image (196 image tokens), ~64 prompt tokens, an answer of 128-384
tokens; batch 8, random weights of the published architecture. Uses the real recipe pieces
(setup_model, the dataset encoder, collate, train_step). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch
from PIL import Image

from vlforge.config import SFTConfig, load_config
from vlforge.data.encode import Encoder, ImageLimits, SampleTokens, collate, encode
from vlforge.data.jsonl import Sample
from vlforge.engine.distributed import init_world
from vlforge.engine.fp8 import summarize
from vlforge.engine.health import GradHealth
from vlforge.engine.optim import build_optimizer
from vlforge.model.presets import MOE_PRESETS
from vlforge.model.tiers import param_groups
from vlforge.engine.trainable import setup_model
from vlforge.recipes.sft import train_step

WORDS = "the a red blue green circle square triangle left right shape image colour how many is on of".split()
# Answers follow a fixed random bigram chain (each word has three likely successors), so a loss
# curve has structure to learn beyond word frequencies: FP8 vs bf16 curves compare learning.
_chain = random.Random(1234)
SUCCESSORS = {w: _chain.sample(WORDS, 3) for w in WORDS}


def markov_answer(rng: random.Random, n_words: int) -> str:
    words = [rng.choice(WORDS)]
    for _ in range(n_words - 1):
        words.append(rng.choices(SUCCESSORS[words[-1]], weights=(6, 3, 1))[0])
    return " ".join(words)


def synthetic_samples(n: int, tmp: str, image_side: int, rng: random.Random) -> list[Sample]:
    samples = []
    for i in range(n):
        path = f"{tmp}/img{i}.png"
        Image.frombytes("RGB", (image_side, image_side), rng.randbytes(image_side * image_side * 3)).save(path)
        prompt = " ".join(rng.choice(WORDS) for _ in range(60))
        answer = markov_answer(rng, rng.randint(128, 384))
        user = [{"type": "image", "image": path}, {"type": "text", "text": prompt}]
        samples.append(Sample([{"role": "user", "content": user}, {"role": "assistant", "content": answer}],
                              [__import__("pathlib").Path(path)], f"synthetic:{i}"))
    return samples


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3vl-2b")
    ap.add_argument("--method", default="full", choices=["full", "lora"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--image", type=int, default=448)
    ap.add_argument("--grad-ckpt", action="store_true")
    ap.add_argument("--samples", type=int, default=32, help="distinct samples, cycled")
    ap.add_argument("--curve", help="write per-step loss and tokens/s to this JSON file")
    ap.add_argument("--override", nargs="*", default=[])
    ap.add_argument("--fsdp", action="store_true", help="FSDP2 on this one process (distributed.strategy=fsdp2)")
    args = ap.parse_args()

    vision = "tiers.vision.train=false" if args.method == "lora" else "tiers.vision.train=true"
    cfg = load_config(SFTConfig, None, [
        f"model.preset={args.preset}", f"tiers.method={args.method}", "precision.mode=bf16", "train.device=cuda",
        f"precision.gradient_checkpointing={str(args.grad_ckpt).lower()}", vision,
        # the peer baseline trains LoRA on LM attention only
        *(["tiers.projector.train=false", "tiers.language.r=16", "tiers.language.alpha=32"] if args.method == "lora" else []),
        *(["tiers.language.experts=true"] if args.method == "lora" and args.preset in MOE_PRESETS else []),
        *args.override])
    torch.backends.cuda.matmul.allow_tf32 = True
    if args.fsdp:
        cfg.distributed.strategy = "fsdp2"
    t = setup_model(cfg, world=init_world(cfg.distributed, cfg.train.device))
    encoder = Encoder(t.processor, ImageLimits(3136, args.image * args.image))
    import tempfile

    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        samples = synthetic_samples(args.samples, tmp, args.image, rng)
        items = []
        for s in samples:
            ids = encoder.token_ids(s.messages, [(args.image, args.image)])
            items.append(encode(encoder, s, SampleTokens(ids, encoder.assistant_labels(ids), len(ids))))
    batches = [collate(items[i:i + args.batch], encoder.pad_id, multiple=t.token_multiple)
               for i in range(0, len(items), args.batch)]
    optimizer = build_optimizer(param_groups(t.model, t.plan, 0.0), cfg.optim, "cuda")
    scaler = t.policy.grad_scaler()
    health = GradHealth(t.model, t.plan, cfg.health, cfg.precision.mode)
    torch.cuda.reset_peak_memory_stats()
    times, tokens, losses = [], [], []
    for step in range(args.warmup + args.steps):
        batch = batches[step % len(batches)]
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = train_step(t, [batch], optimizer, scaler, health, 1.0)
        torch.cuda.synchronize()
        losses.append(out["loss"])
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
            tokens.append(out["tokens"])
    step_s = sum(times) / len(times)
    pad_fraction = 1 - sum(int(b["attention_mask"].sum()) for b in batches) / sum(b["attention_mask"].numel() for b in batches)
    result = {
        "preset": args.preset, "method": args.method, "batch": args.batch, "grad_ckpt": args.grad_ckpt,
        "strategy": t.world.strategy, "optim": cfg.optim.name,
        "tokens_per_s": sum(tokens) / sum(times), "step_s": step_s,
        "peak_gb": torch.cuda.max_memory_allocated() / 1e9, "pad_fraction": pad_fraction,
        "seq_len_mean": sum(len(x["input_ids"]) for x in items) / len(items),
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "transformers": __import__("transformers").__version__, "overrides": args.override,
        "loss_first": losses[0], "loss_last10": sum(losses[-10:]) / len(losses[-10:]),
        "fp8": summarize(t.fp8_plan) if t.fp8_plan else None,
        # MoE: the expert kernels and the last step's expert load (engine/moe.py)
        "experts_implementation": getattr(getattr(t.model.config, "text_config", None), "_experts_implementation", None),
        **{k: v for k, v in out.items() if k.startswith("moe/")},
    }
    if args.curve:
        with open(args.curve, "w") as f:
            json.dump({**result, "losses": losses, "step_times": times}, f)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
