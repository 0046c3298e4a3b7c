#!/usr/bin/env bash
# Goodput against offered rate on chat_longtail (Poisson arrivals, the workload's targets: TTFT 3 s,
# TPOT 150 ms), for static (at its own low rates: it misses from the first), continuous and slo side
# by side in one run, plus slo with load shedding from the third rate on; the report states each
# configuration's SLO capacity:
#
#   bash benchmarks/slo_capacity.sh [OUT_DIR]     (default reports; about 25 minutes on 2 cores)
#
# The rates suit the Zen 5 kind (2-core EPYC serving about 2.1 req/s at most; the Zen 4 kind serves
# 1.1-1.5 and wants RATES="0.6 0.8 1.0 1.2");
# on another, set RATES (continuous and slo), STATIC_RATES and NUM_REQUESTS (a point; default 80):
#
#   RATES="0.4 0.6 0.8 1.0 1.3 1.6 2.0" STATIC_RATES="0.2 0.4" bash benchmarks/slo_capacity.sh
#
# NAME names the report (default slo-capacity-chat_longtail), e.g. to keep one per machine kind.
#
# `continuous` runs at the device's default step budget and, beside it, at each budget in
# CONTINUOUS_BUDGETS (default 1024: the budget the issue's baseline ran at, before the CPU's default
# became 256, then 128; empty for none).
#
# SLO_TPOT_S sets a TPOT target other than the workload's (the report's name then ends in -tpotMS):
#
#   SLO_TPOT_S=0.05 STATIC_RATES="" RATES="1.0 1.5 2.0 2.5 3.0 3.5 4.0 5.0" bash benchmarks/slo_capacity.sh
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
read -r -a RATES <<< "${RATES:-1.0 1.5 2.0 2.5 3.0 4.0 5.0}"
read -r -a STATIC_RATES <<< "${STATIC_RATES-0.2 0.4}"  # empty: no static runs
read -r -a BUDGETS <<< "${CONTINUOUS_BUDGETS-1024}"
N="${NUM_REQUESTS:-80}"
NAME="${NAME:-slo-capacity-chat_longtail}"  # the report's name (e.g. one per machine kind)
EXTRA=()
if [[ -n "${SLO_TPOT_S:-}" ]]; then
  EXTRA=("workload.slo_tpot_s=$SLO_TPOT_S")
  NAME="$NAME-tpot$(python -c "print(round($SLO_TPOT_S * 1000))")"
fi
VARIANTS=()
for r in "${STATIC_RATES[@]}"; do VARIANTS+=(-v "scheduler=static workload.rate=$r"); done
for s in continuous slo; do
  for r in "${RATES[@]}"; do VARIANTS+=(-v "scheduler=$s workload.rate=$r"); done
done
for b in "${BUDGETS[@]}"; do
  for r in "${RATES[@]}"; do VARIANTS+=(-v "scheduler=continuous scheduler.max_num_batched_tokens=$b workload.rate=$r"); done
done
for r in "${RATES[@]:2}"; do VARIANTS+=(-v "scheduler=slo run.shed=true workload.rate=$r"); done
python -m core compare "${VARIANTS[@]}" workload=chat_longtail workload.arrival=poisson "workload.num_requests=$N" \
  "${EXTRA[@]}" "run.name=$NAME" "run.report_dir=$OUT"
