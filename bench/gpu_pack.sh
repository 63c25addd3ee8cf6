#!/usr/bin/env bash
# (model.packed_attention=mask was removed since: the runs naming it stop with the config error saying why)
# Packed rows: padded vs packed with transformers' dense block-diagonal mask (model.packed_attention=mask,
# the path measured slower than padding) vs packed with our per-sample attention (train/packed_attention.py:
# torch's varlen_attn), eager and compiled, the same samples (--seed 0) in every run; plus the mixed-length
# set (answers 8-1024 tokens, 1-4 images) by a token budget. One group per device call (each fits 10 min):
#   OUT=/some/dir GROUP=2b bash bench/gpu_pack.sh      # 2B full: 6 runs
#   OUT=/some/dir GROUP=8b bash bench/gpu_pack.sh      # 8B LoRA r=16 attention: 6 runs
#   OUT=/some/dir GROUP=mixed bash bench/gpu_pack.sh   # 2B full, --mixed, 16384-token budget, compiled: 3 runs
# First, in the same call: python3 -m pytest -q -m gpu tests/test_packing.py (varlen bf16 parity; it also
# fails if this torch's varlen_attn is missing or unusable, in which case the "ours" runs measure the
# per-sample SDPA fallback). Each run prints one JSON line (tokens/s, step, peak memory) to runs.jsonl.
source "$(dirname "$0")/gpu_env.sh"
GROUP=${GROUP:-2b}
n=0
run() { n=$((n+1)); echo "+ $*" >&2; timeout ${LIMIT:-150} python3 bench/sft_throughput.py "$@" 2>"$OUT/err-$GROUP-$n.txt" | tail -1 \
        | sed "s/^{/{\"group\": \"$GROUP\", \"run\": $n, /" | tee -a "$OUT/runs.jsonl" \
        || { echo "run $n failed: $*"; grep -v -i warn "$OUT/err-$GROUP-$n.txt" | tail -4; }; }
case $GROUP in
  2b) for c in compile.enabled=false compile.enabled=true; do
        run --preset qwen3vl-2b --method full --steps 8 --override $c
        run --preset qwen3vl-2b --method full --steps 8 --packing --override $c model.packed_attention=mask
        run --preset qwen3vl-2b --method full --steps 8 --packing --override $c
      done ;;
  8b) for c in compile.enabled=false compile.enabled=true; do
        run --preset qwen3vl-8b --method lora --steps 8 --override $c
        run --preset qwen3vl-8b --method lora --steps 8 --packing --override $c model.packed_attention=mask
        run --preset qwen3vl-8b --method lora --steps 8 --packing --override $c
      done ;;
  mixed) m="--preset qwen3vl-2b --method full --mixed --max-tokens-per-batch 16384 --steps 8"
        run $m --override compile.enabled=true
        run $m --packing --override compile.enabled=true model.packed_attention=mask
        run $m --packing --override compile.enabled=true ;;
  *) echo "GROUP must be 2b, 8b or mixed"; exit 2 ;;
esac
