#!/usr/bin/env bash
# A GPU session's checks in one device call, on a machine with an NVIDIA GPU and no Rust
# toolchain: the GPU check, hmoe against llama.cpp on the GPU, and hmoe against llama.cpp on
# the machine's CPU at 2 threads (the CPU round's figures on whatever CPU the GPU machine has;
# the H200 machine's Xeon has AMX).
#
# Here, before the call (the device tool carries at most 64 MiB):
#   scripts/build-gpu-check.sh                       # dist/gpu-check.tar.xz
#   mkdir -p .carry && echo /.carry/ >> .git/info/exclude
#   cp dist/gpu-check.tar.xz ../shared/baselines/llama-cuda-sm90-llama-bench.tar.xz \
#      ../shared/baselines/llama-cpu-x86-64-avx512.tar.xz .carry/
# The call (carry [".carry"]):
#   mkdir -p dist .baseline && tar -C dist -xJf .carry/gpu-check.tar.xz &&
#   for f in .carry/llama-*.tar.xz; do tar -C .baseline -xJf "$f"; done && scripts/gpu-session.sh
#
# Steps, each logged under $OUT (the device call's folder that comes back; else ./gpu-session).
# The default, SESSION_STEPS="check bench4 seed graphs" (about 8 minutes on an H200 by estimate,
# the start not counted; each step is bounded by a timeout), is the GPU round's measurement:
#   check   correctness first: dist/gpu-check/gpu-check.sh with the CUDA test executables and
#           gpu_compare.py on every architecture's fixtures (no CPU tests, no bench, no server
#           checks there).  (~1.5 min)
#   bench4  gpu-bench.sh on the 4-layer gpt-oss-120b-dims model: --cpu-moe and all on the GPU,
#           f16 and q8_0 K/V, pp512, pp2048, tg128 and tg128 at depths 4096 and 16384, two
#           repetitions, hmoe and llama.cpp's CUDA llama-bench alternating; the JSON into $OUT
#           as <date>-<gpu>-g120-4l.json.  (~3 min)
#   seed    the seed proxy (make-test-model --preset gpt-oss-120b --experts 16: 36 layers, the
#           201k vocabulary, 9.9 GB, GPT-OSS-120B's work per token): all on the GPU, f16, pp512
#           and tg128 at depths 0, 4096 and 16384; then --cpu-moe at depth 0 (llama.cpp's
#           --cpu-moe prefill of 16k positions over 36 layers takes minutes: out of a lease's
#           reach); JSON as <date>-<gpu>-seed-proxy.json and -seed-proxy-cpu-moe.json.  (~2.5 min)
#   graphs  the 4-layer model all on the GPU, tg128 with CUDA graphs on and off
#           (HMOE_CUDA_GRAPHS), then HMOE_CUDA_PROFILE's table of GPU time per kernel.  (~1 min)
# Two more by name, for a lease with time left (or in place of a step already measured):
#   latent  DeepSeek-V3's latent attention: a 4-layer V3-dims model (MoE layers only, 16 Q4_K
#           experts), all on the GPU, f16 K/V, pp512 and tg128 at depths 0, 4096 and 16384
#           against llama.cpp; JSON as <date>-<gpu>-ds-v3-4l.json.  (~2 min)
#   pool    the memory pool keeping freed memory (HMOE_CUDA_POOL_KEEP=1, the default) against
#           the driver's default (0) on the 4-layer model, where ops allocate as issued:
#           --cpu-moe pp512 (op offload) and --cpu-moe tg64 with CUDA graphs off.  (~1 min)
# The CPU rounds' steps stay available by number:
#   1. gpu-check.sh whole (CUDA and CPU test executables, gpu_compare.py, `hmoe bench` with
#      --cpu-moe / all on the GPU / on the CPU, and the server checks), with the 4-layer model.
#   2. gpu-bench.sh's default matrix on the 4-layer model.
#   3. cpu-bench.sh with -t 2 against llama.cpp's AVX-512 CPU llama-bench, where the CPU has what
#      that build needs: the default kernels, then HMOE_AMX=0 where the CPU has AMX.
#   4. bench_gemm (one thread) with HMOE_AMX=0, and by default where the CPU has AMX; then
#      `hmoe bench --roofline` tg128 on the CPU at 2 threads, three runs.
#   5. cpu-bench.sh with -t 2 at depth 4096, f16 and q8_0 K/V, tg32.
#   6. A perf profile of CPU decode (tg128, 2 threads), the top symbols: perf from PATH, else
#      .baseline/perf as scripts/pack-perf.sh packs it.
# Give the call timeout_s 600 and leave the rest of the lease for one rerun of a failed step
# (the models made stay in $TMPDIR while the machine is warm). Exit status 1 if a step failed.
set -u
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-$PWD/gpu-session}"
mkdir -p "$OUT_DIR"
DIST="${HMOE_DIST:-$PWD/dist/gpu-check}"
HMOE="$DIST/hmoe"
MODEL="${TMPDIR:-/tmp}/hmoe-g120-4l.gguf"
PERF_DATA="${TMPDIR:-/tmp}/hmoe-decode.perf"
FAILED=0
LLAMA_CPU="$PWD/.baseline/llama-cpu/bin/llama-bench"

# The 4-layer gpt-oss-120b-dims model, made once while the machine stays warm.
make_model() {
    [ -f "$MODEL" ] || "$HMOE" make-test-model --preset gpt-oss-120b-layers --layers 4 -o "$MODEL" \
        > "$OUT_DIR/make.log" 2>&1
}

# Whether llama.cpp's CPU baseline runs here (it needs AVX-512 VNNI, and libgomp, which
# build-gpu-check.sh packs when it has it); says so when not.
cpu_baseline() {
    if [ ! -x "$LLAMA_CPU" ] || ! grep -q -w avx512_vnni /proc/cpuinfo; then
        echo "gpu-session: no CPU llama-bench, or the CPU lacks AVX-512 VNNI: step $1 skipped"
        return 1
    fi
    export LD_LIBRARY_PATH="$DIST/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
}

echo "gpu-session: $(date -u), $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //')"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
# Threads per core, and the Downfall mitigation, which slows vector gathers (the AVX-512 Q8_0
# row kernel gathers its scales).
lscpu 2>/dev/null | grep -E '^(Thread\(s\) per core|Core\(s\) per socket|CPU max MHz)' | tr -s ' '
echo "gather_data_sampling: $(cat /sys/devices/system/cpu/vulnerabilities/gather_data_sampling 2>&1)"

# gpu_bench TAG TIMEOUT [VAR=VALUE ...]: gpu-bench.sh with the given settings, bounded.
gpu_bench() {
    local tag="$1" limit="$2"; shift 2
    env "$@" GPU_BENCH_TAG="$tag" HMOE_BIN="$HMOE" LLAMA_RUN="$PWD/.baseline/llama-cuda/run.sh" \
        timeout -k 10 "$limit" "$DIST/gpu-bench.sh" --out "$OUT_DIR" --reps 2 \
        > "$OUT_DIR/gpu-bench-$tag.log" 2>&1 || FAILED=1
    grep -v '^ ' "$OUT_DIR/gpu-bench-$tag.log" | tail -n 3
    "${HMOE_PYTHON:-python3}" "$DIST/gpu_bench_json.py" table "$OUT_DIR"/*-"$tag".json 2>/dev/null || true
}

for s in ${SESSION_STEPS:-check bench4 seed graphs}; do
    echo "gpu-session: step $s, $(date -u +%T)"
    case "$s" in
        check)
            HMOE_SKIP_CPU_TESTS=1 HMOE_SERVE_CHECK=0 HMOE_BENCH_MODEL="" HMOE_BENCH_MAKE="" \
                timeout -k 10 200 "$DIST/gpu-check.sh" > "$OUT_DIR/gpu-check.log" 2>&1 || FAILED=1
            sed -n '/=== gpu-check report/,$p' "$OUT_DIR/gpu-check.log"
            ;;
        bench4)
            gpu_bench g120-4l 240 GPU_BENCH_CONFIGS="cpu-moe all-gpu" GPU_BENCH_KVS="f16 q8_0" \
                GPU_BENCH_PP=512,2048 GPU_BENCH_DEPTHS=4096,16384 GPU_BENCH_CACHE=0
            ;;
        seed)
            seed=(GPU_BENCH_MAKE="--preset gpt-oss-120b --experts 16" GPU_BENCH_KVS=f16
                GPU_BENCH_PP=512 GPU_BENCH_CACHE=0)
            # gpu-bench.sh makes the file as $TMPDIR/hmoe-<tag>.gguf (about a minute).
            gpu_bench seed-proxy 210 "${seed[@]}" GPU_BENCH_CONFIGS=all-gpu \
                GPU_BENCH_DEPTHS=4096,16384
            # The same file with the experts on the CPU (the tag differs, the file does not).
            gpu_bench seed-proxy-cpu-moe 150 "${seed[@]}" GPU_BENCH_CONFIGS=cpu-moe \
                GPU_BENCH_DEPTHS="" HMOE_BENCH_MODEL="${TMPDIR:-/tmp}/hmoe-seed-proxy.gguf"
            ;;
        graphs)
            # CUDA graphs on (the default) and off on the 4-layer model all on the GPU, then the
            # kernel profile (HMOE_CUDA_PROFILE turns graphs off: its events cannot be captured).
            make_model
            for g in 1 0; do
                log="$OUT_DIR/graphs-$g.log"
                HMOE_CUDA_GRAPHS=$g timeout -k 5 40 "$HMOE" bench -m "$MODEL" -fa on -p 0 -n 128 -r 3 \
                    > "$log" 2>&1 || FAILED=1
                echo "HMOE_CUDA_GRAPHS=$g: $(grep -m1 tg128 "$log")"
                grep -i -m3 'graph' "$log"
            done
            HMOE_CUDA_PROFILE=1 timeout -k 5 40 "$HMOE" bench -m "$MODEL" -fa on -p 0 -n 32 -r 1 \
                > "$OUT_DIR/cuda-profile.log" 2>&1 || FAILED=1
            tail -n 30 "$OUT_DIR/cuda-profile.log"
            ;;
        latent)
            gpu_bench ds-v3-4l 200 GPU_BENCH_CONFIGS=all-gpu GPU_BENCH_KVS=f16 GPU_BENCH_PP=512 \
                GPU_BENCH_DEPTHS=4096,16384 GPU_BENCH_CACHE=0 GPU_BENCH_MAKE="--arch deepseek2 \
                --preset deepseek-v3-layers --dense-layers 0 --layers 4 --experts 16 --expert-type q4_k"
            ;;
        pool)
            make_model
            for k in 1 0 1 0; do
                log="$OUT_DIR/pool-$k.log"
                HMOE_CUDA_POOL_KEEP=$k timeout -k 5 60 "$HMOE" bench -m "$MODEL" -fa on -ngl all \
                    --cpu-moe --moe-cache 0 -p 512 -n 0 -r 2 >> "$log" 2>&1 || FAILED=1
                HMOE_CUDA_POOL_KEEP=$k HMOE_CUDA_GRAPHS=0 timeout -k 5 60 "$HMOE" bench -m "$MODEL" \
                    -fa on -ngl all --cpu-moe --moe-cache 0 -p 0 -n 64 -r 2 >> "$log" 2>&1 || FAILED=1
                echo "HMOE_CUDA_POOL_KEEP=$k: $(grep -E 'pp512|tg64' "$log" | tail -n 2 | tr -s ' ' | tr '\n' ' ')"
            done
            ;;
        1)
            HMOE_BENCH_MODEL="" HMOE_BENCH_MAKE=g120-4l "$DIST/gpu-check.sh" > "$OUT_DIR/gpu-check.log" 2>&1 \
                || FAILED=1
            sed -n '/=== gpu-check report/,$p' "$OUT_DIR/gpu-check.log"
            ;;
        2)
            make_model
            HMOE_BIN="$HMOE" HMOE_BENCH_MODEL="$MODEL" LLAMA_RUN="$PWD/.baseline/llama-cuda/run.sh" \
                "$DIST/gpu-bench.sh" --out "$OUT_DIR" > "$OUT_DIR/gpu-bench.log" 2>&1 || FAILED=1
            grep -v '^ ' "$OUT_DIR/gpu-bench.log" | tail -n 5
            ;;
        3)
            cpu_baseline 3 || continue
            make_model
            amx=("")
            grep -q -w amx_int8 /proc/cpuinfo && amx+=(0)
            for a in "${amx[@]}"; do
                log="$OUT_DIR/cpu-bench${a:+-amx0}.log"
                HMOE_AMX="$a" HMOE="$HMOE" LLAMA_BENCH="$LLAMA_CPU" timeout 300 scripts/cpu-bench.sh \
                    -m "$MODEL" -r 2 -t 2 -p 512 -n 64 --kv f16 > "$log" 2>&1 || FAILED=1
                grep -m1 'cpu kernels' "$log"
                tail -n 4 "$log"
            done
            ;;
        4)
            amx=(0)
            grep -q -w amx_int8 /proc/cpuinfo && amx+=("")
            for a in "${amx[@]}"; do
                log="$OUT_DIR/bench-gemm-amx$a.log"
                HMOE_AMX="$a" timeout 240 "$DIST/bench_gemm" 10 > "$log" 2>&1 || FAILED=1
                echo "HMOE_AMX=$a:"
                grep -E 'T=(1|4|16|32|64) |^q8_0' "$log"
            done
            make_model
            # Three runs: the bound's measured bandwidth itself moves by 20% between runs there.
            for i in 1 2 3; do
                log="$OUT_DIR/roofline-$i.log"
                timeout 120 "$HMOE" bench -m "$MODEL" -dev none -t 2 -p 0 -n 128 -r 3 --roofline \
                    > "$log" 2>&1 || FAILED=1
                grep -E 'roofline: read|tg128' "$log"
            done
            ;;
        5)
            cpu_baseline 5 || continue
            make_model
            log="$OUT_DIR/cpu-bench-depth.log"
            HMOE="$HMOE" LLAMA_BENCH="$LLAMA_CPU" timeout 420 scripts/cpu-bench.sh \
                -m "$MODEL" -r 1 -t 2 -p 0 -n 32 -d 0,4096 --kv f16,q8_0 > "$log" 2>&1 || FAILED=1
            tail -n 8 "$log"
            ;;
        6)
            # perf from PATH, else as scripts/pack-perf.sh packs it (unpacked into .baseline;
            # its libraries only for perf's own commands, not for later steps).
            if command -v perf > /dev/null; then
                perf_cmd=(perf)
            elif [ -x .baseline/perf/perf ]; then
                perf_cmd=(env "LD_LIBRARY_PATH=$PWD/.baseline/perf/lib" "$PWD/.baseline/perf/perf")
            else
                echo "gpu-session: no perf (scripts/pack-perf.sh packs one): step 6 skipped"
                continue
            fi
            make_model
            # Sampling starts PROFILE_DELAY_MS after the start, past the load (~3 s there).
            timeout 150 "${perf_cmd[@]}" record -F 4000 -D "${PROFILE_DELAY_MS:-12000}" -o "$PERF_DATA" \
                "$HMOE" bench -m "$MODEL" -dev none -t 2 -p 0 -n 128 -r 8 \
                > "$OUT_DIR/decode-profile-bench.log" 2>&1 || FAILED=1
            "${perf_cmd[@]}" report -i "$PERF_DATA" --no-children --sort symbol 2>/dev/null |
                grep -v '^#' | grep '%' | head -n 40 > "$OUT_DIR/decode-profile.txt"
            grep tg128 "$OUT_DIR/decode-profile-bench.log"
            head -n 12 "$OUT_DIR/decode-profile.txt"
            ;;
        *) echo "gpu-session: unknown step $s" ;;
    esac
done
echo "gpu-session: done $(date -u +%T), $([ "$FAILED" = 0 ] && echo 'all steps passed' || echo 'some steps FAILED')"
exit "$FAILED"
