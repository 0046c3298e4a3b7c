#!/usr/bin/env bash
# Speculative decoding on the embedded model, each comparison side by side in one run:
#
#   bash benchmarks/spec_decode.sh [OUT_DIR]      (default reports/spec-decode; about 30 minutes on 2 cores)
#
# - batch 1 on the copying workload (code_edit) and on chat_longtail: plain, prompt lookup
#   (ngram) and the self-draft (the target's INT4 copy);
# - 32 at once on code_edit: plain, ngram with its default switch-off under load, and ngram never
#   switched off, to show where speculation stops paying;
# - the concurrency sweep of ngram (always on) against plain at 1, 4, 8 and 16 running.
set -euo pipefail
OUT="${1:-reports/spec-decode}"
NGRAM="decoder=speculative decoder.method=ngram"
SELF="decoder=speculative decoder.method=self"
python -m core compare -v "" -v "$NGRAM" -v "$SELF" workload=code_edit workload.num_requests=6 \
  scheduler.max_num_seqs=1 run.name=batch1-code_edit "run.report_dir=$OUT"
python -m core compare -v "" -v "$NGRAM" -v "$SELF" workload=chat_longtail workload.num_requests=6 \
  scheduler.max_num_seqs=1 run.name=batch1-chat_longtail "run.report_dir=$OUT"
for n in 4 8 16 32; do
  python -m core compare -v "" -v "$NGRAM decoder.disable_by_batch_size=0" -v "$NGRAM" workload=code_edit \
    "workload.num_requests=$((2 * n))" "scheduler.max_num_seqs=$n" "run.name=concurrency-$n-code_edit" \
    "run.report_dir=$OUT"
done
python -m benchmarks.spec_decode_table "$OUT"
