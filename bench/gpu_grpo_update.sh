#!/usr/bin/env bash
# GRPO's update with padded vs packed log-prob forwards (rl.packing), the shipped recipes on their
# presets' random weights, one rollout of 8 x 8 responses of 8-1024 tokens (15% at the cap). One group
# per device call (each fits 10 min):
#   OUT=/some/dir GROUP=2b bash bench/gpu_grpo_update.sh     # qwen3vl-2b-grpo (full, KL to a frozen copy), + compiled
#   OUT=/some/dir GROUP=8b bash bench/gpu_grpo_update.sh     # qwen3vl-8b-grpo (LoRA, adapter-disabled reference)
# First, in the same call: the gpu-marked parity test (varlen_attn in bf16, packed == padded). Each run
# prints a JSON line per mode and a summary line (speed-up, padding share, loss both ways) to runs.jsonl.
source "$(dirname "$0")/gpu_env.sh"
GROUP=${GROUP:-2b}
python3 -m pytest -q -m gpu tests/test_grpo_packing.py -p no:cacheprovider 2>&1 | tail -3 | tee "$OUT/pytest-$GROUP.txt"
n=0
run() { n=$((n+1)); echo "+ $*" >&2; timeout ${LIMIT:-240} python3 bench/grpo_update.py "$@" 2>"$OUT/err-$GROUP-$n.txt" \
        | grep '^[{|]' | sed "s/^{/{\"group\": \"$GROUP\", \"run\": $n, /" | tee -a "$OUT/runs.jsonl" \
        || { echo "run $n failed: $*"; grep -v -i warn "$OUT/err-$GROUP-$n.txt" | tail -4; }; }
case $GROUP in
  2b) run --recipe qwen3vl-2b-grpo
      run --recipe qwen3vl-2b-grpo --override compile.enabled=true ;;
  8b) run --recipe qwen3vl-8b-grpo ;;
  *) echo "GROUP must be 2b or 8b"; exit 2 ;;
esac
