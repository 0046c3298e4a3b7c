#!/usr/bin/env bash
# The same `compare` runs on an earlier commit and on this tree, back to back in one session, so a
# speed-up is a ratio measured on one machine in one hour:
#
#   bash benchmarks/before_after.sh REF OUT_DIR
#
# ONLY=before runs REF's half alone (into OUT, beside an after half already there: a second REF
# measured against the same after half, in the same session).
#
# REF is checked out as a git worktree and installed in place of this tree for its half (the
# plugin entry points are per install), then this tree is installed back. Each half writes
# OUT_DIR/{before,after}/<run>/report.json and a step profile in OUT_DIR/{before,after}/profile-step; `python -m benchmarks.before_after_table OUT_DIR`
# merges them into OUT_DIR/report.md. `extras` adds this tree's own configurations (backend.compile,
# decode steps through the eager forward instead of the native plan, scheduler=slo), reported beside
# the after half's default.
set -euo pipefail
REF="$1"
OUT="$(realpath -m "$2")"
HERE="$(git rev-parse --show-toplevel)"
TREE="$(mktemp -d)/before"
git -C "$HERE" worktree add --detach "$TREE" "$REF" >&2
trap 'python -m pip install -q --no-deps -e "$HERE" >&2; git -C "$HERE" worktree remove --force "$TREE"' EXIT

runs() {  # $1: tree, $2: label
  (cd "$1" && python -m pip install -q --no-deps -e . >&2 &&
    python -m core run workload=decode_heavy run.name=decode_heavy "run.report_dir=$OUT/$2" &&
    python -m core compare -v "" -v "quant=int8" workload=chat_longtail run.name=chat_longtail \
      "run.report_dir=$OUT/$2" &&
    python -m core compare -v "" -v "quant=int8" -v "quant=gguf" workload=fixed workload.num_requests=1 \
      workload.prompt_len=64 workload.output_len=128 run.name=batch1 "run.report_dir=$OUT/$2" &&
    python "$HERE/benchmarks/profile_step.py" --out "$OUT/$2/profile-step")
}
extras() {  # configurations the earlier tree may lack, run on this tree only
  python -m core compare -v "backend.compile=true" -v "backend.native_decode=false" workload=decode_heavy \
    run.name=decode_heavy-extra "run.report_dir=$OUT/after" &&
  python -m core compare -v "quant=gguf backend.native_decode=false" -v "backend.native_decode=false" workload=fixed \
    workload.num_requests=1 workload.prompt_len=64 workload.output_len=128 run.name=batch1-extra \
    "run.report_dir=$OUT/after" &&
  python -m core compare -v "scheduler=slo" -v "scheduler=slo backend.compile=true" workload=chat_longtail \
    run.name=chat_longtail-extra "run.report_dir=$OUT/after"
}
runs "$TREE" before
git -C "$TREE" rev-parse HEAD > "$OUT/before/commit"
[ "${ONLY:-}" = before ] && exit 0  # another REF's half beside an after half already in OUT
runs "$HERE" after
extras
# the tree's own changes, the reports being written excluded (a pathspec outside the repository is an error)
EXCLUDE=()
case "$OUT/" in "$HERE"/*) EXCLUDE=(":(exclude)$OUT") ;; esac
{ git -C "$HERE" rev-parse HEAD; git -C "$HERE" status --short -- . "${EXCLUDE[@]}" | head -1 | sed 's/^/dirty: /'; } > "$OUT/after/commit"
