#!/usr/bin/env bash
# The ONE command run on the GPU machine (DESIGN §6). Run from the repository root there:
#
#     bash scripts/gpu_check.sh
#
# Needs (built here by scripts/build_wheel.sh and carried): dist/ferroattn-*.whl, optionally
# .whl/*.whl (extra wheels, e.g. nvidia-cuda-crt) and .assets/minilm (demo model files).
# Installs them with pip --no-deps into /tmp/site, then runs, each stage in its own process,
# logging to its own file, with its own time limit, continuing on failure:
#   info, precompile (cold cache, --check-spills), warm (fresh process: first-call cost with the
#   warm cache), demo, bench attention, pytest -m gpu, memcheck, racecheck (the main job first;
#   every stage has a cap and the whole run a budget: a stage that would start with < 20 s left
#   is skipped and recorded as such),
# and finally scripts/gpu_check_summary.py, which writes $OUT/gpu_check.json and prints the
# summary table LAST.
#
# What comes back in $OUT (the device tool returns at most 8 files, so per-stage logs are packed):
#   gpu_check.log        everything printed (this script's whole console output)
#   logs.tar.gz          logs/<stage>.log for every stage, junit.xml, precompile/first-call JSON
#                        (re-packed after every stage, so it survives a kill)
#   demo.json            the demo summary
#   attention_*.json     the raw benchmark JSON
#   gpu_check.json       the summary: device, driver, torch, commit, date, stage exit codes and
#                        durations, test counts, sanitizer results, demo figures, bench summary
#
# Environment knobs: OUT (default ./out), PYTHON (default python3), GPU_CHECK_BUDGET_S (total
# seconds for all stages, default 560), BENCH_ARGS (extra args for the benchmark),
# SANITIZER_FILTER (default "--kernel-name kns=attn_fwd"; empty = check every kernel).
set -u
set -o pipefail

SELF=$(readlink -f "$0")
OUT=${OUT:-$PWD/out}
PY=${PYTHON:-python3}
BUDGET=${GPU_CHECK_BUDGET_S:-560}
RESERVE=20                       # seconds kept for the summary
WORK=/tmp/gpu_check
SITE=/tmp/site
CS=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda*/bin/compute-sanitizer \
     /opt/nvidia/*/compute-sanitizer/compute-sanitizer 2>/dev/null | head -n1)
FILTER=${SANITIZER_FILTER-"--kernel-name kns=attn_fwd"}

# Under the sanitizer: FERROATTN_LINEINFO=1 (kernels compiled with -lineinfo, so reports name
# source lines) and PYTORCH_NO_CUDA_MEMORY_CACHING=1 (every tensor its own cudaMalloc, so an
# out-of-bounds access is not hidden inside a larger cached block).
# ---- stage bodies (run in a child bash through `bash $SELF __fn NAME`, so `timeout` can limit them)
do_install() {
    local whl
    whl=$(ls dist/ferroattn-*.whl 2>/dev/null | head -n1)
    if [ -z "$whl" ]; then echo "no dist/ferroattn-*.whl: build it with scripts/build_wheel.sh and carry dist"; return 1; fi
    rm -rf "$SITE"
    local extra=()
    if ls .whl/*.whl >/dev/null 2>&1; then extra=(.whl/*.whl); fi
    echo "installing $whl ${extra[*]:-} into $SITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$whl" "${extra[@]}"
}

do_info() {
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv || true
    nvidia-smi --query-gpu=driver_version --format=csv,noheader > "$WORK/logs/nvidia_driver.txt" 2>/dev/null || true
    "$PY" -c 'import sys, torch, transformers; print("python", sys.version.split()[0], "| torch", torch.__version__, "cuda", torch.version.cuda, "| transformers", transformers.__version__)'
    echo "compute-sanitizer: ${CS:-not found}"
    local d
    for d in "${CUDA_HOME:-/nonexistent}/include" /usr/local/cuda/include \
             $("$PY" -c 'import nvidia, os; print(" ".join(os.path.join(p, "cu13", "include") for p in nvidia.__path__))' 2>/dev/null); do
        [ -d "$d" ] && echo "include dir $d: cuda_fp16.h $([ -f "$d/cuda_fp16.h" ] && echo yes || echo no), crt/mma.h $([ -f "$d/crt/mma.h" ] && echo yes || echo no)"
    done
    "$PY" -m ferroattn info && "$PY" -m ferroattn info --json > "$WORK/logs/info.json"
}

do_warm() {
    "$PY" -m ferroattn precompile --json "$WORK/logs/precompile_warm.json" && \
    "$PY" scripts/first_call.py --json "$WORK/logs/first_call.json"
}

do_bench() {
    # the benchmark stops starting new grid points 45 s before its stage limit
    local budget=$(( $1 - 45 ))
    [ "$budget" -lt 30 ] && budget=30
    # shellcheck disable=SC2086
    "$PY" -m ferroattn bench attention --out "$OUT" --rep-ms 40 --time-budget-s "$budget" ${BENCH_ARGS:-}
}

do_sanitize() {
    local tool=$1 rc
    if [ -z "$CS" ]; then echo "compute-sanitizer not found on PATH or under /usr/local/cuda*/bin"; return 127; fi
    # shellcheck disable=SC2086
    FERROATTN_LINEINFO=1 PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$CS" --tool "$tool" --error-exitcode 86 --print-limit 30 $FILTER \
        "$PY" scripts/sanitize_attention.py 2>&1 | tee "$WORK/$tool.try1"
    rc=${PIPESTATUS[0]}
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 86 ] && [ -n "$FILTER" ] && \
       grep -qiE "unknown option|unrecognized|invalid (option|argument|value)" "$WORK/$tool.try1"; then
        echo "--- retrying without the kernel filter ($FILTER)"
        FERROATTN_LINEINFO=1 PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$CS" --tool "$tool" --error-exitcode 86 --print-limit 30 "$PY" scripts/sanitize_attention.py
        rc=$?
    fi
    return "$rc"
}

if [ "${1:-}" = "__fn" ]; then
    shift; fn=$1; shift
    "do_$fn" "$@"
    exit $?
fi

# ---- main -------------------------------------------------------------------------------------
T0=$(date +%s)
mkdir -p "$OUT"
rm -rf "$WORK" && mkdir -p "$WORK/logs"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
TEE_PID=$!

export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export FERROATTN_CACHE_DIR="$WORK/kernel-cache"
export OUT PY WORK SITE BUDGET
if [ -z "${FERROATTN_COMMIT:-}" ] && [ -f dist/COMMIT ]; then
    FERROATTN_COMMIT=$(head -n1 dist/COMMIT); export FERROATTN_COMMIT
fi

: > "$WORK/stages.tsv"
pack_logs() { tar -czf "$OUT/logs.tar.gz.tmp" -C "$WORK" logs stages.tsv 2>/dev/null && mv -f "$OUT/logs.tar.gz.tmp" "$OUT/logs.tar.gz"; }

# stage NAME CAP_SECONDS CMD...: run CMD with a time limit of min(CAP, what is left of the budget),
# output to the console and to $WORK/logs/NAME.log; record "NAME rc seconds limit" in stages.tsv.
stage() {
    local name=$1 cap=$2; shift 2
    local now left limit start rc
    now=$(date +%s)
    left=$(( BUDGET - (now - T0) - RESERVE ))
    limit=$cap; [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 20 ]; then
        echo "=== [$name] SKIPPED: time budget used up ($(( now - T0 )) s of $BUDGET s)"
        printf '%s\tskipped\t0\t0\n' "$name" >> "$WORK/stages.tsv"
        return 0
    fi
    echo "=== [$name] (limit ${limit} s) $*"
    start=$(date +%s)
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$WORK/logs/$name.log"
    rc=${PIPESTATUS[0]}
    echo "=== [$name] exit $rc after $(( $(date +%s) - start )) s"
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - start ))" "$limit" >> "$WORK/stages.tsv"
    pack_logs
    return 0
}

echo "=== gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) commit ${FERROATTN_COMMIT:-unknown} budget ${BUDGET} s"
stage install 120 bash "$SELF" __fn install
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
# NVRTC gets one CUDA include directory. /usr/local/cuda/include (toolkit) has crt/mma.h; torch's
# site-packages nvidia/cu13/include does not, and the carried nvidia-cuda-crt wheel lands in a
# separate $SITE/nvidia/cu13/include. Without a toolkit, merge both into one directory.
if [ -z "${CUDA_HOME:-}" ] && [ ! -f /usr/local/cuda/include/crt/mma.h ] && [ -f "$SITE/nvidia/cu13/include/crt/mma.h" ]; then
    sys_inc=$("$PY" -c 'import nvidia, os; print(next((os.path.join(p, "cu13", "include") for p in nvidia.__path__ if os.path.isfile(os.path.join(p, "cu13", "include", "cuda_fp16.h"))), ""))' 2>/dev/null)
    if [ -n "$sys_inc" ]; then
        mkdir -p "$WORK/cuda-home/include"
        cp -r "$sys_inc/." "$WORK/cuda-home/include/" && cp -r "$SITE/nvidia/cu13/include/crt" "$WORK/cuda-home/include/"
        export CUDA_HOME="$WORK/cuda-home"
        echo "CUDA_HOME=$CUDA_HOME (merged $sys_inc + nvidia-cuda-crt)"
    fi
fi
stage info 60 bash "$SELF" __fn info
stage precompile 200 "$PY" -m ferroattn precompile --check-spills --json "$WORK/logs/precompile.json"
stage warm 45 bash "$SELF" __fn warm
stage demo 120 "$PY" -m ferroattn demo --minilm .assets/minilm --json "$OUT/demo.json"
stage profile 60 "$PY" scripts/profile_llm_attention.py
# the benchmark gets what is left after keeping 300 s for pytest and the sanitizers (at most 200 s)
now=$(date +%s); bench_limit=$(( BUDGET - (now - T0) - RESERVE - 300 )); [ "$bench_limit" -gt 200 ] && bench_limit=200
[ "$bench_limit" -lt 90 ] && bench_limit=90
left=$(( BUDGET - (now - T0) - RESERVE )); [ "$bench_limit" -gt "$left" ] && bench_limit=$left
stage bench "$bench_limit" bash "$SELF" __fn bench "$bench_limit"
stage pytest 180 "$PY" -m pytest -m gpu -q -p no:cacheprovider --junitxml="$WORK/logs/junit.xml" tests
stage memcheck 75 bash "$SELF" __fn sanitize memcheck
stage racecheck 90 bash "$SELF" __fn sanitize racecheck

# ---- summary (printed last) -------------------------------------------------------------------
pack_logs
"$PY" scripts/gpu_check_summary.py --work "$WORK" --out "$OUT" --elapsed $(( $(date +%s) - T0 ))
rc=$?
exec 1>&- 2>&-
wait "$TEE_PID" 2>/dev/null
exit "$rc"
