#!/usr/bin/env bash
# Speculative decoding on the embedded model, each comparison side by side in one run:
#
#   bash benchmarks/spec_decode.sh [OUT_DIR]      (default reports/spec-decode; about 25 minutes on 2 cores)
#
# - batch 1 on the copying workload (code_edit) and on chat_longtail: plain, prompt lookup
#   (ngram) and the self-draft (the target's INT4 copy);
# - decode_heavy (64 running): plain, ngram with its default switch-off, ngram always on;
# - the concurrency sweep on code_edit: plain, ngram always on, ngram by default, at 4, 8, 16 and 32 running.
set -euo pipefail
OUT="${1:-reports/spec-decode}"
NGRAM="decoder=speculative decoder.method=ngram"
SELF="decoder=speculative decoder.method=self"
python -m core compare -v "" -v "$NGRAM" -v "$SELF" workload=code_edit workload.num_requests=6 \
  scheduler.max_num_seqs=1 run.name=batch1-code_edit "run.report_dir=$OUT"
python -m core compare -v "" -v "$NGRAM" -v "$SELF" workload=chat_longtail workload.num_requests=6 \
  scheduler.max_num_seqs=1 run.name=batch1-chat_longtail "run.report_dir=$OUT"
python -m core compare -v "" -v "$NGRAM" -v "$NGRAM decoder.disable_by_batch_size=0" workload=decode_heavy \
  run.name=decode_heavy "run.report_dir=$OUT"
for n in 4 8 16 32; do
  python -m core compare -v "" -v "$NGRAM decoder.disable_by_batch_size=0" -v "$NGRAM" workload=code_edit \
    "workload.num_requests=$((2 * n))" "scheduler.max_num_seqs=$n" "run.name=concurrency-$n-code_edit" \
    "run.report_dir=$OUT"
done
python -m benchmarks.spec_decode_table "$OUT"
