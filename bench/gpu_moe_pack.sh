#!/usr/bin/env bash
# One device call: Qwen3-VL-30B-A3B LoRA (attention + experts) SFT, packing with flex_attention at a
# fixed row length (compiled) vs padded, 8B LoRA compiled, and FSDP2's reshard_after_forward on one GPU.
# Usage (CUDA machine, repo root): OUT=/some/dir bash bench/gpu_moe_pack.sh
source "$(dirname "$0")/gpu_env.sh"
n=0
run() { n=$((n+1)); echo "+ $*" >&2; timeout ${LIMIT:-240} python3 bench/sft_throughput.py "$@" 2>"$OUT/err$n.txt" | tail -1 \
        | tee -a "$OUT/runs.jsonl" || { echo "run $n failed: $*"; grep -v -i warn "$OUT/err$n.txt" | tail -4; }; }
run --preset qwen3vl-30b-a3b --method lora --grad-ckpt --steps 4 --warmup 2
run --preset qwen3vl-2b --method full --max-tokens-per-batch 4608 --steps 8 --override compile.enabled=true
run --preset qwen3vl-2b --method full --max-tokens-per-batch 4608 --packing --steps 8 \
    --override compile.enabled=true model.attention.implementation=flex_attention
run --preset qwen3vl-8b --method lora --steps 8 --override compile.enabled=true
# run --preset qwen3vl-2b --method full --fsdp --steps 6 --warmup 2
# run --preset qwen3vl-2b --method full --fsdp --steps 6 --warmup 2 --override distributed.reshard_after_forward=false
