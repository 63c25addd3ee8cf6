#!/usr/bin/env bash
# NVIDIA TransformerEngine on a GPU machine that has no network and takes at most ~64 MiB per call:
# the prebuilt core (transformer-engine-cu13, a 276.5 MB wheel) travels in chunks, the PyTorch
# extension (transformer-engine-torch, a 0.5 MB sdist) is built there against the machine's own
# torch, both go into a target dir, then the `te` backend is tested and benchmarked.
# Results and timings: docs/benchmarks.md, "TransformerEngine FP8".
#
#   here, with network:      bash bench/gpu_te.sh prep DIR          # download, pack, split into DIR/parts/NN, sha256
#   there, one call a part:  bash bench/gpu_te.sh stash DIR         # DIR/src (first call) and DIR/parts/* -> /tmp/te;
#                                                                   # the first call also starts the build (setsid)
#   there, after the last:   bash bench/gpu_te.sh install           # reassemble, verify, wait for the build, install, import
#                            bash bench/gpu_te.sh tests | measure | 8b NAME OVERRIDES... | grpo NAME OVERRIDES...
# Everything lands under /tmp/te (kept while the machine is held) and the site dir /tmp/te/site;
# logs and results also under $OUT. VERSION, PART_MIB, PACK (wheel | xz | auto) may be set for prep.
set -uo pipefail
VERSION=${VERSION:-2.20.2}
TE=/tmp/te; SITE=$TE/site
OUT=${OUT:-$TE/out}; mkdir -p "$OUT"
HERE=$(cd "$(dirname "$0")/.." && pwd)  # the tree holding vlforge/, tests/, bench/
stamp() { echo "[$(date -u +%H:%M:%S)] $*"; }
CORE=transformer_engine_cu13-$VERSION-py3-none-manylinux_2_28_x86_64.whl

prep() {  # DIR: runs where PyPI is reachable
  local dir=$1 pip=${PIP:-python3 -m pip} part=${PART_MIB:-60}
  mkdir -p "$dir/src" "$dir/dl" && rm -rf "$dir/parts" && mkdir -p "$dir/parts"
  local plat=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
              --platform manylinux2014_x86_64)
  $pip download -q --no-deps --only-binary=:all: "${plat[@]}" -d "$dir/dl" "transformer-engine-cu13==$VERSION" || return 1
  # the metapackage (TE's import checks want its dist-info) and pydantic (TE's recipes are pydantic
  # dataclasses), which the GPU machine's image lacks
  $pip download -q --no-deps --only-binary=:all: "${plat[@]}" -d "$dir/src" "transformer-engine==$VERSION" \
    pydantic pydantic-core annotated-types typing-inspection typing-extensions || return 1
  # an sdist's metadata step needs torch for its build requirements: skip build isolation (no build here)
  $pip download -q --no-deps --no-binary=:all: --no-build-isolation -d "$dir/src" "transformer-engine-torch==$VERSION" || return 1
  (cd "$dir/dl" && sha256sum "$CORE") > "$dir/src/SHA256SUMS"
  local pack=${PACK:-auto} bytes=$((part * 1024 * 1024))
  if [ "$pack" != wheel ]; then  # the wheel's zip deflate leaves most of libtransformer_engine.so's bytes: xz does better
    rm -rf "$dir/dl/tree" && mkdir -p "$dir/dl/tree" && unzip -q "$dir/dl/$CORE" -d "$dir/dl/tree"
    tar -C "$dir/dl/tree" -cf - . | xz -9 -T2 > "$dir/dl/core.tar.xz"
    local wheel_parts=$(( ($(stat -c %s "$dir/dl/$CORE") + bytes - 1) / bytes ))
    local xz_parts=$(( ($(stat -c %s "$dir/dl/core.tar.xz") + bytes - 1) / bytes ))
    echo "parts of $part MiB: wheel $wheel_parts, xz $xz_parts"
    if [ "$pack" = xz ] || [ "$xz_parts" -lt "$wheel_parts" ]; then pack=xz; else pack=wheel; fi
  fi
  if [ "$pack" = xz ]; then
    (cd "$dir/dl" && sha256sum core.tar.xz) >> "$dir/src/SHA256SUMS"
    split -b "$bytes" -d -a 2 "$dir/dl/core.tar.xz" "$dir/parts/core.tar.xz."
  else
    split -b "$bytes" -d -a 2 "$dir/dl/$CORE" "$dir/parts/$CORE."
  fi
  (cd "$dir/parts" && sha256sum *) >> "$dir/src/SHA256SUMS"
  echo "$pack" > "$dir/src/PACK"
  ls -la "$dir/src" "$dir/parts"; cat "$dir/src/SHA256SUMS"
}

build() {  # the torch extension, against this machine's torch; run in the background by stash
  local t0=$(date +%s) sp
  rm -rf $TE/build && mkdir -p $TE/build $TE/wheels && tar -C $TE/build -xzf $TE/src/transformer_engine_torch-$VERSION.tar.gz
  sp=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # csrc includes <cudnn.h> and <nccl.h>, which live in torch's nvidia-* wheels, not the toolkit
  local inc; inc=$(find "$sp/nvidia" -maxdepth 4 \( -name cudnn.h -o -name nccl.h \) -printf '%h:' 2>/dev/null)
  stamp "build start: nvcc $(command -v nvcc) torch $(python3 -c 'import torch; print(torch.__version__)') extra includes $inc"
  # FORCE_BUILD: never try the GitHub prebuilt wheel (no network); NCCL EP (MoE all-to-all) needs
  # headers of its own and nothing here uses it
  CPATH=${inc}${CPATH:-} NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_WITH_NCCL_EP=0 NVTE_CUDA_ARCHS=90 NVTE_FRAMEWORK=pytorch \
    MAX_JOBS=$(nproc) python3 -m pip wheel -v --no-build-isolation --no-deps --no-index -w $TE/wheels \
    $TE/build/transformer_engine_torch-$VERSION
  local rc=$?
  stamp "build rc=$rc seconds=$(( $(date +%s) - t0 ))"
  echo "$rc $(( $(date +%s) - t0 ))" > $TE/build.done
}

stash() {  # DIR: copy this call's carried files to /tmp/te; start the build once the sdist is there
  local dir=$1
  mkdir -p $TE/parts $TE/src
  [ -d "$dir/src" ] && cp -a "$dir/src/." $TE/src/
  [ -d "$dir/parts" ] && cp -a "$dir/parts/." $TE/parts/
  cp "$0" $TE/gpu_te.sh
  stamp "stashed: $(ls $TE/parts | tr '\n' ' ')"
  if [ ! -e $TE/build.started ] && [ -f $TE/src/transformer_engine_torch-$VERSION.tar.gz ]; then
    date +%s > $TE/build.started
    setsid nohup bash $TE/gpu_te.sh build > $TE/build.log 2>&1 < /dev/null &
    stamp "build started in the background (log $TE/build.log)"
  fi
  [ -f $TE/build.done ] && stamp "build done: $(cat $TE/build.done)"
  grep -E "error|Error" $TE/build.log 2>/dev/null | head -5
  tail -2 $TE/build.log 2>/dev/null
}

install() {  # reassemble and verify the core, wait for the build, install everything into $SITE
  local t0=$(date +%s) pack; pack=$(cat $TE/src/PACK)
  cd $TE || return 1
  if [ "$pack" = xz ]; then cat parts/core.tar.xz.* > core.tar.xz; else cat parts/$CORE.* > $CORE; fi
  grep -E " (core.tar.xz|$CORE)\$" src/SHA256SUMS | sha256sum -c - || { stamp "sha256 mismatch"; return 1; }
  stamp "reassembled + sha256 ok in $(( $(date +%s) - t0 )) s"
  while [ ! -f $TE/build.done ]; do sleep 5; done
  read -r rc secs < $TE/build.done
  stamp "extension build: rc=$rc, $secs s"; tail -3 $TE/build.log
  [ "$rc" = 0 ] || { grep -iE -m 20 "error" $TE/build.log; return 1; }
  rm -rf $SITE && mkdir -p $SITE
  local extra=() have
  have=$(python3 -c 'import importlib.metadata as m; print(m.version("typing_extensions"))' 2>/dev/null || echo 0)
  python3 -c "import sys; v=tuple(map(int,'$have'.split('.')[:2])); sys.exit(v >= (4, 16))" && extra+=(src/typing_extensions-*.whl)
  [ "$pack" = xz ] && core=() || core=($CORE)
  python3 -m pip install -q --no-index --no-deps --no-compile --target $SITE "${core[@]}" \
    src/transformer_engine-$VERSION-*.whl src/pydantic-*.whl src/pydantic_core-*.whl src/annotated_types-*.whl \
    src/typing_inspection-*.whl "${extra[@]}" wheels/transformer_engine_torch-*.whl || return 1
  if [ "$pack" = xz ]; then  # the unpacked core wheel, merged in as pip would (after pip: --target skips
    # top-level dirs that already exist), then every file checked against the wheel's RECORD
    xz -dc core.tar.xz | tar -C $SITE -xf - || return 1
    python3 - "$SITE" <<'EOF' || return 1
import base64, csv, glob, hashlib, pathlib, sys
site = pathlib.Path(sys.argv[1])
record = glob.glob(f"{site}/transformer_engine_cu13-*.dist-info/RECORD")[0]
bad = n = 0
for path, digest, _ in csv.reader(open(record)):
    if digest:
        algo, want = digest.split("=", 1)
        got = base64.urlsafe_b64encode(hashlib.new(algo, (site / path).read_bytes()).digest()).rstrip(b"=").decode()
        bad += got != want; n += 1
print(f"RECORD: {n} files checked, {bad} mismatched"); sys.exit(bad > 0)
EOF
  fi
  stamp "installed into $SITE in $(( $(date +%s) - t0 )) s (build ran in the background)"
  PYTHONPATH=$SITE python3 -c "
import time; t = time.time()
import transformer_engine, transformer_engine.pytorch as te, importlib.metadata as m
print('import ok', m.version('transformer-engine'), m.version('transformer_engine_torch'), f'{time.time() - t:.1f} s')
print('fp8 available:', te.is_fp8_available(), 'block scaling:', te.is_fp8_block_scaling_available())"
}

export PYTHONPATH=$SITE:$HERE${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
cmd=${1:-}; shift || true
case "$cmd" in
  prep) prep "$@" ;;
  build) build ;;
  stash) stash "$@" ;;
  install) install 2>&1 | tee -a "$OUT/install.txt" ;;
  tests)
    cd "$HERE" || exit 1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
    python3 -m vlforge doctor | grep -iE "transformer_engine|te fp8|fp8 matmul|doctor:" | tee "$OUT/doctor.txt"
    python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests/test_fp8.py -rs 2>&1 | tail -15 | tee "$OUT/pytest.txt"
    ;;
  8b)  # NAME OVERRIDES...: the FP8 benchmark of bench/gpu_fp8.sh (8B full, bf16 masters, 200 steps)
    cd "$HERE" || exit 1
    name=$1; shift
    python3 bench/sft_throughput.py --curve "$OUT/$name.json" --preset qwen3vl-8b --method full --steps ${STEPS:-200} \
      --samples 256 --override tiers.language.lr=1e-4 tiers.projector.lr=1e-4 tiers.vision.lr=1e-4 \
      precision.master_weights=compute "$@" 2>"$OUT/$name.err" | tail -1 | tee -a "$OUT/te.jsonl"
    tail -3 "$OUT/$name.err"
    ;;
  grpo)  # NAME OVERRIDES...: bench/gpu_grpo_smoke.sh's workload on the 8B GRPO recipe, 3 steps
    # (its own script names outputs after the overrides: too long a file name for these)
    cd "$HERE" || exit 1
    name=$1; shift
    [ -f /tmp/sh448/train.jsonl ] || python3 -m vlforge data synth shapes --n 72 --out /tmp/sh448 --size 448 --val-fraction 0.12
    python3 -m vlforge grpo configs/qwen3vl-8b-grpo.yaml data.train=/tmp/sh448/train.jsonl data.val=/tmp/sh448/val.jsonl \
      train.output_dir=$TE/$name train.max_steps=3 rollout.prompts_per_step=4 rollout.group_size=4 \
      rollout.max_new_tokens=32 rl.mini_batch_size=16 eval.max_samples=8 eval.max_new_tokens=8 log.progress=false \
      log.every=1 "rl.rewards=[{name: bench/varied_reward.py:length_mod3}]" rl.dynamic_sampling=false \
      train.overwrite=true "$@" 2>&1 | grep -vi warn | tail -4 | tee "$OUT/$name.txt"
    cp $TE/$name/metrics.jsonl "$OUT/$name-metrics.jsonl"
    ;;
  measure)  # the issue's measurements one after another, ~13 min: start it with setsid, collect $OUT later
    for r in delayed current; do
      stamp "8b te $r"; bash "$0" 8b 8b_te_$r precision.fp8.enabled=true precision.fp8.backend=te precision.fp8.te.recipe=$r
    done
    # GRPO: TE delayed on the language model, current scaling (no amax history to go stale) on the
    # vision tower; one mini-batch per step, so approx_kl is the rollout/trainer log-prob mismatch
    stamp "grpo te"; bash "$0" grpo grpo_te precision.fp8.enabled=true precision.fp8.backend=te \
      activation_checkpointing.enabled=false "precision.fp8.include=[language_model.layers,visual.blocks]" \
      precision.fp8.te.recipe=delayed precision.fp8.te_vision.recipe=current
    stamp "grpo bf16"; bash "$0" grpo grpo_bf16 activation_checkpointing.enabled=false
    stamp "8b bf16"; bash "$0" 8b 8b_bf16 compile.enabled=true
    stamp "measure done"
    ;;
  *) sed -n 2,15p "$0"; exit 2 ;;
esac
