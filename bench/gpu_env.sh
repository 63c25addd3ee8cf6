# Sourced by the bench/gpu_*.sh scripts: the environment of a device call (repo root as cwd), $OUT,
# and the wheels carried in .whl (or .whl/train and .whl/serve: fastapi and what it imports, uvicorn, pydantic,
# bitsandbytes, torchao, av: the device image lacks them) installed into /tmp/site.
set -uo pipefail
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/vlforge-gpu}; mkdir -p "$OUT"
for d in .whl .whl/train .whl/serve; do  # .whl: every wheel in one folder (one version of each)
  if compgen -G "$d/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site $d/*.whl \
      && case :$PYTHONPATH: in *:/tmp/site:*) ;; *) export PYTHONPATH=$PYTHONPATH:/tmp/site ;; esac
  fi
done
