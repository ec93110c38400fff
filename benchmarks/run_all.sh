#!/usr/bin/env bash
# Run every benchmark once, writing each JSON into OUT_DIR; keeps going on failure.
# Usage: benchmarks/run_all.sh OUT_DIR [COMMIT] [RUN_LABEL]
#   COMMIT: recorded where the checkout's .git is missing or stale (the GPU machine);
#   RUN_LABEL: suffix of the file names, for repeated runs of one commit (run2, ...).
set -u
out=${1:?usage: benchmarks/run_all.sh OUT_DIR [COMMIT] [RUN_LABEL]}
commit=${2:-}
label=${3:-}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
extra=()
if [ -n "$commit" ]; then extra+=(--commit "$commit"); fi
if [ -n "$label" ]; then extra+=(--run-label "$label"); fi
status=0
for bench in train_step train_step_hf train_fp8 program_replay serving_decode partial_train trainer_callback; do
    echo "== $bench" >&2
    limit=300
    case $bench in train_fp8) limit=560 ;; esac  # its kernel-busy phase alone can pass 200 s
    if ! timeout "$limit" python "$here/$bench.py" --require-gpu --out "$out/" "${extra[@]}" \
        > "$out/$bench${label:+-$label}.log" 2>&1; then
        echo "$bench failed (see $out/$bench${label:+-$label}.log)" >&2
        status=1
    fi
done
exit $status
