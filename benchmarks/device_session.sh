#!/usr/bin/env bash
# One device call per phase, sized for the 10-minute limit of a call.
# Usage (repository root, on the GPU machine): benchmarks/device_session.sh PHASE COMMIT [LABEL]
#   suite        every -m cuda test, core and partial first, per folder (about 390 s)
#   memory       memory.py on small and mid three times, then the largest-batch search (about 340 s);
#                MEMORY_RUNS="run1 run2" names the runs, MEMORY_SEARCH=0 leaves the search out;
#                with CUDAGRAPHS_OWNED_GRADS=defer exported (deferred owned gradients), name
#                the runs apart (MEMORY_RUNS="defer1 defer2 defer3"): the JSONs record it
#                under cudagraphs_env
#   fp8          train_fp8.py once (about 230 s on an H200 at batch 1); FP8_BATCH sets --batch,
#                FP8_RECIPES --recipes (default: both)
#   serving      serving_hf.py on Llama without the startup children (about 300 s);
#                INDUCTOR set: with --inductor-config $INDUCTOR (HF's compile and ours alike);
#                PACK_GQA=1: our compiled generator with pack_gqa=True
#   hf_compiled  train_step_hf.py: eager, ours, ours compiled (fused and compiled optimizer
#                step), torch's two compiled recipes; one model is about 370 s on an
#                H200 (HF_MODELS=llama, then HF_MODELS=qwen3_moe: both do not fit a call)
#   hf_stacked   train_step_hf.py on HF_MODELS (default both): ours with eager kernels, ours
#                compiled and ours over cudagraphs.compile_stacked (each with the fused and
#                the compiled optimizer step), torch's reduce-overhead recipe; without
#                max-autotune-no-cudagraphs, whose GEMM autotuning takes 245 s a model
#                and which was slower than reduce-overhead in every run (about 450 s)
#   compute      train_step.py --configs compute_bound --regimes set_to_none, compiled
#                variants (about 370 s)
#   sdpa_probe   probes/serving_compiles.py --backends: where the batch-of-one recompile comes from
#   sdpa_decode  probes/serving_compiles.py --decode: the compiled capture of six buckets and
#                ms per token with and without cuDNN attention, fresh inductor caches
#   sdpa_regional probes/serving_compiles.py --regional: the generator's layers sharing one
#                compiled body against the whole model compiled (fresh inductor caches)
#   confirm      one call for two confirmations (about 480 s on an H200): train_fp8.py at
#                FP8_BATCH (default 4: 8192 tokens a step), tensorwise, without the
#                kernel-busy pass, then serving_hf.py on Llama as in serving (PACK_GQA too)
#   attention    probes/serving_compiles.py --attention: the compiled decode's attention,
#                the default (memory-efficient kernel) against SDPA's math backend, ABAB
#                in fresh processes with empty inductor caches, profiled (about 200 s)
#   stacked      probes/serving_compiles.py --stacked: the compiled decode with its projections
#                stacked (one GEMM per group, the default) against stack_projections=False,
#                ABAB in fresh processes with empty inductor caches, profiled (about 200 s)
#   pack_gqa     probes/serving_compiles.py --pack-gqa: the compiled decode with pack_gqa=True
#                against its default (off), ABAB in fresh processes with empty inductor
#                caches, profiled (about 200 s)
#   compile      probes/compile_phases.py: the compiled generator's cold capture with and
#                without the region schema memo and the early compile workers, each a
#                fresh process with an empty inductor cache (about 150 s)
#   inductor     train_step.py launch_bound, compiled variants, without and then with
#                INDUCTOR (default "triton.enable_pdl=True"), one machine: the node gaps
# PRE_TESTS="tests/a.py tests/b.py" runs those GPU tests (-m cuda, at most PRE_LIMIT s,
# default 200) before any phase, in the same call.
# Wheels the machine lacks go in .wheels-dir (default .whl), installed into /tmp/site
# first. JSONs land in $OUT (or OUT_DIR), logs in $OUT/logs.tgz.
set -u
phase=${1:?usage: benchmarks/device_session.sh PHASE COMMIT [LABEL]}
commit=${2:?usage: benchmarks/device_session.sh PHASE COMMIT [LABEL]}
label=${3:-run1}
out=${OUT:-${OUT_DIR:-/tmp/device-out}}
wheels=${WHEELS:-.whl}
mkdir -p "$out/logs"
if ls "$wheels"/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "$wheels"/*.whl >/dev/null 2>&1 || { echo "wheel install failed"; exit 1; }
    export PYTHONPATH=src:/tmp/site
else
    export PYTHONPATH=src
fi
nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null
common=(--require-gpu --out "$out/" --commit "$commit")
t0=$(date +%s)
say() { echo "== $1 rc=$2 t=$(( $(date +%s) - t0 ))s"; }
bench() {  # bench LOG LIMIT SCRIPT ARGS...
    local log=$1 limit=$2; shift 2
    timeout "$limit" python "$@" > "$out/logs/$log.log" 2>&1
    local rc=$?
    say "$log" "$rc"
    tail -2 "$out/logs/$log.log" | cut -c1-400
}
if [ -n "${PRE_TESTS:-}" ]; then
    # shellcheck disable=SC2086  # PRE_TESTS is a list of paths
    timeout "${PRE_LIMIT:-200}" python -m pytest -q -m cuda -p no:cacheprovider $PRE_TESTS \
        > "$out/logs/pre_tests.log" 2>&1
    say "pre-tests" "$?"
    tail -1 "$out/logs/pre_tests.log"
    grep -E "^(FAILED|ERROR)" "$out/logs/pre_tests.log" | head -8
fi
case $phase in
suite)
    for d in tests/core tests/partial tests/train tests/serving tests/capture tests/program \
        tests/integrations tests/distributed tests/benchmarks "tests/test_*.py"; do
        name=$(echo "$d" | tr '/*.' '___')
        # shellcheck disable=SC2086  # the last entry is a glob
        timeout "${SUITE_LIMIT:-170}" python -m pytest -q -m cuda -p no:cacheprovider $d \
            > "$out/logs/$name.log" 2>&1
        rc=$?
        # pytest's 5 is "nothing collected": a folder without single-GPU tests, not an error
        if [ "$rc" = 5 ]; then echo "== $d: no -m cuda tests collected"; continue; fi
        say "$d" "$rc"
        tail -1 "$out/logs/$name.log"
        grep -E "^(FAILED|ERROR)" "$out/logs/$name.log" | head -8
    done ;;
memory)
    for r in ${MEMORY_RUNS:-run1 run2 run3}; do
        bench "memory-$r" 170 benchmarks/memory.py "${common[@]}" --shapes small,mid --jobs 6 --run-label "$r"
    done
    [ "${MEMORY_SEARCH:-1}" = 0 ] || bench memory-search 200 benchmarks/memory.py "${common[@]}" --shapes "" --search --jobs 6 --run-label search1 ;;
fp8)
    # shellcheck disable=SC2086  # FP8_RECIPES is a list
    bench "fp8-$label" 560 benchmarks/train_fp8.py "${common[@]}" --run-label "$label" \
        --batch "${FP8_BATCH:-1}" --recipes ${FP8_RECIPES:-tensorwise rowwise} ;;
serving)
    extra=()
    # shellcheck disable=SC2206  # INDUCTOR is a list of KEY=VALUE pairs
    if [ -n "${INDUCTOR:-}" ]; then extra=(--inductor-config $INDUCTOR); fi
    if [ -n "${PACK_GQA:-}" ]; then extra+=(--pack-gqa); fi
    bench "serving-$label" 560 benchmarks/serving_hf.py "${common[@]}" --models llama --skip-startup \
        --run-label "$label" "${extra[@]}" ;;
confirm)
    bench "fp8-$label" 210 benchmarks/train_fp8.py "${common[@]}" --run-label "b${FP8_BATCH:-4}$label" \
        --batch "${FP8_BATCH:-4}" --recipes tensorwise --skip-kernel-busy
    extra=()
    if [ -n "${PACK_GQA:-}" ]; then extra+=(--pack-gqa); fi
    bench "serving-$label" 330 benchmarks/serving_hf.py "${common[@]}" --models llama --skip-startup \
        --run-label "$label" "${extra[@]}" ;;
hf_compiled)
    # shellcheck disable=SC2086  # HF_MODELS is a list
    bench "hf-$label" 560 benchmarks/train_step_hf.py "${common[@]}" --run-label "$label" \
        --models ${HF_MODELS:-llama qwen3_moe} --variants \
        cudagraphs_train_step cudagraphs_train_step_compiled cudagraphs_train_step_compiled_optimizer \
        torch_compile_reduce_overhead_compiled_optimizer \
        torch_compile_max_autotune_no_cudagraphs_compiled_optimizer ;;
hf_stacked)
    # shellcheck disable=SC2086  # HF_MODELS is a list
    bench "hf-stacked-$label" 570 benchmarks/train_step_hf.py "${common[@]}" --run-label "$label" \
        --models ${HF_MODELS:-llama qwen3_moe} --variants \
        cudagraphs_train_step cudagraphs_train_step_compiled cudagraphs_train_step_compiled_optimizer \
        cudagraphs_train_step_compiled_stacked cudagraphs_train_step_compiled_stacked_optimizer \
        torch_compile_reduce_overhead_compiled_optimizer ;;
compute)
    bench "compute-$label" 560 benchmarks/train_step.py "${common[@]}" --run-label "$label" \
        --configs compute_bound --regimes set_to_none --variants \
        cudagraphs_train_step cudagraphs_train_step_compiled cudagraphs_train_step_compiled_optimizer \
        torch_compile_reduce_overhead_compiled_optimizer \
        torch_compile_max_autotune_no_cudagraphs_compiled_optimizer ;;
inductor)
    lb=(--configs launch_bound --regimes set_to_none --variants cudagraphs_train_step
        cudagraphs_train_step_compiled cudagraphs_train_step_compiled_optimizer
        torch_compile_reduce_overhead_compiled_optimizer)
    bench "inductor-base-$label" 270 benchmarks/train_step.py "${common[@]}" "${lb[@]}" \
        --run-label "lb-base-$label"
    # shellcheck disable=SC2086  # INDUCTOR is a list of KEY=VALUE pairs
    bench "inductor-set-$label" 270 benchmarks/train_step.py "${common[@]}" "${lb[@]}" \
        --run-label "lb-inductor-$label" --inductor-config ${INDUCTOR:-triton.enable_pdl=True} ;;
compile)
    bench "compile-$label" 400 benchmarks/probes/compile_phases.py --out "$out/" --commit "$commit" ;;
sdpa_probe)
    OUT=$out bench "sdpa-probe" 560 benchmarks/probes/serving_compiles.py --backends ;;
sdpa_decode)
    OUT=$out bench "sdpa-decode" 580 benchmarks/probes/serving_compiles.py --decode ;;
attention)
    OUT=$out bench "attention" 560 benchmarks/probes/serving_compiles.py --attention ;;
stacked)
    OUT=$out bench "stacked" ${STACKED_LIMIT:-560} benchmarks/probes/serving_compiles.py --stacked ;;
pack_gqa)
    OUT=$out bench "pack_gqa" ${STACKED_LIMIT:-560} benchmarks/probes/serving_compiles.py --pack-gqa ;;
sdpa_regional)
    OUT=$out bench "sdpa-regional" 560 benchmarks/probes/serving_compiles.py --regional ;;
*)
    echo "unknown phase $phase"; exit 2 ;;
esac
tar czf "$out/logs.tgz" -C "$out" logs && rm -rf "$out/logs"
