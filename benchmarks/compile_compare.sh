#!/usr/bin/env bash
# backend.compile against eager, side by side in one session on one machine:
#
#   bash benchmarks/compile_compare.sh [OUT_DIR]      # default reports/
#
# batch 1 (bf16, int8, gguf; 64-token prompt, 128 tokens out) and decode_heavy (64 running), each
# eager and compiled. The compile time is paid in the warm-up requests and logged, not measured.
set -euo pipefail
OUT="${1:-reports}"
python -m core compare -v "" -v "backend.compile=true" -v "quant=int8" -v "quant=int8 backend.compile=true" \
  -v "quant=gguf" -v "quant=gguf backend.compile=true" workload=fixed workload.num_requests=1 \
  workload.prompt_len=64 workload.output_len=128 run.name=compile-batch1 "run.report_dir=$OUT"
python -m core compare -v "" -v "backend.compile=true" workload=decode_heavy run.name=compile-decode_heavy \
  "run.report_dir=$OUT"
