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
# Optional:
#   HMOE_BENCH_MODEL  a GGUF model: `hmoe bench` with --cpu-moe and with every layer on the GPU
#   HMOE_BENCH_ARGS   extra bench flags (default: -p 512 -n 128 -r 3)
#   CUDA_HOME         CUDA install (default /usr/local/cuda): its lib64 goes on LD_LIBRARY_PATH
#   HMOE_CUDA_CACHE   the kernel PTX cache (default: a fresh folder, so the first test compiles)
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

# step NAME CMD...: runs CMD, records its exit status (never stops the script).
step() {
    local name="$1"; shift
    echo
    echo "=== $name: $*"
    local t0 t1 rc
    t0=$(date +%s.%N)
    "$@"
    rc=$?
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

if [ -x "$HMOE" ]; then
    step "hmoe --list-devices" "$HMOE" --list-devices
else
    echo "gpu-check: no hmoe binary at $HMOE"
    REPORT+=("$(printf '%-28s missing' 'hmoe --list-devices')")
    FAILED=1
fi

found_tests=0
for t in "$TESTS"/*; do
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

if [ -n "${HMOE_BENCH_MODEL:-}" ] && [ -x "$HMOE" ]; then
    read -r -a BENCH_ARGS <<< "${HMOE_BENCH_ARGS:--p 512 -n 128 -r 3}"
    step "bench --cpu-moe" "$HMOE" bench -m "$HMOE_BENCH_MODEL" -ngl all --cpu-moe "${BENCH_ARGS[@]}"
    step "bench all layers on GPU" "$HMOE" bench -m "$HMOE_BENCH_MODEL" -ngl all "${BENCH_ARGS[@]}"
else
    echo
    echo "gpu-check: HMOE_BENCH_MODEL not set: no bench"
fi

echo
echo "=== gpu-check report"
for line in "${REPORT[@]}"; do echo "  $line"; done
if [ "$FAILED" -eq 0 ]; then echo "gpu-check: all steps passed"; else echo "gpu-check: some steps FAILED"; fi
exit "$FAILED"
