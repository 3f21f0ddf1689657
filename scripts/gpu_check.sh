#!/usr/bin/env bash
# The ONE command run on the GPU machine (DESIGN §6). Run from the repository root there:
#
#     bash scripts/gpu_check.sh
#
# Needs (built here by scripts/build_wheel.sh and carried): dist/ferroattn-*.whl, optionally
# .whl/*.whl (extra wheels, e.g. nvidia-cuda-crt) and .assets/minilm (demo model files).
# Installs them with pip --no-deps into /tmp/site, then runs, each stage in its own process,
# logging to its own file, with its own time limit, continuing on failure (in this order):
#   install, info, precompile (cold cache, --check-spills), warm (fresh process: first-call cost
#   with the warm cache), demo, profile (scripts/profiler_overhead.py: what ferroattn.profiler costs a Llama-1B forward, per part;
#   $OUT/profiler_overhead.json), notebooks (scripts/run_notebooks.py: notebooks/*.ipynb
#   executed top to bottom with nbclient; needs the nbclient/ipykernel wheels in .whl; run it
#   after precompile, or the notebooks pay the JIT compilation), train (`bench training`:
#   Llama-3.2-1B-config training ferroattn vs sdpa, step-0 gradients vs fp32, attention peak
#   memory at 16k), host (scripts/host_time_breakdown.py: the host time of small eager calls
#   against SDPA's), bench (`bench attention`, forward), bench_bwd (`bench attention --backward`),
#   bench_decode (`bench decode`; BENCH_DECODE_ARGS), bench_generate (`bench generate`; BENCH_GENERATE_ARGS), bench_gemm (`bench gemm`), bench_sparse24 (`bench sparse24`), pytest -m gpu, fa2
#   (flash-attention's own tests/test_flash_attn.py run against ferroattn through .fa2suite/run.sh,
#   a deterministic sample of FA2_CORE / FA2_REST cases per test function; opt-in: runs only when
#   named in GPU_CHECK_STAGES, and needs .fa2suite carried, made here by
#   `scripts/fa2suite.sh FA2_GIT_DIR`), memcheck, racecheck and
#   synccheck (scripts/sanitize_attention.py, scripts/sanitize_kvcache.py,
#   scripts/sanitize_attention_bwd.py, then scripts/sanitize_gemm.py, the last without a kernel
#   filter, under compute-sanitizer; racecheck checks every kernel and counts hazards in ours). Every stage has a cap and the
#   whole run a budget: a stage that would start with < 20 s left is skipped and recorded as
#   such; notebooks, the bench stages and fa2 size themselves to what is left after keeping time
#   for the selected stages after them.
# and finally scripts/gpu_check_summary.py, which writes $OUT/gpu_check.json and prints the
# summary table LAST.
#
# One device call may run at most 600 s, and everything no longer fits in one: run a subset with
# GPU_CHECK_STAGES (comma-separated stage names; install runs whenever anything after it runs is
# selected, so it need not be named). The usual split, two calls of <= 560 s each:
#     GPU_CHECK_STAGES=info,precompile,warm,demo,profile,bench,pytest bash scripts/gpu_check.sh
#     GPU_CHECK_STAGES=info,train,bench_bwd,memcheck,racecheck bash scripts/gpu_check.sh
# and flash-attention's suite (carry .fa2suite, made by scripts/fa2suite.sh; precompile first so
# the suite does not pay the JIT compilation):
#     GPU_CHECK_STAGES=info,precompile,fa2 bash scripts/gpu_check.sh
# Each call is self-contained (fresh kernel cache, its own $OUT and gpu_check.json);
# `scripts/gpu_check_summary.py --merge A/gpu_check.json B/gpu_check.json --out DIR` joins two.
#
# What comes back in $OUT (the device tool returns at most 8 files, so per-stage logs are packed):
#   gpu_check.log        everything printed (this script's whole console output)
#   logs.tar.gz          logs/<stage>.log for every stage, junit.xml, precompile/first-call JSON
#                        (re-packed after every stage, so it survives a kill)
#   demo.json            the demo summary
#   attention_*.json     the raw forward-benchmark JSON
#   attention_bwd_*.json the raw backward-benchmark JSON
#   training_*.json      the training comparison (losses, gradient errors, memory)
#   fa2_summary.json     flash-attention's suite: per test function and surface (core / rest)
#                        passed/failed/skipped, top failure messages (its junit XML and log are
#                        logs/fa2.xml and logs/fa2_suite.log in logs.tar.gz)
#   notebooks.tar.gz     notebooks/*.ipynb as executed (outputs and plots; a failed one up to its
#                        error); per-notebook PASS/FAIL and times in logs/notebooks.json
#   gpu_check.json       the summary: device, driver, torch, commit, date, stage exit codes and
#                        durations, test counts, sanitizer results, demo figures, bench summaries,
#                        training verdicts and figures
#
# Environment knobs: OUT (default ./out), PYTHON (default python3), GPU_CHECK_BUDGET_S (total
# seconds for all stages, default 560), GPU_CHECK_STAGES (default: all), BENCH_ARGS / BENCH_BWD_ARGS /
# TRAIN_ARGS (extra args for the forward benchmark / backward benchmark / training comparison),
# PYTEST_TARGETS (pytest stage: test paths, default "tests"), PYTEST_ARGS (pytest stage: extra pytest arguments), PYTEST_WORKERS (pytest stage: pytest-xdist workers,
# default 0 = one process; the timing files of SERIAL_TESTS then run alone afterwards), FA2_CORE / FA2_REST (fa2 stage: cases
# sampled per test function inside / outside flash_attn's old core surface, default 40 / 40), FA2_WORKERS (fa2 stage: pytest-xdist
# worker processes, default 14, 0 = none), FA2_ARGS (extra
# pytest arguments of the fa2 stage, e.g. "-k kvcache"), BENCH_DECODE_ARGS (bench decode), NOTEBOOKS (notebook paths for the notebooks
# stage, default all), SANITIZE_SCRIPTS (the sanitizer stages' scripts, default all four),
# GPU_CHECK_CAP_<STAGE> (a stage's cap in seconds, e.g. GPU_CHECK_CAP_FA2=480),
# GPU_CHECK_SAVE_CACHE=1 (pack the kernel cache into $OUT for the next call: see do_cache_pack),
# GPU_CHECK_KERNEL_CACHE (kernel cache dir, default a fresh one under /tmp/gpu_check; a dir outside it
# survives into the next call on a still-warm machine), BENCH_GEMM_ARGS / BENCH_SPARSE24_ARGS, SANITIZER_FILTER (default "--kernel-name kns=attn_": our attn_fwd_*, attn_bwd_*, attn_split_combine and attn_kv_append kernels; memcheck only: racecheck takes RACECHECK_FILTER, default none, and counts hazards in our kernels only;
# empty = check every kernel).
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
FILTER=${SANITIZER_FILTER-"--kernel-name kns=attn_"}
ALL_STAGES="install info precompile warm demo profile notebooks train host bench bench_bwd bench_decode bench_generate bench_gemm bench_sparse24 pytest fa2 memcheck racecheck synccheck"
OPT_IN_STAGES="fa2"              # run only when named in GPU_CHECK_STAGES (not part of "all")
STAGES=${GPU_CHECK_STAGES:-all}
STAGES=${STAGES// /}
# Stage caps (seconds) and what an elastic stage (notebooks, bench, bench_bwd, bench_gemm,
# bench_sparse24, fa2) keeps free for each selected stage after it.
declare -A CAP=([install]=120 [info]=60 [precompile]=200 [warm]=45 [demo]=120 [profile]=90 [notebooks]=400 [train]=180 [host]=60
                [bench]=200 [bench_bwd]=330 [bench_decode]=240 [bench_generate]=150 [bench_gemm]=240 [bench_sparse24]=200 [pytest]=300 [fa2]=240
                [memcheck]=150 [racecheck]=180 [synccheck]=150)
declare -A KEEP=([train]=120 [bench]=90 [bench_bwd]=200 [bench_decode]=90 [bench_gemm]=90 [bench_sparse24]=90 [pytest]=200 [fa2]=120
                 [memcheck]=100 [racecheck]=80 [synccheck]=60)
# GPU_CHECK_CAP_<STAGE> (upper-case stage name, e.g. GPU_CHECK_CAP_FA2=480) overrides a stage's cap
for _n in "${!CAP[@]}"; do
    _v="GPU_CHECK_CAP_${_n^^}"
    [ -n "${!_v:-}" ] && CAP[$_n]=${!_v}
done

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

do_host() {  # where the host time of one small eager call goes (scripts/host_time_breakdown.py)
    "$PY" scripts/host_time_breakdown.py --out "$OUT"
}

do_bench_decode() {
    # the decode benchmark stops starting new points 45 s before its stage limit
    local budget=$(( $1 - 45 ))
    [ "$budget" -lt 30 ] && budget=30
    # shellcheck disable=SC2086
    "$PY" -m ferroattn bench decode --out "$OUT" --time-budget-s "$budget" ${BENCH_DECODE_ARGS:-}
}

do_bench_bwd() {
    # the backward benchmark stops starting new configurations 45 s before its stage limit
    local budget=$(( $1 - 45 ))
    [ "$budget" -lt 30 ] && budget=30
    # shellcheck disable=SC2086
    "$PY" -m ferroattn bench attention --backward --out "$OUT" --rep-ms 40 --time-budget-s "$budget" ${BENCH_BWD_ARGS:-}
}

do_bench_generate() {  # do_bench_generate: transformers generate, ferroattn vs sdpa (python -m ferroattn bench generate)
    # shellcheck disable=SC2086
    "$PY" -m ferroattn bench generate --out "$OUT" ${BENCH_GENERATE_ARGS:-}
}

do_bench_gemm() {  # do_bench_gemm LIMIT: dense GEMM vs cuBLAS (python -m ferroattn bench gemm)
    local budget=$(( $1 - 45 ))
    [ "$budget" -lt 30 ] && budget=30
    # shellcheck disable=SC2086
    "$PY" -m ferroattn bench gemm --out "$OUT" --time-budget-s "$budget" ${BENCH_GEMM_ARGS:-}
}

do_bench_sparse24() {  # do_bench_sparse24 LIMIT: 2:4 sparse vs cuBLAS dense and cuSPARSELt
    local budget=$(( $1 - 45 ))
    [ "$budget" -lt 30 ] && budget=30
    # shellcheck disable=SC2086
    "$PY" -m ferroattn bench sparse24 --out "$OUT" --time-budget-s "$budget" ${BENCH_SPARSE24_ARGS:-}
}

do_notebooks() {
    # run_notebooks.py stops starting cells 30 s before the stage limit ($1), so the executed copies
    # are always written; they are packed into ONE file (the device tool returns at most 8 files).
    local budget=$(( $1 - 30 )) rc
    [ "$budget" -lt 30 ] && budget=30
    rm -rf "$OUT/notebooks" "$OUT/notebooks.tar.gz"
    # shellcheck disable=SC2086
    "$PY" scripts/run_notebooks.py ${NOTEBOOKS:-} --out "$OUT/notebooks" --budget-s "$budget" --cell-timeout 300 \
        --json "$WORK/logs/notebooks.json"
    rc=$?
    if [ -d "$OUT/notebooks" ]; then
        tar -czf "$OUT/notebooks.tar.gz" -C "$OUT" notebooks && rm -rf "$OUT/notebooks"
    fi
    return "$rc"
}

do_train() {
    local minilm=()
    [ -d .assets/minilm ] && minilm=(--minilm .assets/minilm)
    # shellcheck disable=SC2086
    "$PY" -m ferroattn bench training --out "$OUT" "${minilm[@]}" ${TRAIN_ARGS:-}
}

do_fa2() {  # do_fa2 LIMIT: flash-attention's tests/test_flash_attn.py through .fa2suite/run.sh
    # The suite gets LIMIT - 30 s; then pytest is interrupted (SIGINT: it still writes the junit
    # XML of the cases run so far) and run.sh summarises what ran. Exit code: 124 when the budget
    # ran out (the summary covers the cases that ran), run.sh's when pytest did not finish
    # normally (2 interrupted, 3-5 internal/usage/collection errors), else 1 when a case inside the
    # core surface failed and 0 otherwise: cases outside it (features not implemented yet) are
    # counted in fa2_summary.json / gpu_check.json, not in the exit code.
    local budget=$(( $1 - 30 )) rc core_failed res="$OUT/fa2"
    [ "$budget" -lt 30 ] && budget=30
    if [ ! -f .fa2suite/run.sh ] || [ ! -f .fa2suite/test_flash_attn.py ]; then
        echo "no .fa2suite/run.sh + .fa2suite/test_flash_attn.py: make it on the development machine with"
        echo "scripts/fa2suite.sh FA2_GIT_DIR and carry .fa2suite"
        return 2
    fi
    python3 -c 'import einops' 2>/dev/null || echo "warning: einops not importable (flash-attention's tests import it)"
    rm -rf "$res" "$OUT/fa2_summary.json"
    echo "fa2: FA2_CORE=${FA2_CORE:-40} FA2_REST=${FA2_REST:-40}, pytest budget ${budget} s"
    # pytest-xdist (in the GPU image) runs the cases and their first-call JIT compilations in
    # FA2_WORKERS processes (default 14; 0 = one process): the 40/40 sample takes ~140 s, not hours
    local workers=()
    if [ "${FA2_WORKERS:-14}" != 0 ] && python3 -c 'import xdist' 2>/dev/null; then workers=(-n "${FA2_WORKERS:-14}"); fi
    echo "fa2: pytest workers: ${workers[*]:-none}"
    FA2_CORE=${FA2_CORE:-40} FA2_REST=${FA2_REST:-40} timeout -s INT -k 20 "$budget" bash .fa2suite/run.sh "$res" "${workers[@]}" ${FA2_ARGS:-}
    rc=$?
    # at most 8 files come back: the summary at the top level, the XML and the log in logs.tar.gz
    [ -f "$res/fa2_summary.json" ] && cp -f "$res/fa2_summary.json" "$OUT/fa2_summary.json"
    [ -f "$res/fa2.xml" ] && cp -f "$res/fa2.xml" "$WORK/logs/fa2.xml"
    [ -f "$res/fa2.log" ] && cp -f "$res/fa2.log" "$WORK/logs/fa2_suite.log"
    [ -f "$res/fa2.log" ] && tail -n 5 "$res/fa2.log"
    [ -f "$res/fa2_summary.json" ] && python3 -c 'import json, sys; print("fa2 totals:", json.load(open(sys.argv[1]))["total"])' "$res/fa2_summary.json"
    printf '{"rc": %s, "fa2_core": %s, "fa2_rest": %s, "budget_s": %s}\n' "$rc" "${FA2_CORE:-40}" "${FA2_REST:-40}" \
        "$budget" > "$WORK/logs/fa2_meta.json"
    rm -rf "$res"
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 1 ]; then return "$rc"; fi
    [ -f "$OUT/fa2_summary.json" ] || { echo "fa2: no fa2_summary.json"; return 2; }
    core_failed=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["total"].get("core_failed", 0))' \
                  "$OUT/fa2_summary.json") || return 2
    [ "$core_failed" = 0 ]
}

# GPU test files (or node ids) whose figures are timings or device-wide memory readings: never run
# beside others
SERIAL_TESTS="tests/test_gpu_profiler.py tests/test_gpu_training.py tests/test_gpu.py::test_dlpack_buffer_cuda_consumed_by_torch_no_leak"

do_pytest() {  # pytest -m gpu over PYTEST_TARGETS; with PYTEST_WORKERS > 0 (pytest-xdist) in parallel,
    # except the timing files of SERIAL_TESTS, which then run alone afterwards (junit_serial.xml)
    local targets=(${PYTEST_TARGETS:-tests}) rc=0 rc2=0 f t
    # -rfE: the failures' names in the summary; with workers, -v names each case as it ends, so a
    # run cut by its cap still says which case failed
    local common=(-m gpu -rfE -p no:cacheprovider ${PYTEST_ARGS:-})
    if [ "${PYTEST_WORKERS:-0}" = 0 ] || ! "$PY" -c 'import xdist' 2>/dev/null; then
        FERROATTN_RESULTS_DIR="$OUT" "$PY" -m pytest "${common[@]}" -q --junitxml="$WORK/logs/junit.xml" "${targets[@]}"
        return
    fi
    local parallel=() serial=() ignore=()
    for t in "${targets[@]}"; do
        case " $SERIAL_TESTS " in *" $t "*) serial+=("$t"); continue ;; esac
        parallel+=("$t")
        for f in $SERIAL_TESTS; do
            if [[ "$f" == "$t"/* || "$f" == "$t"::* ]]; then
                serial+=("$f")
                if [[ "$f" == *::* ]]; then ignore+=(--deselect="$f"); else ignore+=(--ignore="$f"); fi
            fi
        done
    done
    echo "pytest: ${PYTEST_WORKERS} workers over ${parallel[*]:-nothing} ${ignore[*]:-}; then alone: ${serial[*]:-nothing}"
    if [ "${#parallel[@]}" -gt 0 ]; then
        FERROATTN_RESULTS_DIR="$OUT" "$PY" -m pytest "${common[@]}" -v -n "$PYTEST_WORKERS" --junitxml="$WORK/logs/junit.xml" \
            "${ignore[@]}" "${parallel[@]}"
        rc=$?
    fi
    if [ "${#serial[@]}" -gt 0 ]; then
        FERROATTN_RESULTS_DIR="$OUT" "$PY" -m pytest "${common[@]}" -q --junitxml="$WORK/logs/junit_serial.xml" "${serial[@]}"
        rc2=$?
    fi
    [ "$rc" -ne 0 ] && return "$rc"
    return "$rc2"
}

sanitize_one() {  # sanitize_one TOOL SCRIPT [FILTER]: run SCRIPT under compute-sanitizer TOOL
    local tool=$1 script=$2 rc
    local FILTER=${3-$FILTER}
    # shellcheck disable=SC2086
    FERROATTN_LINEINFO=1 PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$CS" --tool "$tool" --error-exitcode 86 --print-limit 30 $FILTER \
        "$PY" "$script" 2>&1 | tee "$WORK/$tool.try1"
    rc=${PIPESTATUS[0]}
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 86 ] && [ -n "$FILTER" ] && \
       grep -qiE "unknown option|unrecognized|invalid (option|argument|value)" "$WORK/$tool.try1"; then
        echo "--- retrying without the kernel filter ($FILTER)"
        FERROATTN_LINEINFO=1 PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$CS" --tool "$tool" --error-exitcode 86 --print-limit 30 "$PY" "$script"
        rc=$?
    fi
    return "$rc"
}

do_sanitize() {
    # forward cases, then backward cases; the stage's exit code is the first non-zero one
    local tool=$1 rc=0 r script
    if [ -z "$CS" ]; then echo "compute-sanitizer not found on PATH or under /usr/local/cuda*/bin"; return 127; fi
    for script in ${SANITIZE_SCRIPTS:-scripts/sanitize_attention.py scripts/sanitize_kvcache.py scripts/sanitize_attention_bwd.py scripts/sanitize_gemm.py}; do
        echo "--- $tool: $script"
        if [ "$script" = scripts/sanitize_gemm.py ]; then
            sanitize_one "$tool" "$script" "${GEMM_SANITIZER_FILTER-}"   # every kernel it launches
        elif [ "$tool" = racecheck ]; then
            # racecheck with a kernel filter faults inside the sanitizer on our TMA / mbarrier kernels
            # ("failed to handle a hardware exception"; memcheck and synccheck don't): every kernel is
            # checked, and hazards count only in ours (attn_*), not in the references' cuBLAS kernels
            sanitize_one "$tool" "$script" "${RACECHECK_FILTER-}"
            r=$?
            if [ "$r" -eq 86 ] && ! grep -qE "Internal Sanitizer Error" "$WORK/$tool.try1" && \
               ! grep -E "Race reported between" "$WORK/$tool.try1" | grep -qE " at [^ ]*attn_"; then
                echo "--- $tool: $script: hazards only in kernels not ours: $(grep -oE 'Race reported between [A-Za-z]+ access at [^ +]+' "$WORK/$tool.try1" | awk '{print $NF}' | sort -u | tr '\n' ' ')"
                r=0
            fi
            (exit "$r")
        else
            sanitize_one "$tool" "$script"
        fi
        r=$?
        echo "--- $tool: $script exit $r"
        [ "$rc" -eq 0 ] && rc=$r
    done
    return "$rc"
}

# The kernel cache between calls: a fresh GPU machine compiles every kernel again (the precompile
# stage, ~80-100 s of device time). With GPU_CHECK_SAVE_CACHE=1 the run ends by packing the cache
# into $OUT/kernel-cache.tar.xz.N (parts of at most 15 MiB, at most 4); copy those parts into
# .kernel-cache/ of the checkout (git-ignored) and carry it: the next call unpacks it before its
# first stage, and precompile then loads instead of compiling (a cache entry whose key no longer
# matches, after a kernel source or NVRTC change, is simply not used).
CACHE_PARTS_MAX=4
do_cache_pack() {  # do_cache_pack DIR DEST: DIR's files as DEST.tar.xz.0, .1, ... (parts of
    # GPU_CHECK_CACHE_PART_MIB, default 15: what comes back from $OUT is at most 16 MiB a file)
    local dir=$1 dest=$2 n
    rm -f "$dest".tar.xz.*
    [ -d "$dir" ] || { echo "cache_pack: no kernel cache at $dir"; return 1; }
    XZ_OPT="-T0 -6" tar -cJf - -C "$dir" . | split -b "${GPU_CHECK_CACHE_PART_MIB:-15}m" -d -a 1 - "$dest.tar.xz."
    n=$(ls "$dest".tar.xz.* 2>/dev/null | wc -l)
    if [ "$n" -gt "$CACHE_PARTS_MAX" ]; then
        rm -f "$dest".tar.xz.*
        echo "cache_pack: the kernel cache packs into $n parts (> $CACHE_PARTS_MAX): not saved"
        return 1
    fi
    echo "cache_pack: $(du -sh "$dir" | cut -f1) of kernel cache in $n part(s): $(ls "$dest".tar.xz.* | xargs -n1 basename | tr '\n' ' ')"
}
do_cache_unpack() {  # do_cache_unpack SRC_DIR DIR: the parts in SRC_DIR unpacked into DIR
    local src=$1 dir=$2
    ls "$src"/kernel-cache.tar.xz.* >/dev/null 2>&1 || return 0
    mkdir -p "$dir"
    cat "$src"/kernel-cache.tar.xz.* | tar -xJf - -C "$dir" \
        && echo "cache_unpack: $(find "$dir" -type f | wc -l) files into $dir"
}

selected() {  # selected NAME: is stage NAME in GPU_CHECK_STAGES (install: whenever anything is)?
    if [ "$STAGES" = all ]; then
        case " $OPT_IN_STAGES " in *" $1 "*) return 1 ;; esac
        return 0
    fi
    [ "$1" = install ] && return 0
    case ",$STAGES," in *",$1,"*) return 0 ;; esac
    return 1
}

check_stage_names() {  # every name in GPU_CHECK_STAGES must be a stage
    [ "$STAGES" = all ] && return 0
    local n bad=() names
    IFS=',' read -r -a names <<< "$STAGES"
    for n in "${names[@]}"; do
        n=${n// /}
        [ -z "$n" ] && continue
        case " $ALL_STAGES " in *" $n "*) ;; *) bad+=("$n") ;; esac
    done
    if [ "${#bad[@]}" -gt 0 ]; then
        echo "GPU_CHECK_STAGES: unknown stage(s) ${bad[*]}; expected comma-separated names from: ${ALL_STAGES// /,} (or all)" >&2
        return 2
    fi
}

keep_after() {  # keep_after NAME: seconds to keep free for the selected stages after NAME
    local n seen=0 sum=0
    for n in $ALL_STAGES; do
        if [ "$seen" = 1 ] && selected "$n" && [ -n "${KEEP[$n]:-}" ]; then sum=$(( sum + KEEP[$n] )); fi
        [ "$n" = "$1" ] && seen=1
    done
    echo "$sum"
}

elastic_limit() {  # elastic_limit NAME: min(cap, what is left - keep_after NAME), at least 90, at most what is left
    local name=$1 now left lim
    now=$(date +%s)
    left=$(( BUDGET - (now - T0) - RESERVE ))
    lim=$(( left - $(keep_after "$name") ))
    [ "$lim" -gt "${CAP[$name]}" ] && lim=${CAP[$name]}
    [ "$lim" -lt 90 ] && lim=90
    [ "$lim" -gt "$left" ] && lim=$left
    echo "$lim"
}

if [ "${1:-}" = "__fn" ]; then
    shift; fn=$1; shift
    "do_$fn" "$@"
    exit $?
fi
if [ "${1:-}" = "--list-stages" ]; then  # print the stages this GPU_CHECK_STAGES selects (no GPU needed)
    check_stage_names || exit 2
    for n in $ALL_STAGES; do selected "$n" && echo "$n"; done
    exit 0
fi
check_stage_names || exit 2

# ---- main -------------------------------------------------------------------------------------
T0=$(date +%s)
mkdir -p "$OUT"
rm -rf "$WORK" && mkdir -p "$WORK/logs"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
TEE_PID=$!

export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export FERROATTN_CACHE_DIR="${GPU_CHECK_KERNEL_CACHE:-$WORK/kernel-cache}"
export OUT PY WORK SITE BUDGET
if [ -z "${FERROATTN_COMMIT:-}" ] && [ -f dist/COMMIT ]; then
    FERROATTN_COMMIT=$(head -n1 dist/COMMIT); export FERROATTN_COMMIT
fi

: > "$WORK/stages.tsv"
[ -d .kernel-cache ] && { do_cache_unpack .kernel-cache "$FERROATTN_CACHE_DIR" || echo "cache_unpack: failed (the kernels compile as usual)"; }
pack_logs() { tar -czf "$OUT/logs.tar.gz.tmp" -C "$WORK" logs stages.tsv 2>/dev/null && mv -f "$OUT/logs.tar.gz.tmp" "$OUT/logs.tar.gz"; }

# stage NAME CAP_SECONDS CMD...: run CMD with a time limit of min(CAP, what is left of the budget),
# output to the console and to $WORK/logs/NAME.log; record "NAME rc seconds limit" in stages.tsv.
stage() {
    local name=$1 cap=$2; shift 2
    local now left limit start rc
    selected "$name" || return 0
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

echo "=== gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) commit ${FERROATTN_COMMIT:-unknown} budget ${BUDGET} s stages ${STAGES}"
stage install "${CAP[install]}" bash "$SELF" __fn install
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
stage info "${CAP[info]}" bash "$SELF" __fn info
stage precompile "${CAP[precompile]}" "$PY" -m ferroattn precompile --check-spills --json "$WORK/logs/precompile.json"
stage warm "${CAP[warm]}" bash "$SELF" __fn warm
stage demo "${CAP[demo]}" "$PY" -m ferroattn demo --minilm .assets/minilm --json "$OUT/demo.json"
stage profile "${CAP[profile]}" "$PY" scripts/profiler_overhead.py
# the notebooks get min(cap, what is left after keeping time for the selected stages after them)
if selected notebooks; then lim=$(elastic_limit notebooks); stage notebooks "$lim" bash "$SELF" __fn notebooks "$lim"; fi
stage train "${CAP[train]}" bash "$SELF" __fn train
stage host "${CAP[host]}" bash "$SELF" __fn host
# the benchmarks get what is left after keeping time for the selected stages after them (capped)
if selected bench; then lim=$(elastic_limit bench); stage bench "$lim" bash "$SELF" __fn bench "$lim"; fi
if selected bench_bwd; then lim=$(elastic_limit bench_bwd); stage bench_bwd "$lim" bash "$SELF" __fn bench_bwd "$lim"; fi
if selected bench_decode; then lim=$(elastic_limit bench_decode); stage bench_decode "$lim" bash "$SELF" __fn bench_decode "$lim"; fi
stage bench_generate "${CAP[bench_generate]}" bash "$SELF" __fn bench_generate
if selected bench_gemm; then lim=$(elastic_limit bench_gemm); stage bench_gemm "$lim" bash "$SELF" __fn bench_gemm "$lim"; fi
if selected bench_sparse24; then lim=$(elastic_limit bench_sparse24); stage bench_sparse24 "$lim" bash "$SELF" __fn bench_sparse24 "$lim"; fi
stage pytest "${CAP[pytest]}" bash "$SELF" __fn pytest
# flash-attention's suite: min(cap, what is left after keeping time for the selected stages after it)
if selected fa2; then lim=$(elastic_limit fa2); stage fa2 "$lim" bash "$SELF" __fn fa2 "$lim"; fi
stage memcheck "${CAP[memcheck]}" bash "$SELF" __fn sanitize memcheck
stage racecheck "${CAP[racecheck]}" bash "$SELF" __fn sanitize racecheck
stage synccheck "${CAP[synccheck]}" bash "$SELF" __fn sanitize synccheck

# ---- summary (printed last) -------------------------------------------------------------------
[ "${GPU_CHECK_SAVE_CACHE:-0}" = 1 ] && do_cache_pack "$FERROATTN_CACHE_DIR" "$OUT/kernel-cache"
pack_logs
"$PY" scripts/gpu_check_summary.py --work "$WORK" --out "$OUT" --elapsed $(( $(date +%s) - T0 )) --stages "$STAGES"
rc=$?
exec 1>&- 2>&-
wait "$TEE_PID" 2>/dev/null
exit "$rc"
