#!/usr/bin/env bash
# Builds what scripts/gpu-check.sh runs on a GPU machine that has no Rust toolchain: the release
# `hmoe` binary, the test executables of hmoe-cuda (the CUDA test suite) and of the CPU device
# (hmoe-quant, hmoe-cpu, hmoe-model: the host's AVX-512/AMX kernels), copied with gpu-check.sh
# itself into one folder, dist/gpu-check/ by default, and packed as dist/gpu-check.tar.xz (the
# folder is over a device call's 64 MiB). Carry the archive to the GPU machine, unpack it and
# run `./gpu-check.sh` inside (scripts/gpu-session.sh does all of a session's checks).
#
# usage: scripts/build-gpu-check.sh [OUT_DIR]
# The binaries load libcuda/libnvrtc/libcublas at run time (nothing CUDA is linked), so this
# builds on a machine without CUDA. They need a glibc at least as new as this machine's.
# Also copied: scripts/gpu_compare.py (teacher-forced GPU vs CPU vs golden, python3 stdlib),
# scripts/serve_check.py (the server checks), scripts/gpu-bench.sh with
# scripts/gpu_bench_json.py (hmoe vs llama.cpp: run `./gpu-bench.sh --out DIR` there
# with LLAMA_RUN pointing at llama.cpp's run.sh, see ../shared/baselines/README.md) and
# the gpt-oss, qwen3moe and deepseek2 fixtures with their f16-KV goldens (from $HMOE_FIXTURES or
# the repository's fixtures/*.tar.xz).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${1:-$ROOT/dist/gpu-check}"
TARGET="${CARGO_TARGET_DIR:-$ROOT/target}"
cd "$ROOT"

mkdir -p "$OUT/tests"
rm -f "$OUT"/tests/*

echo "build-gpu-check: cargo build --release -p hmoe-cli" >&2
cargo build --release -p hmoe-cli
cp "$TARGET/release/hmoe" "$OUT/hmoe"

echo "build-gpu-check: cargo test -p hmoe-cuda --release --no-run" >&2
# Cargo prints one JSON message per artifact; test targets carry their executable's path.
cargo test -p hmoe-cuda --release --no-run --message-format=json 2>/dev/null \
    | grep -o '"executable":"[^"]*"' \
    | sed 's/^"executable":"//; s/"$//' \
    | while read -r exe; do
        name="$(basename "$exe" | sed 's/-[0-9a-f]\{16\}$//')"
        cp "$exe" "$OUT/tests/$name"
        echo "build-gpu-check: test executable $name <- $exe" >&2
    done
[ -n "$(ls -A "$OUT/tests")" ] || { echo "build-gpu-check: no test executables found" >&2; exit 1; }

# The CPU tests (kernels, every ISA the host has: AVX-512 and AMX on the GPU machines
# seen so far; the model fixtures), which gpu-check.sh runs on the GPU machine's CPU. Not the
# tests of the real models, which are downloaded and do not travel.
echo "build-gpu-check: cargo test -p hmoe-quant -p hmoe-cpu -p hmoe-model --release --no-run" >&2
mkdir -p "$OUT/cpu-tests"
rm -f "$OUT"/cpu-tests/*
cargo test -p hmoe-quant -p hmoe-cpu -p hmoe-model --release --no-run --message-format=json 2>/dev/null \
    | grep -o '"executable":"[^"]*"' \
    | sed 's/^"executable":"//; s/"$//' \
    | grep -v -e '/examples/' -e 'real_models' -e 'device_dense' \
    | while read -r exe; do
        cp "$exe" "$OUT/cpu-tests/$(basename "$exe" | sed 's/-[0-9a-f]\{16\}$//')"
    done

# The GEMM micro-benchmark (gpu-session.sh step 4: the AMX kernel against AVX-512 VNNI).
cargo build --release -p hmoe-quant --example bench_gemm
cp "$TARGET/release/examples/bench_gemm" "$OUT/bench_gemm"

# libgomp for ../shared/baselines' CPU llama-bench (gpu-session.sh), which the GPU machine may lack.
mkdir -p "$OUT/lib"
gomp="$(ldconfig -p 2>/dev/null | awk '/libgomp\.so\.1 .*x86-64/ { print $NF; exit }')"
[ -n "$gomp" ] && cp -L "$gomp" "$OUT/lib/libgomp.so.1"

cp "$ROOT/scripts/gpu-check.sh" "$OUT/gpu-check.sh"
cp "$ROOT/scripts/gpu_compare.py" "$OUT/gpu_compare.py"
cp "$ROOT/scripts/serve_check.py" "$OUT/serve_check.py"
cp "$ROOT/scripts/gpu-bench.sh" "$OUT/gpu-bench.sh"
cp "$ROOT/scripts/gpu_bench_json.py" "$OUT/gpu_bench_json.py"
chmod +x "$OUT/gpu-check.sh" "$OUT/gpu_compare.py" "$OUT/serve_check.py" "$OUT/gpu-bench.sh" \
    "$OUT/gpu_bench_json.py" "$OUT/hmoe" "$OUT"/tests/*

# The fixtures (~26 MiB): gpt-oss (the GPU tests read them through HMOE_FIXTURES), and with
# Qwen3-MoE and DeepSeek-V3 every architecture's fixtures for gpu_compare.py.
# $HMOE_FIXTURES, else the repository's packed copy (fixtures/*.tar.xz) unpacked here.
if [ -n "${HMOE_FIXTURES:-}" ]; then
    FIXROOT="$HMOE_FIXTURES"
else
    FIXROOT="$(dirname "$OUT")/fixtures-unpacked"
    rm -rf "$FIXROOT" && mkdir -p "$FIXROOT"
    for arch in gpt-oss qwen3moe deepseek2; do
        tar -C "$FIXROOT" -xJf "$ROOT/fixtures/$arch.tar.xz"
    done
fi
rm -rf "$OUT/fixtures"
for arch in gpt-oss qwen3moe deepseek2; do
    FIX="$FIXROOT/$arch"
    if [ -d "$FIX" ]; then
        mkdir -p "$OUT/fixtures/$arch"
        cp "$FIX"/*.gguf "$FIX"/*.json "$OUT/fixtures/$arch/"
        echo "build-gpu-check: fixtures <- $FIX" >&2
    else
        echo "build-gpu-check: no fixtures at $FIX (the GPU tests and gpu_compare.py need them)" >&2
    fi
done
# Debug line tables make the folder ~100 MiB; stripped it is ~35 MiB with the fixtures.
if command -v strip >/dev/null 2>&1; then
    strip "$OUT/hmoe" "$OUT"/tests/* "$OUT"/cpu-tests/*
fi
du -sh "$OUT" >&2
# The folder is over the device call's 64 MiB; packed it is about half.
tar -C "$(dirname "$OUT")" -cf - "$(basename "$OUT")" | xz -T0 -6 > "$OUT.tar.xz"
du -sh "$OUT.tar.xz" >&2
echo "build-gpu-check: done: $OUT (run ./gpu-check.sh there on the GPU machine)" >&2
