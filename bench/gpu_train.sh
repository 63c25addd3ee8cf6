#!/usr/bin/env bash
# One device call for the training-throughput issue: bench/train.py's paths (plain transformers +
# peft, TRL's SFTTrainer, ours padded and packed) on the same batches, 2B full and 8B LoRA, and
# our compiled path. TRL and liger-kernel come as wheels in .whl/train (carry .whl/train).
# Usage (CUDA machine, repo root): OUT=/some/dir bash bench/gpu_train.sh [STEPS]
source "$(dirname "$0")/gpu_env.sh"
steps=${1:-30}
cd bench
python3 train.py --preset qwen3vl-2b --method full --steps $steps --json $OUT/train-2b-full.json 2>$OUT/err-2b.txt | grep -v '^{' 
python3 train.py --preset qwen3vl-2b --method full --steps $steps --paths ours,packed --ours compile.enabled=true \
  --json $OUT/train-2b-full-compiled.json 2>$OUT/err-2bc.txt | grep -v '^{'
python3 train.py --preset qwen3vl-8b --method lora --steps $steps --paths peer,ours,packed,trl \
  --json $OUT/train-8b-lora.json 2>$OUT/err-8b.txt | grep -v '^{'
