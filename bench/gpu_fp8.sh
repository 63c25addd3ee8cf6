#!/usr/bin/env bash
# FP8 (torchao) vs bf16 SFT on the published 2B / 8B architectures: tokens/s, peak memory and
# 200-step loss curves on the same synthetic data (bench/sft_throughput.py --curve).
# Usage on a CUDA machine, from the repo root:  OUT=/some/dir bash bench/gpu_fp8.sh tests|2b|8b-bf16|8b-fp8|8b-lora
set -uo pipefail
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/vlforge-fp8}; mkdir -p "$OUT"
LR="tiers.language.lr=1e-4 tiers.projector.lr=1e-4 tiers.vision.lr=1e-4"
run() {  # name, args...
  local name=$1; shift
  python3 bench/sft_throughput.py --curve "$OUT/$name.json" "$@" 2>"$OUT/$name.err" | tail -1 | tee -a "$OUT/fp8.jsonl"
  tail -3 "$OUT/$name.err"
}
case "${1:-2b}" in
  tests)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
    python3 -m vlforge doctor --json > "$OUT/doctor.json"; echo "doctor exit $?"
    python3 -m vlforge doctor --config configs/qwen3vl-8b-fp8.yaml | tail -6
    python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests/test_fp8.py tests/test_precision.py \
      tests/test_health.py tests/test_doctor.py 2>&1 | tail -4 | tee "$OUT/pytest.txt"
    ;;
  2b)
    run 2b_bf16_eager --preset qwen3vl-2b --method full --steps 30 --samples 64 --override $LR compile.enabled=false
    run 2b_bf16 --preset qwen3vl-2b --method full --steps 200 --samples 256 --override $LR compile.enabled=true
    run 2b_fp8 --preset qwen3vl-2b --method full --steps 200 --samples 256 --override $LR precision.fp8.enabled=true
    ;;
  # 8B full does not fit with fp32 master weights + AdamW (16 bytes/param): bf16 masters for both
  8b-bf16)
    run 8b_bf16 --preset qwen3vl-8b --method full --steps 200 --samples 256 --override $LR \
      precision.master_weights=compute compile.enabled=true
    ;;
  8b-fp8)
    run 8b_fp8 --preset qwen3vl-8b --method full --steps 200 --samples 256 --override $LR \
      precision.master_weights=compute precision.fp8.enabled=true
    ;;
  8b-lora)
    run 8b_lora_bf16 --preset qwen3vl-8b --method lora --steps 30 --samples 64 --override compile.enabled=true
    run 8b_lora_fp8 --preset qwen3vl-8b --method lora --steps 30 --samples 64 --override precision.fp8.enabled=true
    ;;
esac
