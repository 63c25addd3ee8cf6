#!/usr/bin/env bash
# One device call: the CPU test suite under the GPU machine's library versions, the shipped 8B
# LoRA recipe for a few steps on random weights, and the SFT throughput benchmarks.
# Usage (on a CUDA machine, from the repo root): OUT=/some/dir bash bench/gpu_session.sh
set -uo pipefail
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/vlforge-gpu}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers, peft; print(torch.__version__, transformers.__version__, peft.__version__)" | tee -a "$OUT/gpu.txt"
python3 -m pytest -q -x -p no:cacheprovider 2>&1 | tail -5 | tee "$OUT/pytest.txt"
python3 -m vlforge data synth shapes --n 72 --out /tmp/sh448 --size 448 --val-fraction 0.12
python3 -m vlforge sft configs/qwen3vl-8b-lora.yaml data.train=/tmp/sh448/train.jsonl data.val=/tmp/sh448/val.jsonl \
  train.output_dir=/tmp/run8b train.max_steps=8 train.save_every=4 train.batch_size=4 eval.max_samples=8 \
  eval.max_new_tokens=8 log.every=1 log.progress=false 2>&1 | tail -20 | tee "$OUT/sft8b.txt"
cp /tmp/run8b/metrics.jsonl "$OUT/sft8b_metrics.jsonl"; ls -la /tmp/run8b /tmp/run8b/checkpoint-8 >> "$OUT/sft8b.txt"
for args in "--preset qwen3vl-2b --method full" "--preset qwen3vl-8b --method lora" "--preset qwen3vl-2b --method full --grad-ckpt"; do
  python3 bench/sft_throughput.py $args 2>&1 | tail -1 | tee -a "$OUT/bench.jsonl"
done
