#!/usr/bin/env bash
# The GPU check: runs prebuilt hmoe binaries on a machine with an NVIDIA GPU and no Rust
# toolchain (built here by scripts/build-gpu-check.sh). Every step runs whatever the previous
# ones did, and the report at the end gives each step's exit status.
#
# Where the binaries are (first found wins):
#   HMOE_BIN          the hmoe binary           (else $DIST/hmoe)
#   HMOE_CUDA_TESTS   folder of test executables (else $DIST/tests)
#   HMOE_DIST         folder with both           (else this script's folder, else
#                                                  ../dist/gpu-check beside it)
#   HMOE_FIXTURES     fixtures folder (else $DIST/fixtures, which build-gpu-check.sh fills):
#                     the GPU tests read gpt-oss/ in it
#   HMOE_GPTOSS_FIXTURES  the gpt-oss fixtures gpu_compare.py runs (else $HMOE_FIXTURES/gpt-oss);
#                     it also runs the qwen3moe/ and deepseek2/ folders beside them when present
# Optional:
#   HMOE_BENCH_MODEL  a GGUF model: `hmoe bench` with --cpu-moe and with every layer on the GPU,
#                     each with the peak GPU memory of the bench process (nvidia-smi)
#   HMOE_BENCH_MAKE   with no HMOE_BENCH_MODEL: `g120-4l` makes the 4-layer gpt-oss-120b-dims
#                     model (hmoe make-test-model, ~7 GB in $TMPDIR) and benches it
#   HMOE_BENCH_ARGS   extra bench flags (default: -p 512 -n 128 -r 3)
#   HMOE_SERVE_CHECK  0: skip the server checks on the bench model (default 1):
#                     `hmoe serve -np 4` with --cpu-moe and with every layer on the GPU
#                     (serve_check.py: 4 concurrent greedy streams equal solo runs, the server's
#                     GPU memory from nvidia-smi within 5% + 300 MiB of /props' estimate,
#                     aggregate decode t/s with 1 and 4 streams)
#   HMOE_SKIP_TESTS   1: skip the CUDA test executables (gpu_compare and bench only)
#   HMOE_SKIP_CPU_TESTS  1: skip the CPU device's test executables ($DIST/cpu-tests: the host's
#                     AVX-512/AMX kernels and the model fixtures)
#   HMOE_COMPARE_JOBS, HMOE_COMPARE_THREADS  gpu_compare.py's runs at a time (default 6) and
#                     CPU threads each (default 2)
#   CUDA_HOME         CUDA install (default /usr/local/cuda): its lib64 goes on LD_LIBRARY_PATH
#   HMOE_CUDA_CACHE   the kernel PTX cache (default: a fresh folder, so the first test compiles)
#   HMOE_STEP_TIMEOUT seconds any one step may run before it is killed (default 240), so that
#                     one hung step cannot eat a short GPU lease
#
# Exit status: 0 when every step passed, 1 otherwise.
set -u

HERE="$(cd "$(dirname "$0")" && pwd)"
DIST="${HMOE_DIST:-}"
if [ -z "$DIST" ]; then
    for d in "$HERE" "$HERE/../dist/gpu-check"; do
        if [ -x "$d/hmoe" ]; then DIST="$d"; break; fi
    done
fi
DIST="${DIST:-$HERE}"
HMOE="${HMOE_BIN:-$DIST/hmoe}"
TESTS="${HMOE_CUDA_TESTS:-$DIST/tests}"

REPORT=()
FAILED=0

STEP_TIMEOUT="${HMOE_STEP_TIMEOUT:-240}"

# step NAME CMD...: runs CMD (a program, killed after STEP_TIMEOUT seconds, or a function of
# this script), records its exit status (never stops the script).
step() {
    local name="$1"; shift
    echo
    echo "=== $name: $*"
    local t0 t1 rc
    t0=$(date +%s.%N)
    if [ "$(type -t "$1")" = function ]; then
        "$@"
    else
        timeout -k 10 "$STEP_TIMEOUT" "$@"
    fi
    rc=$?
    [ "$rc" -ne 124 ] || echo "=== $name: killed after ${STEP_TIMEOUT} s"
    t1=$(date +%s.%N)
    local secs
    secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
    echo "=== $name: exit $rc (${secs} s)"
    REPORT+=("$(printf '%-28s exit %3d  %8s s' "$name" "$rc" "$secs")")
    [ "$rc" -eq 0 ] || FAILED=1
    return 0
}

echo "gpu-check: hmoe=$HMOE tests=$TESTS"
uname -a
step "nvidia-smi" nvidia-smi

CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
for d in "$CUDA_HOME/lib64" "$CUDA_HOME/targets/x86_64-linux/lib" /usr/local/cuda/lib64; do
    if [ -d "$d" ]; then
        case ":${LD_LIBRARY_PATH:-}:" in
            *":$d:"*) ;;
            *) LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ;;
        esac
    fi
done
# CUDA's libraries may come only from Python wheels (nvidia-cublas, nvidia-cuda-nvrtc): their
# lib folders join the path when the toolkit's own folders lack a library.
for lib in libnvrtc.so.13 libcublas.so.13; do
    if ! ls ${LD_LIBRARY_PATH//:/ } 2>/dev/null | grep -q "^$lib\$"; then
        found="$(find /usr/local /opt /usr/lib -name "$lib" 2>/dev/null | head -n1)"
        if [ -n "$found" ]; then
            LD_LIBRARY_PATH="$(dirname "$found")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        fi
    fi
done
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}"
echo "gpu-check: LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
for lib in libcuda.so.1 libnvrtc.so.13 libnvrtc-builtins.so.13 libcublas.so.13; do
    if ldconfig -p 2>/dev/null | grep -q "$lib" \
        || ls ${LD_LIBRARY_PATH//:/ } 2>/dev/null | grep -q "^$lib"; then
        echo "gpu-check: found $lib"
    else
        echo "gpu-check: NOT found: $lib"
    fi
done

if [ -z "${HMOE_CUDA_CACHE:-}" ]; then
    HMOE_CUDA_CACHE="$(mktemp -d)"
    export HMOE_CUDA_CACHE
fi
echo "gpu-check: HMOE_CUDA_CACHE=$HMOE_CUDA_CACHE"

if [ -z "${HMOE_FIXTURES:-}" ] && [ -d "$DIST/fixtures" ]; then
    HMOE_FIXTURES="$DIST/fixtures"
fi
if [ -n "${HMOE_FIXTURES:-}" ]; then
    export HMOE_FIXTURES
fi
echo "gpu-check: HMOE_FIXTURES=${HMOE_FIXTURES:-unset (the compiled-in path)}"

if [ -x "$HMOE" ]; then
    step "hmoe --list-devices" "$HMOE" --list-devices
else
    echo "gpu-check: no hmoe binary at $HMOE"
    REPORT+=("$(printf '%-28s missing' 'hmoe --list-devices')")
    FAILED=1
fi

# The bench model is made in the background (CPU and disk only) while the GPU steps run.
MAKE_PID=""
if [ -z "${HMOE_BENCH_MODEL:-}" ] && [ "${HMOE_BENCH_MAKE:-}" = g120-4l ] && [ -x "$HMOE" ]; then
    HMOE_BENCH_MODEL="${TMPDIR:-/tmp}/hmoe-g120-4l.gguf"
    MAKE_LOG="$(mktemp)"
    if [ ! -f "$HMOE_BENCH_MODEL" ]; then
        ( timeout -k 10 "$STEP_TIMEOUT" "$HMOE" make-test-model --preset gpt-oss-120b-layers \
            --layers 4 -o "$HMOE_BENCH_MODEL.part" && mv "$HMOE_BENCH_MODEL.part" "$HMOE_BENCH_MODEL" \
        ) > "$MAKE_LOG" 2>&1 &
        MAKE_PID=$!
    fi
fi
wait_for_model() {
    wait "$MAKE_PID"
    local rc=$?
    tail -n 5 "$MAKE_LOG"
    return "$rc"
}

# Teacher-forced top-10 of the GPU executor vs the CPU device vs the goldens, every fixture of
# gpt-oss, Qwen3-MoE and DeepSeek-V3, for -ngl all / -ngl all --cpu-moe / -ngl all --n-cpu-moe 1:
# max |dp| <= 5e-3 on every fixture (see gpu_compare.py's docstring).
GPTOSS_FIX="${HMOE_GPTOSS_FIXTURES:-${HMOE_FIXTURES:-$HERE/../../shared/fixtures}/gpt-oss}"
COMPARE_DIRS=(--fixtures "$GPTOSS_FIX")
for arch in qwen3moe deepseek2; do
    [ -d "$GPTOSS_FIX/../$arch" ] && COMPARE_DIRS+=(--fixtures "$GPTOSS_FIX/../$arch")
done
COMPARE="$DIST/gpu_compare.py"
[ -f "$COMPARE" ] || COMPARE="$HERE/gpu_compare.py"
if [ -x "$HMOE" ] && [ -f "$COMPARE" ] && [ -d "$GPTOSS_FIX" ] && command -v python3 >/dev/null; then
    step "gpu_compare (GPU vs CPU vs golden)" python3 "$COMPARE" --hmoe "$HMOE" "${COMPARE_DIRS[@]}" --jobs "${HMOE_COMPARE_JOBS:-6}" --threads "${HMOE_COMPARE_THREADS:-2}"
else
    echo "gpu-check: cannot run gpu_compare.py (hmoe=$HMOE script=$COMPARE fixtures=$GPTOSS_FIX, python3?)"
    REPORT+=("$(printf '%-28s missing' 'gpu_compare')")
    FAILED=1
fi

found_tests=0
[ "${HMOE_SKIP_TESTS:-0}" = 1 ] && found_tests=skip
for t in "$TESTS"/*; do
    [ "$found_tests" = skip ] && break
    [ -x "$t" ] || continue
    found_tests=1
    # One thread: the tests share the device and their output stays readable.
    step "test $(basename "$t")" "$t" --test-threads=1 --nocapture
done
if [ "$found_tests" -eq 0 ]; then
    echo "gpu-check: no test executables in $TESTS"
    REPORT+=("$(printf '%-28s missing' 'CUDA tests')")
    FAILED=1
fi

# The CPU tests on this machine's CPU (AVX-512 and AMX kernels that the development
# machines may lack), when build-gpu-check.sh packed them.
if [ "${HMOE_SKIP_CPU_TESTS:-0}" != 1 ] && [ -d "$DIST/cpu-tests" ]; then
    for t in "$DIST"/cpu-tests/*; do
        [ -x "$t" ] || continue
        step "cpu test $(basename "$t")" "$t" --test-threads=8
    done
fi

# bench_vram NAME ARGS...: `hmoe bench ARGS` with the peak GPU memory of its process, sampled
# every 0.2 s from nvidia-smi (the compute-apps query; the whole GPU's use as a fallback).
bench_vram() {
    local name="$1"; shift
    local log peak_file
    log="$(mktemp)"; peak_file="$(mktemp)"
    echo 0 > "$peak_file"
    timeout -k 10 "$STEP_TIMEOUT" "$HMOE" bench "$@" 2>&1 | tee "$log" &
    local pipe_pid=$!
    (
        peak=0
        while kill -0 "$pipe_pid" 2>/dev/null; do
            pid="$(pgrep -n -f "$HMOE bench" 2>/dev/null || true)"
            used=""
            if [ -n "$pid" ]; then
                used="$(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits 2>/dev/null \
                    | awk -F', *' -v p="$pid" '$1 == p { print $2 }' | head -n1)"
            fi
            if [ -z "$used" ]; then
                used="$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | head -n1)"
            fi
            if [[ "$used" =~ ^[0-9]+$ ]] && [ "$used" -gt "$peak" ]; then
                peak="$used"
                echo "$peak" > "$peak_file"
            fi
            sleep 0.2
        done
    ) &
    local sampler=$!
    wait "$pipe_pid"
    local rc=$?
    wait "$sampler" 2>/dev/null
    local peak
    peak="$(cat "$peak_file")"
    echo "gpu-check: $name: peak GPU memory ${peak} MiB"
    if ! grep -m1 "hmoe: gpt-oss on" "$log"; then
        echo "gpu-check: $name: the GPU executor did not run (see the log)"
        [ "$rc" -ne 0 ] || rc=1
    fi
    BENCH_VRAM+=("$(printf '%-28s peak GPU memory %6s MiB' "$name" "$peak")")
    rm -f "$log" "$peak_file"
    return "$rc"
}
BENCH_VRAM=()

if [ -n "$MAKE_PID" ]; then
    step "make g120-4l (background)" wait_for_model
fi
if [ -n "${HMOE_BENCH_MODEL:-}" ] && [ -x "$HMOE" ]; then
    read -r -a BENCH_ARGS <<< "${HMOE_BENCH_ARGS:--p 512 -n 128 -r 3}"
    # --moe-cache 0: the host round trip, as measured before the cache existed (on a large GPU
    # the default cache ends up holding every expert).
    step "bench --cpu-moe" bench_vram "bench --cpu-moe" -m "$HMOE_BENCH_MODEL" -ngl all --cpu-moe --moe-cache 0 "${BENCH_ARGS[@]}"
    step "bench all layers on GPU" bench_vram "bench all on GPU" -m "$HMOE_BENCH_MODEL" -ngl all "${BENCH_ARGS[@]}"
    step "bench CPU (-dev none)" "$HMOE" bench -m "$HMOE_BENCH_MODEL" -dev none "${BENCH_ARGS[@]}"
    SERVE_CHECK="$DIST/serve_check.py"
    [ -f "$SERVE_CHECK" ] || SERVE_CHECK="$HERE/serve_check.py"
    if [ "${HMOE_SERVE_CHECK:-1}" = 1 ] && [ -f "$SERVE_CHECK" ] && command -v python3 >/dev/null; then
        # --moe-cache 0: the estimate of /props has no expert cache in it.
        step "serve --cpu-moe -np 4" python3 "$SERVE_CHECK" --hmoe "$HMOE" \
            --model "$HMOE_BENCH_MODEL" --name serve-cpu-moe --flags "-ngl all --cpu-moe --moe-cache 0"
        step "serve all on GPU -np 4" python3 "$SERVE_CHECK" --hmoe "$HMOE" \
            --model "$HMOE_BENCH_MODEL" --name serve-all-gpu --flags "-ngl all"
    fi
else
    echo
    echo "gpu-check: HMOE_BENCH_MODEL not set: no bench"
fi

echo
echo "=== gpu-check report"
for line in "${REPORT[@]}"; do echo "  $line"; done
for line in "${BENCH_VRAM[@]}"; do echo "  $line"; done
if [ "$FAILED" -eq 0 ]; then echo "gpu-check: all steps passed"; else echo "gpu-check: some steps FAILED"; fi
exit "$FAILED"
