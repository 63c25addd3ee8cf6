#!/usr/bin/env bash
# The shipped GRPO recipes on random real-size weights for 2 steps each (wiring, not speed); the
# reward is swapped for one with variance (random weights never answer correctly), so updates run.
# Usage (CUDA machine, repo root): OUT=/some/dir bash bench/gpu_grpo_smoke.sh [RECIPE [overrides...]]
#   e.g. bash bench/gpu_grpo_smoke.sh qwen3vl-8b-grpo quant.language=nf4        (QLoRA GRPO)
#        bash bench/gpu_grpo_smoke.sh qwen3vl-2b-grpo precision.fp8.enabled=true (FP8 GRPO)
# Without arguments: both shipped GRPO recipes as they are. STACKS=20 samples each run's main-thread
# Python stack every 20 s into $OUT/RECIPE-stacks.txt (bench/stacks.py). Files back: 3 per recipe
# (log, metrics, stacks) + names.txt + fail.txt (a device call returns at most 8).
set -uo pipefail
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/vlforge-gpu}; mkdir -p "$OUT"
[ -f /tmp/sh448/train.jsonl ] || python3 -m vlforge data synth shapes --n 72 --out /tmp/sh448 --size 448 --val-fraction 0.12
recipes=${1:-qwen3vl-8b-grpo qwen3vl-2b-grpo}; shift $(( $# > 0 ? 1 : 0 ))
for recipe in $recipes; do
  name=$recipe${1:+-$(echo "$*" | md5sum | cut -c1-8)}  # overrides hashed: a name, not a path too long to copy
  echo "$name: $*" >> "$OUT/names.txt"
  # LIMIT seconds per recipe (a run past it is stopped, and its finished steps' metrics still come back)
  run="python3 -m vlforge"; [ -n "${STACKS:-}" ] && run="python3 bench/stacks.py $OUT/$name-stacks.txt $STACKS vlforge"
  timeout ${LIMIT:-900} $run grpo configs/$recipe.yaml data.train=/tmp/sh448/train.jsonl \
    data.val=/tmp/sh448/val.jsonl train.output_dir=/tmp/$name train.max_steps=2 rollout.prompts_per_step=4 \
    rollout.group_size=4 rollout.max_new_tokens=32 rl.mini_batch_size=8 eval.max_samples=8 eval.max_new_tokens=8 \
    log.progress=false "rl.rewards=[{name: bench/varied_reward.py:length_mod3}]" rl.dynamic_sampling=false \
    train.overwrite=true "$@" > "$OUT/$name.log" 2>&1 || echo "$name: exit $?" >> "$OUT/fail.txt"
  grep -v Warning "$OUT/$name.log" | tail -4
  cp /tmp/$name/metrics.jsonl "$OUT/$name-metrics.jsonl" 2>/dev/null || echo "$name: no metrics.jsonl" >> "$OUT/fail.txt"
done
