"""GRPO update throughput, padded vs packed log-prob forwards (rl.packing), on one rollout.

    python bench/grpo_update.py --recipe qwen3vl-2b-grpo                  # full FT, KL to a frozen copy
    python bench/grpo_update.py --recipe qwen3vl-8b-grpo                  # LoRA, KL to the adapter-disabled model
    python bench/grpo_update.py --recipe qwen3vl-2b-grpo --mixed --max-new 2048
    python bench/grpo_update.py --recipe qwen3vl-2b-grpo --override compile.enabled=true

The shipped recipe (configs/RECIPE.yaml on its preset's random weights, bf16, its mini-batch size,
KL and gradient checkpointing) and the recipe's own `update` (reference log-probs, then
rl.mini_batch_size mini-batches of forward, backward and optimizer step) on one rollout of
--prompts x --group sequences, once with rl.packing=false and once with rl.packing=true, the same
batches. Prompts: one 448x448 image and ~64 words (BASELINES.md), or (--mixed) 1-4 images of
224-448 px. Responses: random text tokens (their values do not change the work), lengths
log-uniform between --min-new and --max-new with a --capped share at the cap (truncated, as
DAPO's overlong responses are): what makes most of a padded update's tokens padding. No
generation runs: the update only reads the rollout. The learning rate is 0, so every update
starts from the same weights and the modes' losses must agree (bf16 rounding apart).

Modes alternate, --warmup updates each first. update tokens/s = the rollout's real tokens
(prompts without left padding + responses without right padding, per sequence) / update seconds:
the same numerator for both modes, so the ratio is the speed-up. Prints one JSON line per mode
and one summary line (speed-up, padding share, loss difference).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import statistics
import tempfile
import time

import torch

from vlforge.config import GRPOConfig, load_config
from vlforge.data.encode import Encoder, ImageLimits, collate, encode_prompt
from vlforge.train.health import GradHealth
from vlforge.train.optim import build_optimizer
from vlforge.train.trainable import setup_model
from vlforge.generate.forward import vision_token_ids
from vlforge.model.tiers import param_groups
from vlforge.recipes.grpo import disable_dropout, update
from vlforge.rollout.minibatch import Batch
from vlforge.rollout.groups import Rollout
from vlforge.rollout.logprobs import sequence_logprobs

from sft_throughput import synthetic_samples


def response_lengths(n: int, lo: int, hi: int, capped: float, rng: random.Random) -> list[int]:
    return [hi if rng.random() < capped else int(math.exp(rng.uniform(math.log(lo), math.log(hi)))) for _ in range(n)]


def synthetic_rollout(encoder: Encoder, args, device) -> Rollout:
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        samples = synthetic_samples(args.prompts, tmp, 448, rng, mixed=args.mixed)
        encoded = [encode_prompt(encoder, s) for s in samples]
    prompts = {k: v.to(device) for k, v in collate(encoded, encoder.pad_id, left_pad=True).items()}
    N = args.prompts * args.group
    lengths = response_lengths(N, args.min_new, args.max_new, args.capped, rng)
    R = max(lengths)
    gen = torch.Generator().manual_seed(args.seed)
    # ordinary text tokens: the prompts' own, less the special ones (vision, end of turn, padding)
    specials = set(vision_token_ids(encoder)) | set(encoder.end_ids) | {encoder.pad_id}
    pool = torch.tensor(sorted(set(prompts["input_ids"].unique().tolist()) - specials))
    ids = pool[torch.randint(len(pool), (N, R), generator=gen)]
    mask = (torch.arange(R)[None] < torch.tensor(lengths)[:, None]).long()
    ids = ids.masked_fill(mask == 0, encoder.pad_id)
    return Rollout(prompts["input_ids"], prompts["attention_mask"], prompts.get("pixel_values"),
                   prompts.get("image_grid_thw"), [len(s.images) for s in samples], ids.to(device), mask.to(device),
                   torch.zeros(N, R, device=device), torch.tensor([n < args.max_new for n in lengths], device=device),
                   args.group, vision_token_ids(encoder))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default="qwen3vl-2b-grpo", help="a configs/ GRPO recipe")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--min-new", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=1024)
    ap.add_argument("--capped", type=float, default=0.15, help="share of responses cut at --max-new")
    ap.add_argument("--mixed", action="store_true", help="1-4 images of 224-448 px per prompt")
    ap.add_argument("--packing", default="both", choices=["both", "on", "off"])
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--override", nargs="*", default=[])
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run (e.g. --override model.preset=tiny)")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    cfg = load_config(GRPOConfig, f"configs/{args.recipe}.yaml", [
        f"train.device={args.device}", f"rollout.group_size={args.group}", f"rollout.prompts_per_step={args.prompts}",
        f"rollout.max_new_tokens={args.max_new}", *args.override])
    torch.backends.cuda.matmul.allow_tf32 = True
    t = setup_model(cfg, compile_blocks=cfg.compile.enabled is True)  # as run_grpo: compiled only when asked
    disable_dropout(t.model)
    t.model.train()
    ref_model = None
    if cfg.rl.kl_beta > 0 and cfg.tiers.method == "full":  # as run_grpo
        ref_model = copy.deepcopy(t.model).requires_grad_(False).eval()
        t.policy.apply(ref_model)
    encoder = Encoder(t.processor, ImageLimits(cfg.data.min_pixels, 448 * 448))
    rollout = synthetic_rollout(encoder, args, t.device)
    N = rollout.response_ids.shape[0]
    with torch.no_grad(), t.policy.autocast():  # the behaviour policy's log-probs: ratio 1 at lr 0
        mb = cfg.rl.mini_batch_size
        rollout.logprobs = torch.cat([sequence_logprobs(t.model, rollout, cfg.rollout.temperature,
                                                        list(range(s, min(s + mb, N))))[0] for s in range(0, N, mb)])
    advantages = torch.randn(N, generator=torch.Generator().manual_seed(args.seed)).to(t.device)
    batches = [Batch(rollout, list(range(N)), advantages, None)]
    optimizer = build_optimizer(param_groups(t.model, t.plan, cfg.optim.weight_decay), cfg.optim, args.device, masters=t.policy.take_masters())
    for group in optimizer.param_groups:
        group["lr"] = 0.0  # every update from the same weights: the modes' losses comparable
    scaler = t.policy.grad_scaler()
    health = GradHealth(t.model, t.plan, cfg.health, cfg.precision.mode, spikes=False)

    prompt_tokens = rollout.prompt_mask.sum(1).repeat_interleave(args.group)
    real = int(prompt_tokens.sum() + rollout.response_mask.sum())
    padded = sum(min(mb, N - s) * (rollout.prompt_ids.shape[1] + rollout.response_ids.shape[1])
                 for s in range(0, N, mb))  # the padded path's tokens over one pass of mini-batches
    modes = {"both": [False, True], "on": [True], "off": [False]}[args.packing]
    times = {m: [] for m in modes}
    peaks = {m: 0.0 for m in modes}
    rows = {}
    for rep in range(args.warmup + args.steps):
        for packing in modes:
            cfg.rl.packing = packing
            sync()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            rows[packing] = update(t, ref_model, batches, optimizer, scaler, health, cfg)
            sync()
            if rep >= args.warmup:
                times[packing].append(time.perf_counter() - start)
                peaks[packing] = max(peaks[packing], torch.cuda.max_memory_allocated() / 1e9 if cuda else 0.0)
    common = {"recipe": args.recipe, "method": cfg.tiers.method, "sequences": N, "mini_batch": mb,
              "kl_beta": cfg.rl.kl_beta, "grad_ckpt": cfg.activation_checkpointing.enabled,
              "compile": cfg.compile.enabled, "mixed": args.mixed, "max_new": args.max_new,
              "real_tokens": real, "padded_tokens": padded, "pad_fraction": 1 - real / padded,
              "response_len_mean": float(rollout.response_mask.sum(1).float().mean()),
              "gpu": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
              "transformers": __import__("transformers").__version__, "overrides": args.override}
    out = {}
    for packing in modes:
        seconds = statistics.median(times[packing])
        out[packing] = {**common, "packing": packing, "update_s": seconds, "update_s_all": times[packing],
                        "update_tokens_per_s": real / seconds, "peak_gb": peaks[packing],
                        "loss": rows[packing]["loss"], "entropy": rows[packing]["entropy"],
                        "kl": rows[packing].get("kl"), "grad_norm": rows[packing].get("grad_norm")}
        print(json.dumps(out[packing]))
    if len(modes) == 2:
        off, on = out[False], out[True]
        print(json.dumps({"summary": args.recipe, "speedup": off["update_s"] / on["update_s"],
                          "pad_fraction": common["pad_fraction"], "peak_gb_padded": off["peak_gb"],
                          "peak_gb_packed": on["peak_gb"], "loss_padded": off["loss"], "loss_packed": on["loss"],
                          "grad_norm_padded": off["grad_norm"], "grad_norm_packed": on["grad_norm"]}))
        print(f"| {args.recipe} | padded {off['update_tokens_per_s']:,.0f} tok/s, {off['peak_gb']:.1f} GB | "
              f"packed {on['update_tokens_per_s']:,.0f} tok/s, {on['peak_gb']:.1f} GB | "
              f"{off['update_s'] / on['update_s']:.2f}x | padding {common['pad_fraction']:.0%} |")


if __name__ == "__main__":
    main()
