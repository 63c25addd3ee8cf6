#!/usr/bin/env bash
# The measurements the third session built for but could not run (device time spent), one group per
# device call (each fits 10 min). Results: $OUT/*.jsonl, $OUT/*.txt; record them in docs/benchmarks.md.
#   OUT=/some/dir GROUP=tests bash bench/gpu_pending.sh  # gpu tests never run on a GPU, then 2B packed vs padded
#   OUT=/some/dir GROUP=pack  bash bench/gpu_pending.sh  # the mixed set (36% padding) by a token budget
#   OUT=/some/dir GROUP=liger bash bench/gpu_pending.sh  # liger's chunks at loss.chunk_size: 2B full, 8B LoRA, chunked
#   OUT=/some/dir GROUP=final bash bench/gpu_pending.sh  # 2B full peer vs ours same process; 8B LoRA chunked; mixed set again
#   OUT=/some/dir GROUP=moe   bash bench/gpu_pending.sh  # 30B-A3B: peft peer vs ours same process; NF4 memory/decode
#   OUT=/some/dir GROUP=mem   bash bench/gpu_pending.sh  # selective checkpointing and the activation memory budget
#   OUT=/some/dir GROUP=loader bash .whl/wt-loader/bench/gpu_pending.sh  # main vs the loader branch, one call:
#       step inputs made in the DataLoader's workers (HostPrep) and pinned by its pin_memory. Before the call:
#       rsync -a --delete /work/main/vlforge/ /work/main/.whl/presync/vlforge/        (A: main)
#       rsync -a --delete /work/wt-loader/vlforge/ /work/main/.whl/wt-loader/vlforge/ (B: the branch)
#       rsync -a --delete /work/wt-loader/bench/ /work/main/.whl/wt-loader/bench/     (this script, both run it)
#       carry [".whl/presync", ".whl/wt-loader"]; runs.jsonl rows name the vlforge they imported ("vlforge")
# (carry .whl/train, and .whl/ao (torchao) for GROUP=tests, .whl/bnb (bitsandbytes) for moe and mem)
source "$(dirname "$0")/gpu_env.sh"
for w in .whl/ao/*.whl .whl/bnb/*.whl; do [ -f "$w" ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$w"; done
GROUP=${GROUP:-tests}
r() { n=$1; shift; echo "+ $*" >&2; timeout ${LIMIT:-110} python3 bench/sft_throughput.py "$@" 2>"$OUT/err-$GROUP-$n.txt" | tail -1 \
      | sed "s/^{/{\"group\": \"$GROUP\", \"run\": $n, /" >> "$OUT/runs.jsonl" || echo "run $n failed" >> "$OUT/fail.txt"; }
case $GROUP in
  tests) timeout 150 python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_packing.py tests/test_router_replay.py \
           tests/test_grpo_packing.py tests/test_generate.py --tb=short > "$OUT/pytest.txt" 2>&1
         b="--preset qwen3vl-2b --method full --steps 8 --warmup 5"
         r 1 $b --override precision.compile=false
         r 2 $b --packing --override precision.compile=false
         r 3 $b --packing --override precision.compile=true
         r 4 $b --override precision.compile=true ;;
  pack)  timeout 150 python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_packing.py tests/test_router_replay.py \
           tests/test_grpo_packing.py tests/test_generate.py --tb=short > "$OUT/pytest.txt" 2>&1
         b="--preset qwen3vl-2b --method full --steps 8 --warmup 5 --override precision.compile=true"
         r 7 $b --profile "$OUT/profile-padded.txt"
         TORCH_LOGS=graph_breaks,recompiles r 8 $b --packing --profile "$OUT/profile-packed.txt"
         m="--preset qwen3vl-2b --method full --mixed --max-tokens-per-batch 16384 --steps 8 --warmup 5 --override precision.compile=true"
         r 5 $m
         r 6 $m --packing ;;
  liger) timeout 100 python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_router_replay.py tests/test_losses.py \
           --tb=short > "$OUT/pytest.txt" 2>&1
         b="--preset qwen3vl-2b --method full --steps 8 --warmup 5 --override precision.compile=true"
         r 9 $b
         r 10 $b --packing
         r 11 $b loss.impl=chunked
         r 12 --preset qwen3vl-8b --method lora --steps 8 --warmup 5 --override precision.compile=true ;;
  final) (cd bench && timeout 230 python3 train.py --preset qwen3vl-2b --method full --paths peer,ours,packed --steps 12 \
           --samples 32 --ours precision.compile=true 2>"$OUT/err-train2b.txt" | tail -6 > "$OUT/train2b.txt")
         r 13 --preset qwen3vl-8b --method lora --steps 8 --warmup 5 --override precision.compile=true loss.impl=chunked
         m="--preset qwen3vl-2b --method full --mixed --max-tokens-per-batch 16384 --steps 8 --warmup 5 --override precision.compile=true"
         r 14 $m
         r 15 $m --packing ;;
  moe) timeout 300 python3 bench/train.py --preset qwen3vl-30b-a3b --method lora --paths peer,ours --grad-ckpt --steps 6 \
         --samples 32 2>"$OUT/err-train.txt" | tail -8 > "$OUT/train30.txt"
       timeout 250 python3 bench/quant_inference.py --preset qwen3vl-30b-a3b --quant none nf4 --tmp /dev/shm \
         > "$OUT/quant30.jsonl" 2>"$OUT/err-quant.txt" ;;
  mem) b="--preset qwen3vl-8b --method full --steps 6 --warmup 3 --override optim.name=adamw8bit"
       r 1 $b precision.gradient_checkpointing=true
       r 2 $b precision.gradient_checkpointing=true precision.checkpoint_every=2
       r 3 $b precision.compile=true precision.activation_memory_budget=0.5
       r 4 $b precision.compile=true ;;
  loader) # A = main's vlforge, B = the branch's, by PYTHONPATH order (gpu_env.sh puts the repo root last); the
          # branch's bench script for both (it feeds the steps through a DataLoader as the recipe does; main's
          # vlforge has no HostPrep, so A's workers only hand over the batches, as main's recipe's). A then B
          # per workload, same process settings. Last: B with 0 workers (host inputs on the main thread, as the
          # reverted sync branch measured 0.87x), if the call's 10 minutes leave time for it.
          ab() { n=$1 tree=$2; shift 2; echo "+ [$tree] $*" >&2; PYTHONPATH=.whl/$tree:$PYTHONPATH timeout ${LIMIT:-110} \
                 python3 "$(dirname "$0")/sft_throughput.py" "$@" 2>"$OUT/err-$GROUP-$n.txt" | tail -1 \
                 | sed "s/^{/{\"group\": \"$GROUP\", \"run\": $n, \"tree\": \"$tree\", /" >> "$OUT/runs.jsonl" \
                 || echo "run $n failed" >> "$OUT/fail.txt"; }
          b="--preset qwen3vl-2b --method full --steps 8 --warmup 5 --override precision.compile=true"
          l="--preset qwen3vl-8b --method lora --steps 8 --warmup 5 --override precision.compile=true"
          ab 1 presync $b; ab 2 wt-loader $b
          ab 3 presync $l; ab 4 wt-loader $l
          ab 5 wt-loader $b --workers 0 ;;
  *) echo "GROUP must be tests, pack, liger, final, moe, mem or loader"; exit 2 ;;
esac
