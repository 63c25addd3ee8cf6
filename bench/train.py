"""Training throughput of three paths on the same batches, in one process: plain transformers
(+peft), TRL's SFTTrainer, and vlforge. Prints a table and one JSON line per path.

    python bench/train.py --preset qwen3vl-2b --method full --steps 50
    python bench/train.py --preset qwen3vl-8b --method lora --steps 50 --ours compile.enabled=true
    python bench/train.py --preset qwen3vl-2b --method full --paths peer,ours,packed --json out.json
    python bench/train.py --preset qwen3vl-30b-a3b --method lora --paths peer,ours --grad-ckpt --steps 8
    python bench/train.py --preset qwen3vl-8b --method lora --lora-tiers three --paths peer,ours,packed
    python bench/train.py --preset qwen3vl-2b --method full --mixed --paths peer,ours,packed

Workload: shared/BASELINES.md's (sft_throughput.synthetic_samples: one 448x448 image, ~64 prompt
tokens, a 128-384-token answer; batch 8; or with `--mixed` answers of 8-1024 words and 1-4 images of 224-448 px,
where padding is ~36% and packing matters most), random weights of the published architecture, the same
initial weights for every path (one seed), bf16 autocast, fp32 master weights for full fine-tuning,
fused AdamW at one learning rate, gradient clipping at 1.0, no dropout. `packed` is our path on the
same micro-batches packed into one row each (data.packing); its FLOPs and tokens are the padded
batches' (the same samples), so its tokens/s and MFU compare directly. `graphs` is `packed` with
compile.cuda_graphs (each decoder layer replayed as CUDA graphs; rows padded up to a multiple of
256 tokens as the recipe pads them then, the filler counted as overhead); `graphs+vision` also replays
the vision blocks as CUDA graphs (compile.cuda_graphs_vision). LoRA: r=16, alpha=32 on the
language model's attention projections (the peer baseline's setup); with `--lora-tiers three` also on
the projector and the last two vision blocks' attention (three tiers; the peer's peft config adapts the
same modules, listed by our plan). Each path runs `--warmup`
untimed steps, then `--steps` timed ones over the same cycled batches, so their losses after N
steps compare (they must agree within bf16 noise; the table shows the spread). Ours is fed as the recipe
feeds it: a DataLoader whose workers compute the step's host inputs (train/inputs.HostPrep) and pin them;
the peer moves its batch to the device in the step, as transformers' own training loop does.

MFU = model FLOPs per second / the card's dense bf16 peak (train/throughput.PEAK_BF16_FLOPS). Model FLOPs
of a step (the same useful work for every path, whatever it computes beyond it) are what a run's
metrics count (train/throughput.step_flops): per matmul weight 2 per row forward, 2 for the gradient
through it, 2 more where it trains (~6N a token for full fine-tuning, ~4N for LoRA's frozen base);
lm_head on supervised tokens only; the vision tower per image patch; causal attention scores and
values; the adapters' own FLOPs left out.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import tempfile
import time

import torch
from PIL import Image

from vlforge.config import AttentionConfig, ModelConfig, SFTConfig, load_config
from vlforge.data.encode import Encoder, ImageLimits, SampleTokens, collate, encode, pack
from vlforge.train.health import GradHealth
from vlforge.train.inputs import HostPrep
from vlforge.train.optim import build_optimizer
from vlforge.train.runtime import resolve_num_workers
from vlforge.train.throughput import FlopWeights, peak_flops, step_flops
from vlforge.train.trainable import CUDA_GRAPH_ROW_MULTIPLE, setup_model
from vlforge.model.load import load_model, load_processor
from vlforge.model.presets import MOE_PRESETS
from vlforge.model.tiers import build_plan, param_groups
from vlforge.recipes.sft import train_step

from sft_throughput import Steps, synthetic_samples

PEAK_FLOPS = peak_flops(torch.device("cuda")) if torch.cuda.is_available() else None
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a smoke run with --preset tiny
LORA_TARGETS = r"model\.language_model\.layers\.\d+\.self_attn\.(q|k|v|o)_proj"


def model_flops(core, batches: list[dict]) -> list[float]:
    """Model FLOPs of one step on each batch (train/throughput.step_flops, as a run's metrics count them)."""
    weights = FlopWeights.of(core)
    return [step_flops(weights, [b]) for b in batches]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(steps: int, warmup: int, step_fn) -> tuple[list[float], list[float]]:
    losses, times = [], []
    for i in range(warmup + steps):
        sync()
        start = time.perf_counter()
        loss = step_fn(i)
        sync()
        losses.append(loss)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return losses, times


def run_peer(args, batches) -> dict:
    """What TRL/LLaMA-Factory run underneath: the HF forward with labels (full [B, T, V] logits),
    peft LoRA, fused AdamW."""
    lora = args.method == "lora"
    # the peer is plain transformers: its own per-image sdpa loop in the vision tower too
    model, _ = load_model(ModelConfig(preset=args.preset, seed=args.seed, attention=AttentionConfig(vision="sdpa")), dtype=torch.bfloat16 if lora else torch.float32,
                          device=DEVICE)
    if lora:
        from peft import LoraConfig, get_peft_model

        # MoE: the fused 3-D experts through peft's parameter targeting, as its docs show for MoE models
        experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] if args.preset in MOE_PRESETS else None
        # three tiers: the modules our plan adapts (build_plan over our tiers' settings), as one peft config
        targets = LORA_TARGETS if args.lora_tiers == "attention" else [
            e.module for e in build_plan(model, lora_tiers(args).tiers) if e.kind == "lora" and e.target == "module"]
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=targets,
                                                 target_parameters=experts))
    if args.grad_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, fused=DEVICE == "cuda")
    model.train()

    def step(i: int) -> float:
        b = {k: v.to(DEVICE) for k, v in batches[i % len(batches)].items()}
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            loss = model(**b).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    return {"model": model, "run": step}


def lora_tier_overrides(args) -> list[str]:
    """Our LoRA tiers: r=16, alpha=32, no dropout on the language model's attention (`attention`: the
    peer baseline's setup), or also on the projector and the last two vision blocks' attention (`three`)."""
    lora = ["r=16", "alpha=32", "dropout=0.0"]
    tiers = [f"tiers.language.{k}" for k in lora]
    tiers += ([f"tiers.{t}.{k}" for t in ("projector", "vision") for k in ["train=true", *lora]]
              if args.lora_tiers == "three" else ["tiers.projector.train=false", "tiers.vision.train=false"])
    return tiers + (["tiers.language.experts=true"] if args.preset in MOE_PRESETS else [])


def lora_tiers(args) -> SFTConfig:
    return load_config(SFTConfig, None, [f"model.preset={args.preset}", "tiers.method=lora", *lora_tier_overrides(args)])


GRAPHS = {"graphs": ("cuda_graphs",), "graphs+vision": ("cuda_graphs", "cuda_graphs_vision")}


MASTERS_IN_OPTIMIZER = "+mw"  # a path name's suffix: precision.master_weights=optimizer on that path


def run_ours(args, batches, packed: bool = False, graphs: tuple[str, ...] = (), extra: tuple[str, ...] = ()) -> dict:
    lora = args.method == "lora"
    tiers = lora_tier_overrides(args) if lora else ["tiers.vision.train=true"]
    tiers += ["activation_checkpointing.enabled=true"] if args.grad_ckpt else []
    cfg = load_config(SFTConfig, None, [
        f"model.preset={args.preset}", f"model.seed={args.seed}", f"tiers.method={args.method}", "precision.mode=bf16",
        f"train.device={DEVICE}", *tiers, *(f"tiers.{t}.lr={args.lr}" for t in ("language", "projector", "vision")),
        *(["data.packing=true"] if packed else []), *(f"precision.{g}=true" for g in graphs), *args.ours, *extra])
    t = setup_model(cfg)
    optimizer = build_optimizer(param_groups(t.model, t.plan, 0.0), cfg.optim, DEVICE, masters=t.policy.take_masters())
    scaler, health = t.policy.grad_scaler(), GradHealth(t.model, t.plan, cfg.health, cfg.precision.mode)

    # fed as the recipe feeds its steps (recipes/sft.py micro_batches): the step's host inputs (HostPrep) made
    # in the loader's worker processes and pinned by its pin_memory, so the step only queues copies
    workers = resolve_num_workers(cfg.data.num_workers, t.device)
    loader = iter(torch.utils.data.DataLoader(Steps(batches, args.warmup + args.steps), batch_size=None,
                                              num_workers=workers, collate_fn=HostPrep.of(t.model),
                                              pin_memory=DEVICE == "cuda"))

    def step(i: int) -> float:  # timed() calls it for i = 0, 1, ...: the loader's batch i % len(batches)
        return train_step(t, [next(loader)], optimizer, scaler, health, 1.0, cfg.loss)["loss"]

    return {"model": t.model, "run": step}


def run_trl(args, samples, n_steps: int) -> dict:
    """TRL's SFTTrainer on the same samples (its own collator, so its batches are its own)."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import SFTConfig as TRLConfig, SFTTrainer

    lora = args.method == "lora"
    model, processor = load_model(ModelConfig(preset=args.preset, seed=args.seed, attention=AttentionConfig(vision="sdpa")),
                                  dtype=torch.bfloat16 if lora else torch.float32, device=DEVICE)
    rows = [{"messages": [{"role": m["role"], "content": [{"type": "image"} if c.get("type") == "image" else c
                                                           for c in (m["content"] if isinstance(m["content"], list)
                                                                     else [{"type": "text", "text": m["content"]}])]}
                          for m in s.messages],
             "images": [Image.open(p).convert("RGB") for p in s.images]} for s in samples]
    times, losses, tokens = [], [], []

    class Clock(TrainerCallback):
        def on_step_begin(self, _args, state, *a, **k):
            sync()
            self.start, self.seen = time.perf_counter(), state.num_input_tokens_seen

        def on_step_end(self, _args, state, *a, **k):
            sync()
            times.append(time.perf_counter() - self.start)
            tokens.append(state.num_input_tokens_seen - self.seen)  # its own batches' non-pad tokens

        def on_log(self, _args, _state, _control, logs=None, **k):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS)
    with tempfile.TemporaryDirectory() as out:
        cfg = TRLConfig(output_dir=out, max_steps=n_steps, per_device_train_batch_size=args.batch, learning_rate=args.lr,
                        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, bf16=DEVICE == "cuda", use_cpu=DEVICE == "cpu",
                        logging_steps=1, report_to=[], save_strategy="no", optim="adamw_torch_fused" if DEVICE == "cuda" else "adamw_torch",
                        dataloader_num_workers=0, max_length=None, seed=args.seed, remove_unused_columns=False,
                        include_num_input_tokens_seen="non_padding")
        trainer = SFTTrainer(model=model, args=cfg, train_dataset=Dataset.from_list(rows), processing_class=processor,
                             peft_config=peft_config, callbacks=[Clock()])
        if DEVICE == "cuda":
            torch.cuda.reset_peak_memory_stats()
        trainer.train()
    return {"losses": losses, "times": times[args.warmup:], "tokens": tokens[args.warmup:]}


def summarize(name: str, losses, times, tokens_per_step, flops_per_step, args) -> dict:
    n = len(times)
    return {"path": name, "preset": args.preset, "method": args.method, "batch": args.batch, "timed_steps": n,
            "tokens_per_s": sum(tokens_per_step[:n]) / sum(times) if tokens_per_step else None,
            "step_s": sum(times) / n, "step_median_s": statistics.median(times),
            "step_max_s": max(times), "mfu": sum(flops_per_step[:n]) / sum(times) / PEAK_FLOPS if flops_per_step and PEAK_FLOPS else None,
            "peak_gb": torch.cuda.max_memory_allocated() / 1e9 if DEVICE == "cuda" else None, "loss_first": losses[0],
            "loss_last5": sum(losses[-5:]) / len(losses[-5:]), "losses": losses}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3vl-2b")
    ap.add_argument("--method", default="full", choices=["full", "lora"])
    ap.add_argument("--paths", default="peer,trl,ours,packed", help="peer, trl, ours, packed (ours with data.packing), "
                    "graphs (packed with compile.cuda_graphs), graphs+vision (and cuda_graphs_vision); ours and its variants "
                    "+mw: with precision.master_weights=optimizer; a path may repeat (alternating runs in one process)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--lr", type=float, default=None, help="default: 1e-5 full, 1e-4 LoRA")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--image", type=int, default=448, help="image side in pixels")
    ap.add_argument("--ours", nargs="*", default=[], help="vlforge config overrides for our path")
    ap.add_argument("--json", help="write all results (with per-step losses) here")
    ap.add_argument("--grad-ckpt", action="store_true", help="activation checkpointing on the peer and our paths")
    ap.add_argument("--mixed", action="store_true", help="the mixed set: answers of 8-1024 words, 1-4 images of "
                    "224-448 px per sample (sft_throughput.synthetic_samples)")
    ap.add_argument("--lora-tiers", default="attention", choices=["attention", "three"],
                    help="LoRA on the language model's attention, or also on the projector and the last 2 vision "
                         "blocks' attention (the same modules for the peer's peft config)")
    args = ap.parse_args()
    args.lr = args.lr or (1e-4 if args.method == "lora" else 1e-5)
    if unknown := [name for name in args.paths.split(",")
                   if name.removesuffix(MASTERS_IN_OPTIMIZER) not in ("peer", "trl", "ours", "packed", *GRAPHS)
                   or name in ("peer+mw", "trl+mw")]:
        ap.error(f"unknown path(s) {', '.join(unknown)}: peer, trl, ours, packed, graphs, graphs+vision; ours and "
                 "its variants may end in +mw (precision.master_weights=optimizer)")
    torch.backends.cuda.matmul.allow_tf32 = True

    encoder = Encoder(load_processor(ModelConfig(preset=args.preset)), ImageLimits(3136, args.image * args.image))
    tmp = tempfile.TemporaryDirectory()
    samples = synthetic_samples(args.samples, tmp.name, args.image, random.Random(0), mixed=args.mixed)
    items = []
    for s in samples:
        ids = encoder.token_ids(s.messages, [Image.open(p).size for p in s.images])
        items.append(encode(encoder, s, SampleTokens(ids, encoder.assistant_labels(ids), len(ids))))
    batches = [collate(items[i:i + args.batch], encoder.pad_id) for i in range(0, len(items), args.batch)]
    # the same samples per micro-batch, each batch's samples back to back in one row (data.packing)
    packed = [pack(items[i:i + args.batch], encoder.pad_id) for i in range(0, len(items), args.batch)]
    graph_rows = [pack(items[i:i + args.batch], encoder.pad_id, multiple=CUDA_GRAPH_ROW_MULTIPLE)
                  for i in range(0, len(items), args.batch)]
    total = args.warmup + args.steps
    order = [batches[i % len(batches)] for i in range(args.warmup, total)]
    tokens = [int(b["attention_mask"].sum()) for b in order]

    results = []
    for name in args.paths.split(","):
        torch.manual_seed(args.seed)
        if DEVICE == "cuda":
            torch.cuda.reset_peak_memory_stats()
        try:
            if name == "trl":
                r = run_trl(args, samples, total)
                # TRL builds its own batches (same samples, its collator and order): its own token counts
                results.append(summarize(name, r["losses"], r["times"], r["tokens"], None, args))
            else:
                base = name.removesuffix(MASTERS_IN_OPTIMIZER)
                # explicit either way (auto would pick optimizer for a full GPU run): the +mw A/B stays an A/B
                extra = (("precision.master_weights=optimizer",) if base != name else () if any(
                    "master_weights" in o for o in args.ours) else ("precision.master_weights=fp32",))
                path = (run_peer(args, batches) if name == "peer" else run_ours(args, batches, extra=extra)
                        if base == "ours" else run_ours(args, packed, packed=True, extra=extra) if base == "packed" else
                        run_ours(args, graph_rows, packed=True, graphs=GRAPHS[base], extra=extra))
                losses, times = timed(args.steps, args.warmup, path["run"])
                from vlforge.model.tiers import unwrap

                flops = model_flops(unwrap(path["model"]), order)
                results.append(summarize(name, losses, times, tokens, flops, args))
                del path
        except Exception as e:  # a path that cannot run is reported, and the others still run
            results.append({"path": name, "error": f"{type(e).__name__}: {e}"[:2000]})
        gc.collect()
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        print(json.dumps({k: v for k, v in results[-1].items() if k != "losses"}), flush=True)

    print("\n| path | tokens/s | step | MFU | peak GB | loss first -> last 5 |\n| --- | --- | --- | --- | --- | --- |")
    for r in results:
        if "error" in r:
            print(f"| {r['path']} | error: {r['error'][:120]} | | | | |")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] else "-"
        print(f"| {r['path']} | {r['tokens_per_s']:,.0f} | {r['step_s']:.3f} s | {mfu} | {r['peak_gb'] or 0:.1f} | "
              f"{r['loss_first']:.4f} -> {r['loss_last5']:.4f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "torch": torch.__version__,
                       "transformers": __import__("transformers").__version__, "results": results}, f)


if __name__ == "__main__":
    main()
