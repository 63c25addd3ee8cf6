#!/usr/bin/env bash
# Quantized inference on the GPU machine: demo-model answer agreement (bf16 vs nf4/fp8/int8),
# 8B weights/peak memory, prefill latency and decode speed per method, and a QLoRA smoke run.
# Usage from the repo root: OUT=/some/dir DEMO=path/to/demo-sft DATA=path/to/val.jsonl bash bench/gpu_quant.sh
set -uo pipefail
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/vlforge-quant}; mkdir -p "$OUT"
python3 bench/quant_agreement.py "$DEMO" "$DATA" --quant nf4 fp8 int8 2>"$OUT/agreement.err" | tee "$OUT/agreement.jsonl"
tail -3 "$OUT/agreement.err"
timeout 420 python3 bench/quant_inference.py --preset qwen3vl-8b --quant none nf4 fp8 int8 2>"$OUT/infer8b.err" \
  | tee "$OUT/infer8b.jsonl"
tail -3 "$OUT/infer8b.err"
python3 -m vlforge data synth shapes --n 40 --out /tmp/sh448 --size 448 --val-fraction 0.1 >/dev/null
timeout 150 python3 -m vlforge sft configs/qwen3vl-8b-lora.yaml quant.language=nf4 data.train=/tmp/sh448/train.jsonl \
  train.output_dir=/tmp/qlora8b train.max_steps=3 train.batch_size=4 train.grad_accum=1 log.every=1 \
  log.progress=false data.num_workers=0 2>&1 | grep -v Warning | tail -4 | tee "$OUT/qlora8b.txt"
cp /tmp/qlora8b/metrics.jsonl "$OUT/qlora8b_metrics.jsonl" 2>/dev/null
