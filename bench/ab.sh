#!/usr/bin/env bash
# A/B of a branch against main in ONE device call (the ~7% spread between H200 calls hides smaller
# effects; inside one call runs agree to ~0.2%). Both sides run the branch's bench script (it may
# feed batches the way the branch's recipe does; on main's package it falls back to main's way).
#   here:   bash bench/ab.sh prepare BRANCH        # git archive main and BRANCH into .whl/ab/{main,branch}
#   device: bash bench/ab.sh run SCRIPT ARGS...    # e.g. run sft_throughput.py --preset qwen3vl-2b --method full
#           (carry [".whl/ab"] plus any wheels the runs need; one JSON line per side, tagged, on stdout)
set -uo pipefail
case ${1:-} in
  prepare)
    branch=${2:?usage: bash bench/ab.sh prepare BRANCH}
    rm -rf .whl/ab && mkdir -p .whl/ab/main .whl/ab/branch
    git archive main vlforge bench | tar -x -C .whl/ab/main
    git archive "$branch" vlforge bench | tar -x -C .whl/ab/branch
    du -sh .whl/ab ;;
  run)
    shift; script=${1:?usage: bash bench/ab.sh run SCRIPT ARGS...}; shift
    source "$(dirname "$0")/gpu_env.sh"
    for side in main branch; do
      PYTHONPATH=$PWD/.whl/ab/$side:$PYTHONPATH timeout ${LIMIT:-150} python3 .whl/ab/branch/bench/$script "$@" \
        2>"$OUT/err-ab-$side.txt" | tail -1 | sed "s/^{/{\"side\": \"$side\", /"
    done ;;
  *) echo "usage: bash bench/ab.sh prepare BRANCH | run SCRIPT ARGS..."; exit 2 ;;
esac
