#!/usr/bin/env bash
# Run every benchmark once, writing each JSON into OUT_DIR; keeps going on failure.
# Usage: benchmarks/run_all.sh OUT_DIR [COMMIT]
set -u
out=${1:?usage: benchmarks/run_all.sh OUT_DIR [COMMIT]}
commit=${2:-}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
extra=()
if [ -n "$commit" ]; then extra=(--commit "$commit"); fi
status=0
for bench in train_step program_replay serving_decode partial_train; do
    echo "== $bench" >&2
    if ! timeout 300 python "$here/$bench.py" --require-gpu --out "$out" "${extra[@]}" \
        > "$out/$bench.log" 2>&1; then
        echo "$bench failed (see $out/$bench.log)" >&2
        status=1
    fi
done
exit $status
