#!/usr/bin/env bash
# Run ON THE GPU MACHINE (after benchmarks/gpu_prepare.sh here): install the carried wheels beside the
# image's torch/triton/transformers, then the check. About 5 minutes on one H200; writes to $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
mkdir -p "${OUT:-reports/gpu-check}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
# the CUDA-only tests and every Triton kernel compiled for real against its reference (about a minute)
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_triton_kernels.py \
  2>&1 | tee "${OUT:-reports/gpu-check}/tests.txt" | tail -25 || true
python3 -m benchmarks.gpu_check --tokenizer .gpu/tokenizer --out "${OUT:-reports/gpu-check}" "$@"
