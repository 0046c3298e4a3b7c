#!/usr/bin/env bash
# Goodput against offered rate on chat_longtail (Poisson arrivals, the workload's targets: TTFT 3 s,
# TPOT 150 ms), for static (to 0.6 req/s: it misses from the first rate), continuous and slo (to
# 2.0 req/s) side by side in one run, plus slo with load shedding from 0.8 req/s; the report states
# each configuration's SLO capacity:
#
#   bash benchmarks/slo_capacity.sh [OUT_DIR]     (default reports; about 45 minutes on 2 cores)
#
# Then the locust ramp (closed loop, 1 to 8 users, the same targets) against `serve scheduler=slo`
# and, beside it, `serve scheduler=continuous` (about 10 minutes):
#
#   bash benchmarks/slo_capacity.sh [OUT_DIR] ramp
#
# And load shedding past the knee (continuous, slo, slo with run.shed=true at 0.6 and 0.8 req/s):
#
#   bash benchmarks/slo_capacity.sh [OUT_DIR] shed
set -euo pipefail
OUT="${1:-reports}"
if [[ "${2:-}" == "shed" ]]; then
  SHED=()
  for v in "scheduler=continuous" "scheduler=slo" "scheduler=slo run.shed=true"; do
    for r in 0.6 0.8; do SHED+=(-v "$v workload.rate=$r"); done
  done
  python -m core compare "${SHED[@]}" workload=chat_longtail workload.arrival=poisson workload.num_requests=40 \
    run.name=slo-shedding-chat_longtail "run.report_dir=$OUT"
  exit 0
fi
if [[ "${2:-}" == "ramp" ]]; then
  for s in slo continuous; do
    python -m core bench scenario=ramp "scheduler=$s" "scenario.ramp=[1,2,4,8]" scenario.stage_s=45 \
      "run.name=ramp-slo-targets-$s" "run.report_dir=$OUT"
  done
  exit 0
fi
RATES=(0.4 0.6 0.8 1.0 1.3 1.6 2.0)
VARIANTS=()
for r in 0.2 0.4 0.6; do VARIANTS+=(-v "scheduler=static workload.rate=$r"); done
for s in continuous slo; do
  for r in "${RATES[@]}"; do VARIANTS+=(-v "scheduler=$s workload.rate=$r"); done
done
for r in "${RATES[@]:2}"; do VARIANTS+=(-v "scheduler=slo run.shed=true workload.rate=$r"); done
python -m core compare "${VARIANTS[@]}" workload=chat_longtail workload.arrival=poisson workload.num_requests=40 \
  run.name=slo-capacity-chat_longtail "run.report_dir=$OUT"
