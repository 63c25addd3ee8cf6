# Sourced by the bench/gpu_*.sh scripts: the environment of a device call (repo root as cwd), $OUT,
# and the wheels carried in .whl/train (trl, datasets, liger-kernel) and .whl/serve (fastapi, uvicorn, pydantic:
# the device image lacks them) installed into /tmp/site.
set -uo pipefail
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/vlforge-gpu}; mkdir -p "$OUT"
for d in .whl/train .whl/serve; do
  if [ -d $d ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site $d/*.whl \
      && export PYTHONPATH=$PYTHONPATH:/tmp/site
  fi
done
