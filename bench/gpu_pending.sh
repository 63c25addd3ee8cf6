#!/usr/bin/env bash
# Groups of GPU measurements, one group a device call (each fits its 10 minutes), named where
# docs/benchmarks.md and docs/benchmarks-log.md cite a number: OUT=/some/dir GROUP=<group> bash bench/gpu_pending.sh
# Results land in $OUT (*.jsonl, *.txt); at most 8 files come back from a device call, so archive a group's
# files with `tar czf $OUT/all.tgz -C <dir> .` (<dir> outside $OUT) when it writes more.
#   OUT=/some/dir GROUP=moe   bash bench/gpu_pending.sh  # 30B-A3B: peft peer vs ours same process; NF4 memory/decode
#   OUT=/some/dir GROUP=mem   bash bench/gpu_pending.sh  # selective checkpointing and the activation memory budget
# (carry .whl/train, and .whl/ao (torchao) for GROUP=tests and q25, .whl/bnb (bitsandbytes) for moe, mem and q25)
source "$(dirname "$0")/gpu_env.sh"
for w in .whl/ao/*.whl .whl/bnb/*.whl; do
  [ -f "$w" ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$w" \
    && case :${PYTHONPATH:-}: in *:/tmp/site:*) ;; *) export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/site ;; esac
done
GROUP=${GROUP:-tests}
r() { n=$1; shift; echo "+ $*" >&2; timeout ${LIMIT:-110} python3 bench/sft_throughput.py "$@" 2>"$OUT/err-$GROUP-$n.txt" | tail -1 \
      | sed "s/^{/{\"group\": \"$GROUP\", \"run\": $n, /" >> "$OUT/runs.jsonl" || echo "run $n failed" >> "$OUT/fail.txt"; }
case $GROUP in
  tests) timeout 150 python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_packing.py tests/test_router_replay.py \
           tests/test_grpo_packing.py tests/test_generate.py --tb=short > "$OUT/pytest.txt" 2>&1
         b="--preset qwen3vl-2b --method full --steps 8 --warmup 5"
         r 1 $b --override compile.enabled=false
         r 2 $b --packing --override compile.enabled=false
         r 3 $b --packing --override compile.enabled=true
         r 4 $b --override compile.enabled=true ;;
  pack)  timeout 150 python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_packing.py tests/test_router_replay.py \
           tests/test_grpo_packing.py tests/test_generate.py --tb=short > "$OUT/pytest.txt" 2>&1
         b="--preset qwen3vl-2b --method full --steps 8 --warmup 5 --override compile.enabled=true"
         r 7 $b --profile "$OUT/profile-padded.txt"
         TORCH_LOGS=graph_breaks,recompiles r 8 $b --packing --profile "$OUT/profile-packed.txt"
         m="--preset qwen3vl-2b --method full --mixed --max-tokens-per-batch 16384 --steps 8 --warmup 5 --override compile.enabled=true"
         r 5 $m
         r 6 $m --packing ;;
  liger) timeout 100 python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_router_replay.py tests/test_losses.py \
           --tb=short > "$OUT/pytest.txt" 2>&1
         b="--preset qwen3vl-2b --method full --steps 8 --warmup 5 --override compile.enabled=true"
         r 9 $b
         r 10 $b --packing
         r 11 $b loss.impl=chunked
         r 12 --preset qwen3vl-8b --method lora --steps 8 --warmup 5 --override compile.enabled=true ;;
  final) (cd bench && timeout 230 python3 train.py --preset qwen3vl-2b --method full --paths peer,ours,packed --steps 12 \
           --samples 32 --ours compile.enabled=true 2>"$OUT/err-train2b.txt" | tail -6 > "$OUT/train2b.txt")
         r 13 --preset qwen3vl-8b --method lora --steps 8 --warmup 5 --override compile.enabled=true loss.impl=chunked
         m="--preset qwen3vl-2b --method full --mixed --max-tokens-per-batch 16384 --steps 8 --warmup 5 --override compile.enabled=true"
         r 14 $m
         r 15 $m --packing ;;
  fsdp1) b="--preset qwen3vl-2b --method full --steps 10 --warmup 4"
         r 1 $b --override compile.enabled=false
         r 2 $b --fsdp --override compile.enabled=false
         r 3 $b --fsdp --override compile.enabled=false distributed.reshard_after_forward=false
         r 4 $b --override compile.enabled=true
         r 5 $b --fsdp --override compile.enabled=true ;;
  fsdpgen) LIMIT=100 GROUP=fsdp1 bash "$0"
         (cd bench && timeout 200 python3 generate.py --preset qwen3vl-2b --paths vlforge --cases mixed,tail \
           --out "$OUT/gen-2b.jsonl" 2>"$OUT/err-gen.txt") ;;
  serve2) timeout 330 python3 bench/serve_load.py --preset qwen3vl-2b --requests 2 --serve-arg=--compile \
           --out "$OUT/serve-compiled.json" > /dev/null 2>"$OUT/err-s1.txt"
          timeout 220 python3 bench/serve_load.py --preset qwen3vl-2b --requests 1 --clients 32 --serve-arg "--engine hf" \
           --out "$OUT/serve-old32.json" > /dev/null 2>"$OUT/err-s2.txt" ;;
  fp8prof) b="--preset qwen3vl-8b --method full --steps 6 --warmup 6 --override precision.master_weights=compute"
           r 1 $b compile.enabled=true --profile "$OUT/prof-8b-bf16.txt"
           r 2 $b precision.fp8.enabled=true --profile "$OUT/prof-8b-fp8.txt" ;;
  fp8b) b="--preset qwen3vl-8b --method full --batch 16 --steps 6 --warmup 6 --override precision.master_weights=compute"
        r 1 $b compile.enabled=true
        r 2 $b precision.fp8.enabled=true
        r 3 $b precision.fp8.enabled=true precision.fp8.recipe=rowwise ;;
  gen6f) b="--preset qwen3vl-2b --method full --steps 10 --warmup 4 --override compile.enabled=false"
         r 1 $b; r 2 $b --fsdp; r 3 $b; r 4 $b --fsdp  # issue 10's <= 10%: plain and FSDP2 eager, twice, one call
         (cd bench && timeout 240 python3 generate.py --preset qwen3vl-2b --paths vlforge --cases mixed \
           --out "$OUT/gen-2b.jsonl" 2>"$OUT/err-gen.txt") ;;
  gen7)  timeout 150 python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_generate.py --tb=short \
           > "$OUT/pytest.txt" 2>&1  # GroupCache (share_prompt) vs SlotCache: 2B, hf-static beside
         (cd bench && timeout 400 python3 generate.py --preset qwen3vl-2b --paths vlforge,vlforge-noshare,hf-static \
           --cases 64x256 --out "$OUT/gen-2b.jsonl" 2>"$OUT/err-gen.txt") ;;
  gen8)  (cd bench && timeout 540 python3 generate.py --preset qwen3vl-8b --paths vlforge,vlforge-noshare \
           --cases 64x256 --out "$OUT/gen-8b.jsonl" 2>"$OUT/err-gen.txt") ;;
  prof12) b="--preset qwen3vl-2b --method full --steps 6 --warmup 3 --override compile.enabled=false"
         r 1 $b --profile "$OUT/prof-plain.txt"; r 2 $b --fsdp --profile "$OUT/prof-fsdp.txt"  # issue 10: host time
         (cd bench && timeout 330 python3 generate.py --preset qwen3vl-2b --paths vlforge,hf-static --cases 64x256 \
           --profile "$OUT/prof-gen.txt" --out "$OUT/gen-2b.jsonl" 2>"$OUT/err-gen.txt") ;;  # issue 11: the prefill
  fsdp8s) b="--preset qwen3vl-2b --method full --steps 8 --warmup 3 --override compile.enabled=false"
         LIMIT=75; r 1 $b; r 2 $b --fsdp; r 3 $b; r 4 $b --fsdp  # FSDP2 world 1: local-shard AdamW, bf16 "reduce"
         (cd bench && timeout 320 python3 generate.py --preset qwen3vl-8b --paths vlforge,hf-static --cases 64x256 \
           --out "$OUT/gen-8b.jsonl" 2>"$OUT/err-gen.txt") ;;  # issue 11: 8B against hf-static in one process
  attn12) timeout 120 python3 bench/grouped_attention.py > "$OUT/attn-2b.jsonl" 2>"$OUT/err-attn.txt"
          timeout 120 python3 bench/grouped_attention.py --q-heads 32 --kv-heads 8 > "$OUT/attn-8b.jsonl" 2>>"$OUT/err-attn.txt"
          [ -n "${GEN2B:-}" ] && (cd bench && timeout 260 python3 generate.py --preset qwen3vl-2b --paths vlforge,hf-static \
            --cases 64x256 --out "$OUT/gen-2b.jsonl" 2>"$OUT/err-gen.txt") ;;  # GEN2B=1: 2B vs hf-static again
  mask13) [ "${PRESET:-qwen3vl-2b}" = qwen3vl-2b ] && timeout 200 python3 -m pytest -q -rs -m gpu -p no:cacheprovider \
            tests/test_generate.py -k "cuda_graph" --tb=short > "$OUT/pytest.txt" 2>&1
          (cd bench && timeout ${LIMIT:-380} python3 generate.py --preset ${PRESET:-qwen3vl-2b} \
            --paths vlforge,vision,hf-static --cases 64x256 --profile "$OUT/prof-gen.txt" \
            --out "$OUT/gen.jsonl" 2>"$OUT/err-gen.txt") ;;  # issue 11: the additive step mask, A/B in one process
  vis13) timeout 200 python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_vision_attention.py tests/test_packing.py \
           tests/test_generate.py -k "vision or varlen or cuda_graph_grouped" --tb=short > "$OUT/pytest.txt" 2>&1
         b="--preset qwen3vl-2b --method full --steps 8 --warmup 4 --override compile.enabled=true"
         LIMIT=110; r 1 $b model.attention.vision=sdpa; r 2 $b; r 3 $b compile.vision=true
         (cd bench && timeout 200 python3 generate.py --preset qwen3vl-2b --paths vlforge,vision,vision-sdpa --cases 64x256 \
           --out "$OUT/gen.jsonl" 2>"$OUT/err-gen.txt") ;;  # the vision tower in one varlen call: training and the prefill
  vis13b) (cd bench && timeout 260 python3 train.py --preset qwen3vl-2b --method full --paths peer,ours,packed --steps 12 \
            --samples 32 --ours compile.enabled=true compile.vision=true 2>"$OUT/err-train2b.txt" \
            | tail -6 > "$OUT/train2b.txt")  # issue 13: peer vs ours with compiled vision blocks, same process
          b="--preset qwen3vl-2b --method full --steps 8 --warmup 4 --override compile.enabled=true"
          LIMIT=100; r 1 $b compile.vision=true; r 2 $b; r 3 $b model.attention.vision=sdpa ;;  # vis13 reversed
  fsdp14) b="--preset qwen3vl-2b --method full --steps 8 --warmup 3 --fsdp --override compile.enabled=false"
         LIMIT=80; r 1 ${b/--fsdp/}  # FSDP2 world 1 with K decoder layers / vision blocks a unit, no sharding around
         for k in 1 4 2 8; do r $((k + 1)) $b distributed.layers_per_unit=$k; done; r 99 ${b/--fsdp/} ;;
  offload14) LIMIT=240 r 1 --preset qwen3vl-4b --method full --fsdp --steps 3 --warmup 1 \
           --override distributed.cpu_offload=true  # issue 10 (a): tokens/s, GPU and host peak (host_peak_gb)
         GROUP=fsdp14 LIMIT=80 bash "$0" ;;  # then FSDP2 world 1 through distributed.layers_per_unit
  fuse14) [ "${PRESET:-qwen3vl-2b}" = qwen3vl-2b ] && timeout 150 python3 -m pytest -q -rs -m gpu -p no:cacheprovider \
           tests/test_fused.py tests/test_generate.py --tb=short > "$OUT/pytest.txt" 2>&1
         (cd bench && timeout ${LIMIT:-330} python3 generate.py --preset ${PRESET:-qwen3vl-2b} \
           --paths ${PATHS:-vlforge,vlforge-unfused,hf-static} --cases 64x256 --out "$OUT/gen.jsonl" 2>"$OUT/err-gen.txt") ;;
  gen13) (cd bench && timeout ${LIMIT:-200} python3 generate.py --preset ${PRESET:-qwen3vl-2b} --paths vlforge,hf-static --cases 64x256 \
           --out "$OUT/gen.jsonl" 2>"$OUT/err-gen.txt") ;;  # issue 11: the prefill with varlen vision and host-cast pixels
  prof15) b="--preset qwen3vl-2b --method full --steps 6 --warmup 3 --override compile.enabled=true"
          LIMIT=150; r 1 $b --profile "$OUT/prof-2b.txt"  # issue 13: where the compiled 2B step's 0.19 s goes
          LIMIT=240; r 2 --preset qwen3vl-8b --method lora --steps 6 --warmup 3 --override compile.enabled=true \
            --profile "$OUT/prof-8b-lora.txt"  # and the 8B LoRA step's 0.36 s
          find "$OUT" -empty -delete ;;  # at most 8 files come back from a device call
  host15) b="--preset qwen3vl-2b --method full --steps 8 --warmup 4 --override compile.enabled=true"
          # issue 13: prof15 found the compiled 2B step ~30% GPU-idle (host-bound vision tower and backward): is it the
          # loader's threads, inductor's Python wrapper (cpp_wrapper) or launches (CUDA graphs of each compiled block)?
          LIMIT=120; r 1 $b; TORCHINDUCTOR_CUDAGRAPHS=1 TORCH_LOGS=perf_hints LIMIT=150 r 2 $b
          TORCHINDUCTOR_CPP_WRAPPER=1 LIMIT=150 r 3 $b; LIMIT=80 r 4 $b --workers 0; LIMIT=80 r 5 $b
          for f in "$OUT"/err-*.txt; do echo "== $f"; tail -c 6000 "$f"; done > "$OUT/errors.txt"; rm -f "$OUT"/err-*.txt ;;
  sync15) b="--preset qwen3vl-2b --method full --steps 8 --warmup 4 --override compile.enabled=true"
          # issue 13: the image-token positions and the padding flag read on the host (no library syncs left in a
          # padded step) vs transformers' device reads (--library-syncs), alternating; then peer vs ours, one process
          LIMIT=120; r 1 $b; r 2 $b --library-syncs; r 3 $b; r 4 $b --library-syncs
          (cd bench && timeout 260 python3 train.py --preset qwen3vl-2b --method full --paths peer,ours,packed --steps 12 \
            --samples 32 --ours compile.enabled=true 2>"$OUT/err-train2b.txt" | tail -6 > "$OUT/train2b.txt")
          LIMIT=100; r 5 ${b/--steps 8/--steps 4} --profile "$OUT/prof-2b.txt"  # the GPU's idle share now
          for f in "$OUT"/err-*.txt; do echo "== $f"; tail -c 3000 "$f"; done > "$OUT/errors.txt"; rm -f "$OUT"/err-*.txt ;;
  sync15b) (cd bench && timeout 200 python3 train.py --preset qwen3vl-2b --method full --paths peer,ours,packed --steps 12 \
            --samples 32 --ours compile.enabled=true 2>"$OUT/err-train2b.txt" | tail -6 > "$OUT/train2b.txt")
          # issue 13: peer vs ours with ours fed by the recipe's loader (HostPrep in workers); then the sync A/B again
          b="--preset qwen3vl-2b --method full --steps 8 --warmup 4 --override compile.enabled=true"
          LIMIT=70; r 1 $b --library-syncs; r 2 $b
          for f in "$OUT"/err-*.txt; do echo "== $f"; tail -c 3000 "$f"; done > "$OUT/errors.txt"; rm -f "$OUT"/err-*.txt ;;
  next16) b="--preset qwen3vl-2b --method full --steps 8 --warmup 4 --override compile.enabled=true"
          # issue 13: the clip inside fused AdamW vs a foreach multiply (alternating),
          # then 8B three-tier LoRA (language attention + projector + last 2 vision blocks) peer vs ours
          LIMIT=80; r 1 $b --foreach-clip; r 2 $b; r 3 $b --foreach-clip; r 4 $b
          LIMIT=150; r 5 $b --layer-compile-mode reduce-overhead  # CUDA graphs of the decoder layers only: works?
          (cd bench && timeout 330 python3 train.py --preset qwen3vl-8b --method lora --lora-tiers three \
            --paths peer,ours,packed --steps 10 --samples 32 --ours compile.enabled=true 2>"$OUT/err-8b.txt" \
            | tail -6 > "$OUT/train8b.txt")
          for f in "$OUT"/err-*.txt; do echo "== $f"; tail -c 3000 "$f"; done > "$OUT/errors.txt"; rm -f "$OUT"/err-*.txt ;;
  host16) b="--preset qwen3vl-2b --method full --steps 8 --warmup 4 --override compile.enabled=true"
          # issue 13: the compiled 2B step's host work per region: guards skipped after the
          # warmup, kernels launched from inductor's C++ wrapper (decoder layers; the vision blocks' varlen call
          # cannot), alternating with the plain compiled step; then where the 8B three-tier LoRA packed step goes
          LIMIT=90; r 1 $b; r 2 $b --skip-guards
          LIMIT=180; r 3 $b --layer-compile-options cpp_wrapper=1
          LIMIT=90; r 4 $b
          t="tiers.language.dropout=0.0 tiers.projector.train=true tiers.vision.train=true"
          for k in r=16 alpha=32 dropout=0.0; do t="$t tiers.projector.$k tiers.vision.$k"; done
          LIMIT=170; r 5 --preset qwen3vl-8b --method lora --packing --steps 6 --warmup 3 --override \
            compile.enabled=true $t --profile "$OUT/prof-8b.txt"
          for f in "$OUT"/err-*.txt; do echo "== $f"; tail -c 3000 "$f"; done > "$OUT/errors.txt"; rm -f "$OUT"/err-*.txt ;;
  full16) # issue 13: 2B full peer vs ours padded and packed (same process, ours fed by the recipe's loader), then
          # inductor's C++ wrapper for the decoder layers (host16's try passed an int where torch wants a bool)
          (cd bench && timeout 240 python3 train.py --preset qwen3vl-2b --method full --paths peer,ours,packed --steps 12 \
            --samples 32 --ours compile.enabled=true 2>"$OUT/err-train2b.txt" | tail -6 > "$OUT/train2b.txt")
          b="--preset qwen3vl-2b --method full --steps 8 --warmup 4 --override compile.enabled=true"
          LIMIT=150; r 1 $b --layer-compile-options cpp_wrapper=true
          for f in "$OUT"/err-*.txt; do echo "== $f"; tail -c 3000 "$f"; done > "$OUT/errors.txt"; rm -f "$OUT"/err-*.txt ;;
  ratio18) # issue 13: peer vs ours with 5 warmup steps (the 4 batches' shapes, so the compiled paths' one recompile for
          # a new length lands before the timing: group17's first compiled path ran 28% slower than its repeat), each path
          # twice, alternating; then 8B three-tier LoRA the same way; TORCH_LOGS=recompiles shows where recompiles fell
          (cd bench && TORCH_LOGS=recompiles timeout 260 python3 train.py --preset qwen3vl-2b --method full --steps 12 --warmup 5 \
            --samples 32 --paths peer,ours,packed,peer,ours,packed --ours compile.enabled=true --json "$OUT/full2b.json" \
            2>"$OUT/err-2b.txt" | tail -9 > "$OUT/full2b.txt")
          (cd bench && TORCH_LOGS=recompiles timeout 290 python3 train.py --preset qwen3vl-8b --method lora --lora-tiers three \
            --steps 10 --warmup 5 --samples 32 --paths peer,ours,packed --ours compile.enabled=true --json "$OUT/lora8b.json" \
            2>"$OUT/err-8b.txt" | tail -6 > "$OUT/lora8b.txt") ;;
  recipes18) # the shipped SFT recipes as users run them, 3 steps each on synthetic 448x448 shapes: data.packing=auto
          # must say "packed rows"; each run's directory removed after it (the 8B FP8 checkpoint alone is ~50 GB of the
          # 64 GB disk: final18 filled it). Carry .whl/ao for the FP8 recipe
          [ -f /tmp/sh448/train.jsonl ] || python3 -m vlforge data synth shapes --n 72 --out /tmp/sh448 --size 448 --val-fraction 0.12
          for c in qwen3vl-8b-fp8 qwen3vl-8b-lora qwen3vl-2b-full; do
            timeout 150 python3 -m vlforge sft configs/$c.yaml data.train=/tmp/sh448/train.jsonl data.val=null eval.every=0 \
              train.output_dir=/tmp/$c train.max_steps=3 log.progress=false train.overwrite=true > "$OUT/$c.log" 2>&1 \
              || echo "$c: exit $?" >> "$OUT/fail.txt"
            ls -la /tmp/$c >> "$OUT/$c.log"; tail -2 /tmp/$c/metrics.jsonl >> "$OUT/$c.log"; rm -rf /tmp/$c
          done ;;
  mixed19) # the mixed set (1-4 images a sample) after the image-bounds fix (compiled vision blocks hit torch's recompile
          # limit in final18b); each of ours twice; recompiles logged; then the gpu tests of the vision attention
          (cd bench && TORCH_LOGS=recompiles timeout 330 python3 train.py --preset qwen3vl-2b --method full --mixed --steps 10 \
            --warmup 5 --samples 32 --paths peer,ours,packed,ours,packed --ours compile.enabled=true --json "$OUT/mixed2b.json" \
            2>"$OUT/err-mixed.txt" | tail -8 > "$OUT/mixed2b.txt")
          timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_vision_attention.py tests/test_packing.py \
            --tb=short > "$OUT/pytest.txt" 2>&1 ;;
  prof19) # where the 2B packed compiled step's GPU time goes, kernel by kernel (issue 13: the ~149 ms of GPU work is
          # ~62 ms of GEMMs; which of the rest could be less?): the profile's per-kernel table, and its timeline
          b="--preset qwen3vl-2b --method full --steps 8 --warmup 5 --override compile.enabled=true"
          r 1 $b --packing --profile "$OUT/prof-2b-packed.txt" ;;
  cg19)  # CUDA graphs of each decoder layer (cudagraph trees, mode reduce-overhead) on packed rows, 2B full: four row
          # lengths cycle, so each layer records four graphs in the 12 warmup steps; alternating with the shipped compile
          b="--preset qwen3vl-2b --method full --packing --steps 8 --warmup 12 --override compile.enabled=true"
          r 1 $b
          TORCH_LOGS=perf_hints,recompiles r 2 $b --layer-compile-mode reduce-overhead
          r 3 $b
          r 4 $b --layer-compile-mode reduce-overhead --profile "$OUT/prof-cg.txt" ;;
  graphs19) # compile.cuda_graphs (built after cg19): its gpu tests, then peer vs packed vs graphs in one process on
          # 8 batches (64 samples, rows padded to 256 for graphs: ~2-4 lengths), 10 warmup steps (a new length is
          # warmed up once, recorded at its second visit), alternating
          timeout 200 python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_cuda_graphs.py --tb=short \
            > "$OUT/pytest.txt" 2>&1
          (cd bench && timeout 330 python3 train.py --preset qwen3vl-2b --method full --steps 12 --warmup 10 --samples 64 \
            --paths peer,packed,graphs,packed,graphs --ours compile.enabled=true --json "$OUT/graphs2b.json" \
            2>"$OUT/err-graphs2b.txt" | tail -8 > "$OUT/graphs2b.txt") ;;
  graphs19b) # its gpu tests again, once more without the gradient buffers made before a step's first micro-batch
          # (the test must fail then), and peer vs packed vs graphs at 8B three-tier LoRA (GPU-bound to ~85%)
          timeout 150 python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_cuda_graphs.py --tb=short \
            > "$OUT/pytest.txt" 2>&1
          timeout 90 python3 -c "import sys, torch, pytest, vlforge.recipes.sft as sft
sft.cuda_graph_step_begin = lambda t, micro, i: torch.compiler.cudagraph_mark_step_begin() if t.cuda_graphs else None
sys.exit(pytest.main(['-q', '-m', 'gpu', '-p', 'no:cacheprovider', '--tb=line', '-k', 'weights and 2',
                      'tests/test_cuda_graphs.py']))" > "$OUT/pytest-without-buffers.txt" 2>&1
          (cd bench && timeout 330 python3 train.py --preset qwen3vl-8b --method lora --lora-tiers three --steps 8 \
            --warmup 10 --samples 64 --paths peer,graphs,packed,graphs --ours compile.enabled=true --json "$OUT/graphs8b.json" \
            2>"$OUT/err-graphs8b.txt" | tail -8 > "$OUT/graphs8b.txt") ;;
  visg19) # the vision blocks as CUDA graphs too (compile.cuda_graphs_vision; ran as the bench flag it came from),
          # 2B full packed, alternating with the decoder layers' graphs alone
          b="--preset qwen3vl-2b --method full --packing --steps 8 --warmup 12 --override compile.enabled=true
             compile.cuda_graphs=true"
          r 1 $b
          TORCH_LOGS=perf_hints r 2 $b compile.cuda_graphs_vision=true
          r 3 $b
          r 4 $b compile.cuda_graphs_vision=true ;;
  final19) # prepared, not run (device time spent): cuda_graphs' gpu tests after the review's narrower gradient-buffer
          # rule, the vision-graphs case among them; then issue 13's 2B full, peer vs packed vs both graph options in
          # one process (visg19 measured ~2.5x against another call's peer)
          # (and FSDP2 with fp16 / precision.overrides under CUDA autocast: tests/test_distributed.py)
          timeout 240 python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_cuda_graphs.py \
            tests/test_distributed.py --tb=short > "$OUT/pytest.txt" 2>&1
          (cd bench && timeout 300 python3 train.py --preset qwen3vl-2b --method full --steps 12 --warmup 10 --samples 64 \
            --paths peer,graphs+vision,packed,graphs+vision,packed --ours compile.enabled=true \
            --json "$OUT/final2b.json" 2>"$OUT/err-final2b.txt" | tail -8 > "$OUT/final2b.txt") ;;
  grpo17) # GRPO's update with the log-prob forward's layout read from the rollout's host copy (4090292) against the
          # commit before it, in one call: here `bash bench/ab.sh prepare acfe487` first (side "main" = this checkout's
          # main, "branch" = acfe487), carry [".whl/ab"]; the recipe's update, padded and packed modes alternating
          LIMIT=280 bash bench/ab.sh run grpo_update.py --recipe qwen3vl-2b-grpo > "$OUT/ab-grpo2b.jsonl" ;;
  visprof) b="--preset qwen3vl-2b --method full --steps 6 --warmup 3 --override compile.enabled=true compile.vision=false"
           LIMIT=120; r 1 $b model.attention.vision=varlen --profile "$OUT/prof-varlen.txt"
           r 2 $b model.attention.vision=sdpa --profile "$OUT/prof-loop.txt" ;;  # why eager varlen vision blocks train slower
  lora13) (cd bench && timeout 420 python3 train.py --preset qwen3vl-8b --method lora --paths peer,ours,packed --steps 10 \
            --samples 32 --ours compile.enabled=true 2>"$OUT/err-8b.txt" | tail -6 > "$OUT/train8b.txt") ;;  # issue 13: 8B LoRA
            # with compiled (frozen, forward-only) vision blocks on the varlen call, padded and packed, peft beside
  gen6)  (cd bench && timeout 300 python3 generate.py --preset qwen3vl-2b --paths vlforge --cases mixed,tail \
           --out "$OUT/gen-2b.jsonl" 2>"$OUT/err-gen.txt") ;;  # mixed: joins batched (join_share) vs vlforge-joineach
  serve3) for a in "--engine vlforge" "--compile"; do n=${a//[- ]/}
           timeout 200 python3 bench/serve_load.py --preset qwen3vl-2b --requests 2 --serve-arg="$a" \
             --out "$OUT/serve-$n.json" > /dev/null 2>"$OUT/err-$n.txt"; done ;;
  fp8) for side in 8b-bf16 8b-fp8; do OUT=$OUT timeout 290 bash bench/gpu_fp8.sh $side > "$OUT/fp8-$side.txt" 2>&1; done ;;
  gen3)  timeout 120 python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_generate.py -k "cuda_graph" \
           --tb=short > "$OUT/pytest.txt" 2>&1
         (cd bench && timeout 420 python3 generate.py --preset qwen3vl-2b --paths vlforge --cases 64x256,tail \
           --out "$OUT/gen-2b.jsonl" 2>"$OUT/err-gen.txt") ;;
  gen4)  (cd bench && timeout 300 python3 generate.py --preset qwen3vl-2b --paths vlforge,hf-static \
           --cases 64x256 --out "$OUT/gen-2b.jsonl" 2>"$OUT/err-gen2b.txt"
         timeout 240 python3 generate.py --preset qwen3vl-8b --paths vlforge --cases 64x256 \
           --out "$OUT/gen-8b.jsonl" 2>"$OUT/err-gen8b.txt") ;;
  tests3) timeout 300 python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_generate.py --tb=short \
           > "$OUT/pytest.txt" 2>&1 ;;
  tests2) timeout 170 python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_packing.py tests/test_losses.py \
           tests/test_router_replay.py tests/test_generate.py --tb=short > "$OUT/pytest.txt" 2>&1 ;;
  lora8b) for impl in chunked liger; do (cd bench && timeout 270 python3 train.py --preset qwen3vl-8b --method lora \
           --paths peer,ours --steps 10 --samples 32 --ours compile.enabled=true loss.impl=$impl \
           2>"$OUT/err-8b-$impl.txt" | tail -5 > "$OUT/train8b-$impl.txt"); done ;;
  gen2b) (cd bench && timeout 560 python3 generate.py --preset qwen3vl-2b --out "$OUT/gen-2b.jsonl" 2>"$OUT/err-gen.txt") ;;
  gen8b) (cd bench && timeout 560 python3 generate.py --preset qwen3vl-8b --out "$OUT/gen-8b.jsonl" 2>"$OUT/err-gen.txt") ;;
  serve) timeout 200 python3 bench/serve_load.py --preset qwen3vl-2b --out "$OUT/serve-new.json" > /dev/null 2>"$OUT/err-s1.txt"
         timeout 300 python3 bench/serve_load.py --preset qwen3vl-2b --serve-arg "--engine hf" --out "$OUT/serve-old.json" \
           > /dev/null 2>"$OUT/err-s2.txt" ;;
  opt21) # (carry .whl/bnb) bitsandbytes' CUDA 8-bit AdamW on FSDP2 shards (tests/test_optim.py -m gpu:
         # exact resume, paged too, against the unsharded run), then rl19's first run (GSPO, the engine's old log-probs)
         timeout 200 python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_optim.py --tb=short \
           > "$OUT/pytest-optim.txt" 2>&1
         OUT=$OUT LIMIT=170 bash bench/gpu_grpo_smoke.sh qwen3vl-2b-grpo rl.policy_loss=gspo rl.clip_low=null \
           rl.clip_high=null rl.agg=auto train.max_steps=3 ;;
  rl19) # GSPO against the rollout engine's log-probs on a GPU. The
         # 2B recipe, 3 steps each: gspo with the engine's old log-probs (first mini-batch clip_frac: does the
         # 3e-4 band clip on-policy tokens?), then gspo + rl.old_logprobs=trainer (rollout_approx_kl: the gap;
         # clip_frac should be 0 at the first mini-batch), then cispo + rloo. Prediction: the engine's gap is
         # ~8e-4 per token at 2B (docs/benchmarks.md's first-step approx_kl), above 3e-4: gspo clips there
         g="rl.policy_loss=gspo rl.clip_low=null rl.clip_high=null rl.agg=auto"
         OUT=$OUT LIMIT=170 bash bench/gpu_grpo_smoke.sh qwen3vl-2b-grpo $g train.max_steps=3
         OUT=$OUT LIMIT=170 bash bench/gpu_grpo_smoke.sh qwen3vl-2b-grpo $g rl.old_logprobs=trainer train.max_steps=3
         OUT=$OUT LIMIT=170 bash bench/gpu_grpo_smoke.sh qwen3vl-2b-grpo rl.policy_loss=cispo rl.clip_low=null \
           rl.advantage=rloo train.max_steps=3 ;;
  grpo)  OUT=$OUT LIMIT=270 STACKS=20 bash bench/gpu_grpo_smoke.sh "qwen3vl-2b-grpo qwen3vl-8b-grpo" rollout.prompts_per_step=8 \
           rollout.group_size=8 rollout.max_new_tokens=256 rl.mini_batch_size=16 train.max_steps=3 ;;
  moeq) # (carry .whl/bnb) NF4 MoE experts. tests/test_moe_quant.py -m gpu (the staged load: host memory
         # first, each expert stack quantized on the GPU; QLoRA trains on it), then 30B-A3B bf16 vs NF4 (experts
         # included now): weights memory, prefill, decode at batch 1 and 8. Prediction: ~17 GB of weights vs ~61;
         # decode slower than bf16 (every step dequantizes all 128 experts of each layer, ~29B values), but faster
         # than the attention-only NF4 of 2026-11-30 (11.5 tok/s at batch 1)
         # The gpu tests include the probe for CUDA graphs with NF4 experts (generate/engine excludes them until
         # it passes). bench/nf4_experts.py: one 30B-A3B layer by tokens, to set model/nf4.routed_pays from GPU
         # numbers (prediction: the routed path wins up to more pairs than on the CPU's 64 of 128)
         timeout 200 python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_moe_quant.py --tb=short \
           > "$OUT/pytest-moeq.txt" 2>&1
         timeout 150 python3 bench/nf4_experts.py > "$OUT/nf4_experts.jsonl" 2>"$OUT/err-nf4.txt" ;;
  moeq2) # (carry .whl/bnb), after moeq: 30B-A3B served bf16 vs NF4 (experts included), then QLoRA
         # training on NF4 experts with LoRA on attention and every expert (ours only: tokens/s, peak memory;
         # prediction: peak well under the 75.6 GB of bf16 experts at batch 8 with checkpointing)
         timeout 300 python3 bench/quant_inference.py --preset qwen3vl-30b-a3b --quant none nf4 --tmp /dev/shm \
           > "$OUT/quant30.jsonl" 2>"$OUT/err-quant.txt"
         timeout 250 python3 bench/train.py --preset qwen3vl-30b-a3b --method lora --paths ours --grad-ckpt --steps 6 \
           --samples 32 --ours quant.language=nf4 tiers.language.experts=true 2>"$OUT/err-train.txt" | tail -8 \
           > "$OUT/qlora30.txt" ;;
  moe) timeout 300 python3 bench/train.py --preset qwen3vl-30b-a3b --method lora --paths peer,ours --grad-ckpt --steps 6 \
         --samples 32 2>"$OUT/err-train.txt" | tail -8 > "$OUT/train30.txt"
       timeout 250 python3 bench/quant_inference.py --preset qwen3vl-30b-a3b --quant none nf4 --tmp /dev/shm \
         > "$OUT/quant30.jsonl" 2>"$OUT/err-quant.txt" ;;
  video) # SFT on videos (one 8-frame 448 px video a sample: 4 temporal patches, 4x the image's
         # tokens), 2B full compiled: the recipe's form (videos shown as images, one tower call, host-side
         # inputs) vs transformers' own video form (--native-video: two tower calls, device masks), alternating,
         # then packed. Prediction: the recipe's form >= native (the host inputs' gain on images was <= 5%)
         b="--preset qwen3vl-2b --method full --steps 8 --warmup 4 --video 8 --override compile.enabled=true"
         LIMIT=120; r 1 $b; r 2 $b --native-video; r 3 $b; r 4 $b --native-video; r 5 $b --packing ;;
  s23) # (carry .whl/bnb) the staged NF4 load's gpu test (failed on an H100: GPU-quantized
       # expert stacks unlike the CPU's; suspected non-contiguous stacks, quantize_experts now makes them
       # contiguous: prediction, it passes), 30B-A3B served bf16 vs NF4 (shared_images' host indices fixed), and
       # video SFT in transformers' own video form vs the recipe's (frames as images), alternating
       timeout 120 python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_moe_quant.py --tb=short \
         > "$OUT/pytest-moeq.txt" 2>&1
       timeout 230 python3 bench/quant_inference.py --preset qwen3vl-30b-a3b --quant none nf4 --tmp /dev/shm \
         > "$OUT/quant30.jsonl" 2>"$OUT/err-quant.txt"
       b="--preset qwen3vl-2b --method full --steps 6 --warmup 4 --video 8 --override compile.enabled=true"
       LIMIT=75; r 1 $b --native-video; r 2 $b; r 3 $b --native-video ;;
  s24) # (carry .whl/bnb) why 30B-A3B with NF4 experts decodes at 6.6 tokens/s (bf16:
       # 83.9): both models' batch-1 decode under the profiler (graphs on or off? per-expert dequantization?),
       # with full-length warm-ups now (the numbers above had a 2-token warm-up)
       timeout 560 python3 bench/quant_inference.py --preset qwen3vl-30b-a3b --quant none nf4 --tmp /dev/shm \
         --profile "$OUT/decode-profile" > "$OUT/quant30.jsonl" 2>"$OUT/err-quant.txt" ;;
  s24b) # the video A/B warm: a first frames-as-images run as warm-up, then native / ours alternating
       b="--preset qwen3vl-2b --method full --steps 6 --warmup 4 --video 8 --override compile.enabled=true"
       LIMIT=130; r 1 $b; r 2 $b --native-video; r 3 $b; r 4 $b --native-video ;;
  i13) # (issue 13's 8B 2x) 8B three-tier LoRA with the vision blocks replayed as CUDA graphs too,
       # never measured at 8B (graphs19b graphed only the decoder layers: 0.98x). host16's profile put ~12 ms a
       # step in the frozen vision blocks' compiled forwards, whose host work outruns their GPU work. Prediction:
       # graphs+vision 3-5% over packed (0.295 -> ~0.283 s a step), so ~1.95-2.1x the peer in the same process
       (cd bench && timeout 560 python3 train.py --preset qwen3vl-8b --method lora --lora-tiers three --steps 10 \
          --warmup 10 --samples 64 --paths peer,packed,graphs+vision,packed,graphs+vision \
          --ours compile.enabled=true --json "$OUT/i13.json" 2>"$OUT/err-i13.txt" | tail -12 > "$OUT/i13.txt") ;;
  mw25) # (issue 13's 2B 2.5x) precision.master_weights=optimizer (bf16 linear weights, fp32 masters in
       # MasterWeightAdamW's compiled update) against fp32 masters, packed with both graph options, beside the peer;
       # its gpu test first (the compiled update equals eager on CUDA). Prediction: the 10.2 ms of weight and
       # gradient casts of prof19's 133.7 ms step go (the update reads bf16 gradients and writes the copies in its
       # own pass), so 0.147 -> ~0.138 s a step: ~2.45-2.5x the peer in the same process, peak memory lower
       timeout 100 python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_master_weights.py --tb=short \
         > "$OUT/pytest-mw.txt" 2>&1
       (cd bench && timeout 470 python3 train.py --preset qwen3vl-2b --method full --steps 10 --warmup 16 --samples 64 \
          --paths peer,graphs+vision+mw,graphs+vision,graphs+vision+mw,graphs+vision --ours compile.enabled=true \
          --json "$OUT/mw25.json" 2>"$OUT/err-mw25.txt" | tail -12 > "$OUT/mw25.txt") ;;
  s25) # one short call (carry .whl): mw25's gpu test and its bench with 4 paths, then
       # q25's pytest (which quantized methods replay from CUDA graphs); q25's 30B-A3B NF4 decode left for later
       timeout 60 python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_master_weights.py --tb=short \
         > "$OUT/pytest-mw.txt" 2>&1
       (cd bench && timeout 250 python3 train.py --preset qwen3vl-2b --method full --steps 12 --warmup 12 --samples 64 \
          --paths peer,graphs+vision+mw,graphs+vision,graphs+vision+mw --ours compile.enabled=true \
          --json "$OUT/mw25.json" 2>"$OUT/err-mw25.txt" | tail -12 > "$OUT/mw25.txt")
       timeout 120 python3 -m pytest -q -rxXs -m gpu -p no:cacheprovider tests/test_infer_model.py \
         tests/test_moe_quant.py -k cuda_graphs --tb=short > "$OUT/pytest-q25.txt" 2>&1 ;;
  q25) # (carry .whl) s24's profile showed the NF4 30B-A3B decode eager (serve turned CUDA graphs off for
       # every quantized model), host-bound: 3.3 s of host time for 313 ms of GPU work. Which quantized methods replay
       # from graphs with the eager tokens (nf4 claimed; int8 and fp8 run as expected failures: XPASS = could join),
       # then 30B-A3B NF4 served with graphs. Prediction: batch-1 decode from 4.9 to ~40-70 tokens/s (bf16: 83)
       timeout 170 python3 -m pytest -q -rxXs -m gpu -p no:cacheprovider tests/test_infer_model.py \
         tests/test_moe_quant.py -k cuda_graphs --tb=short > "$OUT/pytest-q25.txt" 2>&1
       timeout 410 python3 bench/quant_inference.py --preset qwen3vl-30b-a3b --quant nf4 --tmp /dev/shm \
         > "$OUT/quant30.jsonl" 2>"$OUT/err-quant.txt" ;;
  mem) b="--preset qwen3vl-8b --method full --steps 6 --warmup 3 --override optim.name=adamw8bit"
       r 1 $b activation_checkpointing.enabled=true
       r 2 $b activation_checkpointing.enabled=true activation_checkpointing.every=2
       r 3 $b compile.enabled=true compile.activation_memory_budget=0.5
       r 4 $b compile.enabled=true ;;
  suite) # the gpu tier on three workers (docs/testing.md), then serve under load long enough for a steady
         # state at 32 clients (12 requests a client; TTFT now from every request: ids past the tokenizer banned)
         timeout 290 python3 -m pytest -q -m gpu -n 3 --dist worksteal -p no:cacheprovider --timeout=280 -rfE \
           --tb=short > "$OUT/pytest-gpu.txt" 2>&1
         timeout 290 python3 bench/serve_load.py --preset qwen3vl-2b --clients 1 8 32 --requests 12 \
           --out "$OUT/serve.json" > "$OUT/serve.txt" 2>"$OUT/err-serve.txt" ;;
  fp8r)  # FP8 against bf16 rollouts, each pair in one process (2B full, then 8B LoRA): speed, refresh, k3 gap
         timeout 260 python3 bench/rollout_throughput.py --preset qwen3vl-2b --precision bf16 fp8 \
           > "$OUT/fp8r-2b.jsonl" 2>"$OUT/err-fp8r-2b.txt"
         timeout 320 python3 bench/rollout_throughput.py --preset qwen3vl-8b --lora peft --precision bf16 fp8 \
           > "$OUT/fp8r-8b.jsonl" 2>"$OUT/err-fp8r-8b.txt" ;;
  gen44) # the engine at 64x256, 2B and 8B (docs/benchmarks.md's Generation table)
         timeout 200 python3 bench/generate.py --preset qwen3vl-2b --paths vlforge --cases 64x256 \
           --out "$OUT/gen-2b.jsonl" > /dev/null 2>"$OUT/err-gen2b.txt"
         timeout 300 python3 bench/generate.py --preset qwen3vl-8b --paths vlforge --cases 64x256 \
           --out "$OUT/gen-8b.jsonl" > /dev/null 2>"$OUT/err-gen8b.txt" ;;
  recipes) # the shipped 2B SFT recipe as a user runs it, beside the plain-transformers peer, and its second
         # start (warm compile caches); the first step compiles layers, vision blocks and the optimizer's update
         # (150 s was too little for 16 steps on an H100)
         timeout 580 python3 bench/recipes.py --only ${ROWS:-sft-2b-full} --steps 16 --second-run --timeout 300 \
           --out "$OUT/recipes.json" > "$OUT/recipes.txt" 2>"$OUT/err-recipes.txt" ;;
  grpocompile) # GRPO's training forward compiled (compile.enabled=true) against the shipped recipe (eager), 2B:
         # whether compile.enabled auto should compile GRPO too (the first step's compile counted apart)
         for o in "" "compile.enabled=true"; do
           timeout 280 python3 bench/recipes.py --only grpo-2b-full --steps 16 --timeout 260 ${o:+--override $o} \
             --out "$OUT/grpo${o:+-compiled}.json" > "$OUT/grpo${o:+-compiled}.txt" 2>>"$OUT/err-grpo.txt"
         done ;;
  serveprof) # where a serving GPU's time goes at 32 clients: serve_load with py-spy (a wheel in .whl) sampling
         # the server's threads during the 32-client level, then the sampled stacks in $OUT/spy.txt
         export PATH=/tmp/site/bin:$PATH
         (timeout 330 python3 bench/serve_load.py --preset qwen3vl-2b --clients 8 32 --requests 12 \
            --out "$OUT/serve.json" > "$OUT/serve.txt" 2>"$OUT/err-serve.txt" &)
         for i in $(seq 1 200); do sleep 1; pid=$(pgrep -f "vlforge.cli serve qwen3vl-2b" | head -1); [ -n "$pid" ] && break; done
         for i in $(seq 1 300); do sleep 1; grep -q "^8 clients" "$OUT/err-serve.txt" && break; done; sleep 3
         timeout 60 py-spy record -p "$pid" -d 15 -r 200 --threads --format raw -o "$OUT/spy.txt" > "$OUT/spy.log" 2>&1
         while pgrep -f "bench/serve_load.py" > /dev/null; do sleep 2; done ;;
  servecap) # the serve workload without HTTP (--in-process: the engine's bound, traced at 32 clients, two
         # engine variants), then through the server with py-spy on its threads (all, then the GIL holder's)
         timeout 280 python3 bench/serve_load.py --preset qwen3vl-2b --in-process --clients 1 8 32 --requests 6 \
           --trace "$OUT/trace.txt" --engine-set sync_every=8 \
           > "$OUT/inproc.txt" 2>"$OUT/err-inproc.txt"
         [ -n "${INPROC_ONLY:-}" ] && exit 0
         export PATH=/tmp/site/bin:$PATH
         (timeout 280 python3 bench/serve_load.py --preset qwen3vl-2b --clients 8 32 --requests 12 \
            > "$OUT/serve.txt" 2>"$OUT/err-serve.txt" &)
         for i in $(seq 1 200); do sleep 1; pid=$(pgrep -f "vlforge.cli serve qwen3vl-2b" | head -1); [ -n "$pid" ] && break; done
         for i in $(seq 1 250); do sleep 1; grep -q "^8 clients" "$OUT/err-serve.txt" && break; done; sleep 3
         timeout 30 py-spy record -p "$pid" -d 9 -r 200 --threads --format raw -o "$OUT/spy.txt" > /dev/null 2>&1
         timeout 30 py-spy record -p "$pid" -d 8 -r 200 --threads --gil --format raw -o "$OUT/spy-gil.txt" > /dev/null 2>&1
         while pgrep -f "bench/serve_load.py" > /dev/null; do sleep 2; done ;;
  serve44) # the serve workload in process (the engine's bound, then profiled), then through the server with
         # httptools + uvloop (carried wheels), then with uvicorn's pure-Python h11 and asyncio loop
         timeout 150 python3 bench/serve_load.py --preset qwen3vl-2b --in-process --clients 32 --requests 4 \
           --trace "$OUT/trace.txt" > "$OUT/inproc.txt" 2>"$OUT/err-inproc.txt"
         timeout 175 python3 bench/serve_load.py --preset qwen3vl-2b --clients 1 8 32 --requests 6 \
           > "$OUT/serve-httptools.txt" 2>"$OUT/err-serve.txt"
         [ -n "${NO_H11:-}" ] && exit 0
         rm -rf /tmp/site/httptools* /tmp/site/uvloop*
         timeout 150 python3 bench/serve_load.py --preset qwen3vl-2b --clients 8 32 --requests 6 \
           > "$OUT/serve-h11.txt" 2>>"$OUT/err-serve.txt" ;;
  serveswitch) # the server's GIL hand-over interval: Python's 5 ms against 0.5 ms, same workload
         for sw in 0.005 0.0005; do
           timeout 280 python3 bench/serve_load.py --preset qwen3vl-2b --clients 1 8 32 --requests 12 \
             --server-switch-interval $sw > "$OUT/serve-$sw.txt" 2>"$OUT/err-serve-$sw.txt"
         done ;;
  *) echo "GROUP must be one of the groups above"; exit 2 ;;
esac
