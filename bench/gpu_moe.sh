#!/usr/bin/env bash
# One device call on Qwen3-VL-30B-A3B (random weights, one H200): the gpu tests of router replay and
# the packed paths, a GRPO step with fused expert LoRA recording its routes (moe/route_flip), the
# routing-flip bench with and without replay, and LoRA SFT through the fused expert path.
# Usage (CUDA machine, repo root): OUT=/some/dir bash bench/gpu_moe.sh
source "$(dirname "$0")/gpu_env.sh"
timeout 70 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_router_replay.py tests/test_grpo_packing.py \
  tests/test_packing.py 2>&1 | tail -3 > "$OUT/pytest.txt"
timeout 130 bash bench/gpu_grpo_smoke.sh qwen3vl-8b-grpo model.preset=qwen3vl-30b-a3b tiers.language.mlp=false \
  tiers.language.experts=true rollout.prompts_per_step=8 rollout.group_size=8 rollout.max_new_tokens=256 \
  rl.mini_batch_size=16 rollout.compile=false rollout.router_replay=record > "$OUT/grpo30.txt" 2>&1
timeout 100 python3 bench/moe_routing.py --repeats 2 > "$OUT/routing.jsonl" 2> "$OUT/routing.err"
timeout 100 python3 bench/sft_throughput.py --preset qwen3vl-30b-a3b --method lora --grad-ckpt --steps 4 --warmup 2 \
  2> "$OUT/sft.err" | tail -1 > "$OUT/sft30.jsonl"
