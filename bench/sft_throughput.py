"""SFT step throughput, peak memory and the loss curve on the workload of shared/BASELINES.md.

    python bench/sft_throughput.py --preset qwen3vl-2b --method full
    python bench/sft_throughput.py --preset qwen3vl-8b --method lora
    python bench/sft_throughput.py --preset qwen3vl-2b --method full --fsdp        # FSDP2, world size 1
    python bench/sft_throughput.py --preset qwen3vl-8b --method full --grad-ckpt --override optim.name=adamw8bit
    python bench/sft_throughput.py --preset qwen3vl-8b --method full --steps 200 --curve fp8.json \
        --override precision.fp8.enabled=true precision.master_weights=compute
    python bench/sft_throughput.py --preset qwen3vl-2b --method full --packing          # same batches, packed
    python bench/sft_throughput.py --preset qwen3vl-2b --method full --mixed --max-tokens-per-batch 16384 [--packing]
    python bench/sft_throughput.py ... --packing --override model.attention.implementation=flex_attention loss.impl=plain
    python bench/sft_throughput.py --preset qwen3vl-30b-a3b --method lora --grad-ckpt     # MoE: LoRA attention + experts
    python bench/sft_throughput.py --preset qwen3vl-30b-a3b --method lora --grad-ckpt --override model.experts_implementation=eager
    python bench/sft_throughput.py --preset qwen3vl-30b-a3b --method lora --grad-ckpt --expert-lora peft   # peft's folding path

MoE presets (qwen3vl-30b-a3b, qwen3vl-235b-a22b) with --method lora train LoRA on attention and on
the fused experts (tiers.language.experts=true), router frozen; the experts run with
model.experts_implementation (auto: grouped_mm on CUDA). Expert LoRA runs fused (as activations in
the experts' GEMMs, model/moe_lora.py) unless --expert-lora peft (peft's ParamWrapper, which folds
the update into a copy of each layer's experts; without gradient checkpointing every layer's copy
stays alive until backward: --plan shows it).

Each sample: one 448x448 image (196 image tokens), ~64 prompt tokens, an answer of 128-384
tokens; batch 8, random weights of the published architecture. `--mixed`: answers of 8-1024
tokens and 1-4 images of 224-448 px per sample (where padding costs most). `--packing`: each
micro-batch's samples in one row (data.packing); `--max-tokens-per-batch`: micro-batches by that
token budget instead of --batch samples (data.max_tokens_per_batch), packed or padded. The
samples are the same with and without --packing (--seed), and with --batch alone so are the
batches. Uses the real recipe pieces (setup_model, the dataset encoder, collate/pack, the
batch sampler, train_step). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import time
from pathlib import Path

import torch
from PIL import Image

from vlforge.config import SFTConfig, load_config
from vlforge.data.dataset import budget_batches
from vlforge.data.encode import Encoder, ImageLimits, SampleTokens, VideoLimits, collate, encode, pack
from vlforge.data.jsonl import Sample
from vlforge.data.video import Video
from vlforge.train.distributed import init_world
from vlforge.train.fp8 import summarize
from vlforge.train.health import GradHealth
from vlforge.train.inputs import count_tokens
from vlforge.train.runtime import resolve_num_workers
from vlforge.train.optim import build_optimizer
from vlforge.model.presets import MOE_PRESETS
from vlforge.model.tiers import param_groups
from vlforge.train.trainable import setup_model
from vlforge.recipes.sft import train_step

try:  # the loader-side step inputs; an older vlforge (an A/B's baseline, bench/gpu_pending.sh) has none
    from vlforge.train.inputs import HostPrep
except ImportError:
    HostPrep = None

WORDS = "the a red blue green circle square triangle left right shape image colour how many is on of".split()
# Answers follow a fixed random bigram chain (each word has three likely successors), so a loss
# curve has structure to learn beyond word frequencies: FP8 vs bf16 curves compare learning.
_chain = random.Random(1234)
SUCCESSORS = {w: _chain.sample(WORDS, 3) for w in WORDS}


def write_trace(prof, path: str) -> None:
    """The profile's timeline (chrome://tracing or perfetto), gzipped: host gaps show there, not in tables."""
    import gzip
    import os

    raw = path[:-3] + ".tmp"
    prof.export_chrome_trace(raw)
    with open(raw, "rb") as src, gzip.open(path, "wb") as dst:
        dst.write(src.read())
    os.remove(raw)


def markov_answer(rng: random.Random, n_words: int) -> str:
    words = [rng.choice(WORDS)]
    for _ in range(n_words - 1):
        words.append(rng.choices(SUCCESSORS[words[-1]], weights=(6, 3, 1))[0])
    return " ".join(words)


def synthetic_samples(n: int, tmp: str, image_side: int, rng: random.Random, mixed: bool = False,
                      video_frames: int = 0) -> list[Sample]:
    """BASELINES.md's samples, or (mixed) answers of 8-1024 words and 1-4 images of 224-448 px, or
    (video_frames) one video of that many frames of image_side px (a frame list at 2 fps) instead
    of the image."""
    samples = []
    for i in range(n):
        sides = [rng.choice((224, 336, 448)) for _ in range(rng.randint(1, 4))] if mixed else [image_side]
        if video_frames:
            sides = [image_side] * video_frames
        paths = []
        for k, side in enumerate(sides):
            paths.append(Path(f"{tmp}/img{i}_{k}.png"))
            Image.frombytes("RGB", (side, side), rng.randbytes(side * side * 3)).save(paths[-1])
        prompt = " ".join(rng.choice(WORDS) for _ in range(60))
        answer = markov_answer(rng, rng.randint(8, 1024) if mixed else rng.randint(128, 384))
        video = Video(tuple(paths), len(paths), 2.0, (image_side, image_side)) if video_frames else None
        visual = [{"type": "video", "video": video}] if video else [{"type": "image", "image": str(p)} for p in paths]
        user = [*visual, {"type": "text", "text": prompt}]
        samples.append(Sample([{"role": "user", "content": user}, {"role": "assistant", "content": answer}],
                              [] if video else paths, f"synthetic:{i}", videos=[video] if video else []))
    return samples


class Steps(torch.utils.data.Dataset):
    """Step i's micro-batch: the prebuilt batches, cycled (a map-style dataset for the DataLoader)."""

    def __init__(self, batches: list[dict], steps: int):
        self.batches, self.steps = batches, steps

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, step: int) -> dict:
        # fresh tensors, as the recipe's collate makes: a worker sending the same tensor objects again moves
        # their storage into shared memory once and then shares it with every later step (seen once: a
        # worker's mm_token_type_ids held token ids at an 8B run's 13th step)
        return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in self.batches[step % len(self.batches)].items()}


def as_is(batch: dict) -> dict:  # the loader's collate without HostPrep (module level: picklable)
    return batch


class WithLibrarySyncs:
    """HostPrep without the image token positions and the padding flag (model/host_inputs.Placeholders,
    causal_padding_mask): transformers finds both on the device again, with its syncs (the A/B of
    --library-syncs). Module level: the loader's workers pickle it."""

    def __init__(self, prepare):
        self.prepare = prepare

    def __call__(self, batch: dict) -> dict:
        out = self.prepare(batch)
        out["host_inputs"] = {k: v for k, v in out["host_inputs"].items() if k not in ("placeholders", "padding")}
        return out


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
    ap.add_argument("--packing", action="store_true", help="one row per micro-batch, no padding (data.packing)")
    ap.add_argument("--max-tokens-per-batch", type=int, help="micro-batches by token budget (data.max_tokens_per_batch)")
    ap.add_argument("--mixed", action="store_true", help="answers of 8-1024 tokens, 1-4 images per sample")
    ap.add_argument("--video", type=int, default=0, metavar="FRAMES",
                    help="one video of FRAMES frames of --image px per sample instead of the image (each 2 frames one "
                         "temporal patch of --image px: FRAMES/2 times the image's tokens)")
    ap.add_argument("--native-video", action="store_true", help="A/B with --video: the batches in transformers' own "
                    "video form (pixel_values_videos: two tower calls, transformers' placeholder masks) instead of "
                    "the videos shown as images (data/encode.frames_as_images, the recipe's form)")
    ap.add_argument("--seed", type=int, default=0, help="the synthetic samples (and the budget batches' order)")
    ap.add_argument("--profile", help="after the timed steps, profile 2 more (torch.profiler) and write the "
                    "top operators by GPU time and by CPU time to this text file")
    ap.add_argument("--library-syncs", action="store_true", help="A/B: transformers' own image-token masks and "
                    "padding check (device reads) instead of the host's (model/host_inputs.py)")
    ap.add_argument("--foreach-clip", action="store_true", help="A/B: clip the gradients with a foreach multiply "
                    "before the optimizer step instead of inside fused AdamW (train/health.clips_in_optimizer)")
    ap.add_argument("--layer-compile-mode", help="experiment: torch.compile the language model's decoder layers "
                    "with this mode (e.g. reduce-overhead: CUDA graphs of each layer's forward and backward; a step "
                    "begins with torch.compiler.cudagraph_mark_step_begin()); vision blocks as the recipe compiles them")
    ap.add_argument("--layer-compile-options", help="experiment: inductor options for the decoder layers' "
                    "torch.compile, k=v[,k=v] (e.g. cpp_wrapper=1: kernels launched from generated C++, not Python)")
    ap.add_argument("--skip-guards", action="store_true", help="experiment: after the warmup steps, "
                    "torch.compiler.set_stance(skip_guard_eval_unsafe=True) (no guard evaluation per compiled call)")
    ap.add_argument("--expert-lora", choices=["fused", "peft"], default="fused", help="MoE: tiers.expert_lora")
    ap.add_argument("--workers", type=int, help="DataLoader workers feeding the steps (default: data.num_workers, "
                    "auto as the recipe); 0: the loader runs on the main thread")
    args = ap.parse_args()

    vision = "tiers.vision.train=false" if args.method == "lora" else "tiers.vision.train=true"
    cfg = load_config(SFTConfig, None, [
        f"model.preset={args.preset}", f"tiers.method={args.method}", "precision.mode=bf16", "train.device=cuda",
        f"activation_checkpointing.enabled={str(args.grad_ckpt).lower()}", vision,
        # the peer baseline trains LoRA on LM attention only
        *(["tiers.projector.train=false", "tiers.language.r=16", "tiers.language.alpha=32"] if args.method == "lora" else []),
        *(["tiers.language.experts=true"] if args.method == "lora" and args.preset in MOE_PRESETS else []),
        f"tiers.expert_lora={args.expert_lora}", *args.override])
    torch.backends.cuda.matmul.allow_tf32 = True
    if args.fsdp:
        cfg.distributed.strategy = "fsdp2"
    if args.layer_compile_mode or args.layer_compile_options:
        import vlforge.train.trainable as trainable
        from vlforge.model.tiers import unwrap

        def compile_layers(model, vision: bool = False, **graphs) -> int:  # compile_decoder_layers, another mode
            core = unwrap(model).model
            options = {k: {"true": True, "false": False}.get(v, int(v) if v.isdigit() else v) for k, v in
                       (kv.split("=") for kv in args.layer_compile_options.split(","))} if args.layer_compile_options else None
            for layer in core.language_model.layers:
                layer.compile(mode=args.layer_compile_mode, options=options)
            for block in core.visual.blocks if vision else []:
                block.compile()
            return len(core.language_model.layers) + (len(core.visual.blocks) if vision else 0)

        trainable.compile_decoder_layers = compile_layers
    t = setup_model(cfg, world=init_world(cfg.distributed, cfg.train.device))
    frames = max(args.video, 2)  # every frame at --image px: the budget is over all of a video's frames
    encoder = Encoder(t.processor, ImageLimits(3136, args.image * args.image),
                      VideoLimits(max_frames=frames, min_pixels=3136, max_pixels=frames * args.image * args.image))
    import tempfile

    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        samples = synthetic_samples(args.samples, tmp, args.image, rng, mixed=args.mixed, video_frames=args.video)
        items = []
        for s in samples:
            ids = encoder.token_ids(s.messages, [Image.open(p).size for p in s.images], videos=s.videos)
            items.append(encode(encoder, s, SampleTokens(ids, encoder.assistant_labels(ids), len(ids)),
                                videos_as_images=not args.native_video))
    if args.max_tokens_per_batch:  # the recipe's sampler (epoch 0's order)
        index_lists = [ix for ix, _ in budget_batches([len(x["input_ids"]) for x in items], args.max_tokens_per_batch,
                                                      args.packing, args.seed, 0, multiple=t.token_multiple)]
    else:
        index_lists = [list(range(i, min(i + args.batch, len(items)))) for i in range(0, len(items), args.batch)]
    # flex_attention compiles per shape: packed rows of one length (the recipe does the same)
    pad_to = (args.max_tokens_per_batch // t.token_multiple * t.token_multiple if args.packing
              and args.max_tokens_per_batch and cfg.model.attention.implementation == "flex_attention" else None)
    batches = [pack([items[i] for i in ix], encoder.pad_id, multiple=t.token_multiple, pad_to=pad_to) if args.packing
               else collate([items[i] for i in ix], encoder.pad_id, multiple=t.token_multiple) for ix in index_lists]
    optimizer = build_optimizer(param_groups(t.model, t.plan, 0.0), cfg.optim, "cuda", masters=t.policy.take_masters())
    scaler = t.policy.grad_scaler()
    health = GradHealth(t.model, t.plan, cfg.health, cfg.precision.mode)
    # as the recipe's loader (recipes/sft.py micro_batches): HostPrep in the workers, pinned by pin_memory
    workers = resolve_num_workers(cfg.data.num_workers, t.device) if args.workers is None else args.workers
    prepare = HostPrep.of(t.model) if HostPrep is not None else None
    if args.library_syncs:
        prepare = WithLibrarySyncs(prepare)
    if args.foreach_clip:
        import vlforge.train.health as health_module

        health_module.clips_in_optimizer = lambda optimizer, scaler: False
    loader = iter(torch.utils.data.DataLoader(Steps(batches, args.warmup + args.steps), batch_size=None,
                                              num_workers=workers, collate_fn=prepare or as_is,
                                              pin_memory=prepare is not None))
    torch.cuda.reset_peak_memory_stats()
    times, tokens, losses = [], [], []
    for step in range(args.warmup + args.steps):
        if args.skip_guards and step == args.warmup:
            torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        batch = next(loader)  # timed: a loader that does not keep up shows in tokens/s
        if args.layer_compile_mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()  # the step's graphs may overwrite the last step's outputs
        out = train_step(t, [batch], optimizer, scaler, health, 1.0, cfg.loss)
        torch.cuda.synchronize()
        losses.append(out["loss"])
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
            tokens.append(out["tokens"])
    step_s = sum(times) / len(times)
    if args.profile:  # where a step's time goes (not part of the timed steps above)
        from torch.profiler import ProfilerActivity, profile
        # fed as the timed steps were (HostPrep in the loader's workers, pinned): the main thread's work only
        profiled = list(torch.utils.data.DataLoader(Steps(batches, 2), batch_size=None, num_workers=workers,
                                                    collate_fn=prepare or as_is, pin_memory=prepare is not None))
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for batch in profiled:
                if args.layer_compile_mode == "reduce-overhead":
                    torch.compiler.cudagraph_mark_step_begin()
                train_step(t, [batch], optimizer, scaler, health, 1.0, cfg.loss)
            torch.cuda.synchronize()
        table = prof.key_averages()
        with open(args.profile, "w") as f:
            f.write(table.table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=60))
            f.write(table.table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))
            f.write(table.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=60))
            # the kernels themselves (self device time): which non-GEMM kernels the GPU's time goes to
            f.write(table.table(sort_by="self_cuda_time_total", row_limit=120, max_name_column_width=110))
        write_trace(prof, args.profile + ".trace.json.gz")
    pad_fraction = 1 - sum(count_tokens(b) for b in batches) / sum(b["input_ids"].numel() for b in batches)
    result = {
        "preset": args.preset, "method": args.method, "batch": args.batch, "grad_ckpt": args.grad_ckpt,
        "packing": args.packing, "max_tokens_per_batch": args.max_tokens_per_batch, "mixed": args.mixed,
        "video_frames": args.video, "native_video": args.native_video, "micro_batches": len(batches), "rows_mean": sum(len(b["input_ids"]) for b in batches) / len(batches),
        "row_tokens_mean": sum(b["input_ids"].numel() for b in batches) / len(batches),
        "attn": cfg.model.attention.implementation, "loss_impl": cfg.loss.impl,
        "strategy": t.world.strategy, "optim": cfg.optim.name, "workers": workers, "library_syncs": args.library_syncs,
        "foreach_clip": args.foreach_clip, "layer_compile_mode": args.layer_compile_mode,
        "layer_compile_options": args.layer_compile_options, "skip_guards": args.skip_guards,
        "host_prep": prepare is not None, "vlforge": __import__("vlforge").__file__,
        "tokens_per_s": sum(tokens) / sum(times), "step_s": step_s,
        "peak_gb": torch.cuda.max_memory_allocated() / 1e9, "pad_fraction": pad_fraction,
        # the process's peak resident host memory (Linux reports KiB): with cpu_offload, where the sharded
        # parameters, gradients and optimizer state live (it includes loading the model)
        "host_peak_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9,
        "seq_len_mean": sum(len(x["input_ids"]) for x in items) / len(items),
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "transformers": __import__("transformers").__version__, "overrides": args.override,
        "loss_first": losses[0], "loss_last10": sum(losses[-10:]) / len(losses[-10:]),
        "fp8": summarize(t.fp8_plan) if t.fp8_plan else None,
        # MoE: the expert kernels and the last step's expert load (train/moe.py)
        "experts_implementation": getattr(getattr(t.model.config, "text_config", None), "_experts_implementation", None),
        "expert_lora": cfg.tiers.expert_lora if cfg.tiers.language.experts else None,
        **{k: v for k, v in out.items() if k.startswith("moe/")},
    }
    if args.curve:
        with open(args.curve, "w") as f:
            json.dump({**result, "losses": losses, "step_times": times}, f)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
