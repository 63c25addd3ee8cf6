#!/usr/bin/env bash
# One device call for the one-GPU scale questions of the distributed issue: what FSDP2 costs on one
# process (resharding after forward or not), FSDP2 + CPU offload of the 4B architecture's full
# fine-tuning, and LoRA on the 32B architecture on one H200.
# Usage (CUDA machine, repo root): OUT=/some/dir bash bench/gpu_scale.sh
set -uo pipefail
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/vlforge-gpu}; mkdir -p "$OUT"
run() { echo "+ $*" >&2; python3 bench/sft_throughput.py "$@" 2>"$OUT/last.err" | tail -1 | tee -a "$OUT/scale.jsonl" \
        || tail -5 "$OUT/last.err"; }
run --preset qwen3vl-2b --method full --steps 6 --warmup 2
run --preset qwen3vl-2b --method full --fsdp --steps 6 --warmup 2
run --preset qwen3vl-2b --method full --fsdp --steps 6 --warmup 2 --override distributed.reshard_after_forward=false
run --preset qwen3vl-4b --method full --fsdp --steps 2 --warmup 1 --override distributed.cpu_offload=true
run --preset qwen3vl-32b --method lora --grad-ckpt --steps 3 --warmup 1
