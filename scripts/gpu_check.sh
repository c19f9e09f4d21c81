#!/usr/bin/env bash
# The GPU check of the cost model in one go (tests/gpu): real decode steps on this machine's GPU against
# the cost model's prediction, as JSON in $OUT/gpu_check.json (or runs/gpu_check.json). Needs CUDA and torch
# with CUDA; about a minute on an H100/H200/H800, cut off at 290 s.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
out=${OUT:-runs}
mkdir -p "$out"
export ORL_GPU_CHECK_JSON="$out/gpu_check.json"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv || true
PYTHONPATH=$PWD timeout 290 "$PY" -m pytest tests/gpu -m gpu -s -q -p no:cacheprovider
echo "results: $ORL_GPU_CHECK_JSON"
