#!/usr/bin/env bash
# hmoe against llama.cpp on the same GPU machine and the same file: for each
# placement (--cpu-moe, the first half of the layers' experts on the CPU, everything on the GPU)
# and each K/V type (f16, q8_0), `hmoe bench` and llama.cpp's `llama-bench` one after the other
# (which goes first alternates), each for pp512, pp2048, tg128 and tg128 at depth 4096, with the
# peak GPU memory of each invocation (nvidia-smi). Then, hmoe only: tg128 with --cpu-moe with and
# without the device expert cache, on the file and on a twin written with --routing-locality.
# The result goes to OUT_DIR/<date>-<gpu>.json, assembled and validated by
# gpu_bench_json.py (python3, standard library).
#
# usage: gpu-bench.sh [--dry-run] [--model FILE] [--out OUT_DIR] [--reps N]
#   --dry-run   no GPU, no llama.cpp: the hmoe half on the reference device (-dev REF0) with a
#               tiny model (make-test-model --preset tiny) and small sizes (pp16, pp32, tg4,
#               tg4@d32), then the same assembly and validation. What a machine without a GPU
#               can check of this script (crates/cli/tests/gpu_bench_script.rs runs it).
#   --model     the GGUF file (else HMOE_BENCH_MODEL; else the 4-layer gpt-oss-120b-dims model
#               made with `hmoe make-test-model`, ~7 GB in $TMPDIR)
#   --out       where the JSON goes (default: bench/results under the current folder; on the
#               device machine pass $OUT so that it comes back)
#   --reps      repetitions per test (default 3; 1 in a dry run)
# Environment:
#   HMOE_BIN        the hmoe binary (else ./hmoe beside this script, else dist/gpu-check/hmoe)
#   LLAMA_RUN       llama.cpp's run.sh (else .baseline/llama-cuda/run.sh, else llama-cuda/run.sh
#                   beside this script): see ../shared/baselines/README.md
#   GPU_BENCH_TIMEOUT  seconds one invocation may run (default 300)
#   GPU_BENCH_CONFIGS  the placements to run (default "cpu-moe ncmoe-half all-gpu")
#   GPU_BENCH_KVS      the K/V types to run (default "f16 q8_0"); with these two a run that does
#                      not fit one device call (10 minutes) can be split over two
#   GPU_BENCH_CACHE    0: skip the expert-cache runs (default 1)
#   GPU_BENCH_CACHE_MIB  the cache runs' --moe-cache (default 1700: a quarter of the experts of
#                   the 4-layer 120b-dims model; empty: hmoe's default, the placement's room)
#   GPU_BENCH_PP       prompt sizes (default "512,2048"); GPU_BENCH_TG the generation size
#                      (default 128); GPU_BENCH_DEPTHS the depths of the generation test
#                      (default "4096"; a list such as "4096,16384"; empty: none)
#   GPU_BENCH_MAKE     make-test-model's flags for the model made when none is given (default
#                      "--preset gpt-oss-120b-layers --layers 4"; the seed proxy is "--preset
#                      gpt-oss-120b --experts 16": 36 layers, GPT-OSS-120B's work per token)
#   GPU_BENCH_TAG      a name for the made model and the result (<date>-<gpu>-<tag>.json), so
#                      that runs on several models in one session keep their own files
# The placement matrix runs hmoe with --moe-cache 0, so that --cpu-moe means what it means to
# llama.cpp (on a large GPU the default cache would end up holding every expert).
# Exit status: 0 when every invocation ran and the result is valid.
#
# On the GPU machine (the device `run` tool; nothing is built there): here, run
# scripts/build-gpu-check.sh (dist/gpu-check: the stripped hmoe, ~15 MB, this script and
# gpu_bench_json.py) and copy ../shared/baselines/llama-cuda-sm90-llama-bench.tar.xz (21 MB) into
# .baseline/ (ignored through .git/info/exclude); carry dist/gpu-check and .baseline, and run
#   tar -C .baseline -xJf .baseline/llama-cuda-sm90-llama-bench.tar.xz &&
#   LLAMA_RUN=.baseline/llama-cuda/run.sh dist/gpu-check/gpu-bench.sh --out $OUT
# then copy the JSON that comes back into bench/results/. Making the two 4-layer models takes
# about a minute; on an H200 the 8 invocations of GPU_BENCH_CONFIGS="cpu-moe all-gpu"
# GPU_BENCH_KVS=f16 GPU_BENCH_CACHE=0 took 47 s with 3 repetitions, so the whole matrix fits one
# call; split it with GPU_BENCH_CONFIGS / GPU_BENCH_KVS where it does not.
set -u -o pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
DRY=0
MODEL="${HMOE_BENCH_MODEL:-}"
OUT_DIR="bench/results"
REPS=""
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=1 ;;
        --model) MODEL="$2"; shift ;;
        --out) OUT_DIR="$2"; shift ;;
        --reps) REPS="$2"; shift ;;
        -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
        *) echo "gpu-bench: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done

HMOE="${HMOE_BIN:-}"
if [ -z "$HMOE" ]; then
    for c in "$HERE/hmoe" "$HERE/../dist/gpu-check/hmoe"; do
        if [ -x "$c" ]; then HMOE="$c"; break; fi
    done
fi
[ -x "${HMOE:-}" ] || { echo "gpu-bench: no hmoe binary (set HMOE_BIN)" >&2; exit 2; }
PY="${HMOE_PYTHON:-python3}"
JSONPY="$HERE/gpu_bench_json.py"
[ -f "$JSONPY" ] || { echo "gpu-bench: $JSONPY missing" >&2; exit 2; }
TIMEOUT="${GPU_BENCH_TIMEOUT:-300}"
WORK="$(mktemp -d)"
FAILED=0

if [ "$DRY" = 1 ]; then
    PP="16,32"; TG="4"; DEPTH="32"; REPS="${REPS:-1}"
    TESTS="pp16,pp32,tg4,tg4@d32"
    DEV=(-dev REF0 --gpu-mem 2GiB)
    MAKE_ARGS=(--preset tiny)
    CACHE_MIB=4
else
    PP="${GPU_BENCH_PP-512,2048}"; TG="${GPU_BENCH_TG:-128}"; DEPTH="${GPU_BENCH_DEPTHS-4096}"
    REPS="${REPS:-3}"
    TESTS="$(
        IFS=,
        for p in $PP; do printf 'pp%s,' "$p"; done
        printf 'tg%s,' "$TG"
        for d in $DEPTH; do printf 'tg%s@d%s,' "$TG" "$d"; done
    )"
    TESTS="${TESTS%,}"
    DEV=()
    read -r -a MAKE_ARGS <<< "${GPU_BENCH_MAKE:---preset gpt-oss-120b-layers --layers 4}"
    # About a quarter of each layer's experts of the 4-layer 120b-dims model (32 of 128,
    # ~13 MiB each), as a small GPU would hold; empty: the default (the placement's room,
    # which on a large GPU holds every expert).
    CACHE_MIB="${GPU_BENCH_CACHE_MIB-1700}"
fi

# The model (and its twin with routing locality, for the cache runs), made in $TMPDIR.
make_model() { # make_model OUT [extra make-test-model flags]
    local out="$1"; shift
    [ -f "$out" ] && return 0
    echo "gpu-bench: making $out ($HMOE make-test-model ${MAKE_ARGS[*]} $*)" >&2
    timeout -k 10 "$TIMEOUT" "$HMOE" make-test-model "${MAKE_ARGS[@]}" "$@" -o "$out.part" >&2 \
        && mv "$out.part" "$out"
}
TMP="${TMPDIR:-/tmp}"
TAG="${GPU_BENCH_TAG:-}"
STEM="$TMP/hmoe-${TAG:-g120-4l}"
LOCAL="$WORK/locality.gguf"
[ "$DRY" = 0 ] && LOCAL="$STEM-locality.gguf"
# Both files are made before anything is measured (the two at once), so that no measurement
# shares the CPU with a model being written.
LOCAL_PID=""
if [ "${GPU_BENCH_CACHE:-1}" = 1 ]; then
    make_model "$LOCAL" --routing-locality 0.9 &
    LOCAL_PID=$!
fi
if [ -z "$MODEL" ]; then
    if [ "$DRY" = 1 ]; then MODEL="$WORK/tiny.gguf"; else MODEL="$STEM.gguf"; fi
    make_model "$MODEL" || { echo "gpu-bench: could not make the model" >&2; exit 1; }
fi
LOCAL_OK=1
if [ -n "$LOCAL_PID" ]; then wait "$LOCAL_PID" || LOCAL_OK=0; fi
[ -f "$MODEL" ] || { echo "gpu-bench: no model file $MODEL" >&2; exit 2; }

# Layers, from the file's metadata (`hmoe inspect` prints ARCH.block_count).
N_LAYER="$("$HMOE" inspect "$MODEL" 2>/dev/null | grep -m1 -o 'block_count[^0-9]*[0-9]\+' | grep -o '[0-9]\+$')"
[ -n "$N_LAYER" ] || { echo "gpu-bench: could not read block_count of $MODEL" >&2; exit 1; }
HALF=$(( N_LAYER / 2 ))
echo "gpu-bench: $MODEL, $N_LAYER layers; hmoe=$HMOE; tests $TESTS, $REPS reps" >&2

LLAMA="${LLAMA_RUN:-}"
if [ -z "$LLAMA" ] && [ "$DRY" = 0 ]; then
    for c in ".baseline/llama-cuda/run.sh" "$HERE/llama-cuda/run.sh" "$HERE/.baseline/llama-cuda/run.sh"; do
        if [ -x "$c" ]; then LLAMA="$c"; break; fi
    done
    [ -n "$LLAMA" ] || { echo "gpu-bench: no llama.cpp run.sh (set LLAMA_RUN); hmoe only" >&2; FAILED=1; }
fi

# peak_vram PID_FILE PEAK_FILE: samples the GPU memory every 0.2 s while the process runs (its
# own use from the compute-apps query, else the whole GPU's), keeping the peak in PEAK_FILE.
have_smi=0
[ "$DRY" = 0 ] && command -v nvidia-smi >/dev/null 2>&1 && have_smi=1

# measure ENGINE CONFIG KV NAME CMD...: runs one bench invocation into $WORK/NAME.json and
# appends its line to $WORK/runs.tsv (or to $WORK/cache.tsv when ENGINE is cache:KIND:MIB).
measure() {
    local engine="$1" config="$2" kv="$3" name="$4"; shift 4
    local out="$WORK/$name.json" err="$WORK/$name.err" peak="null"
    echo "gpu-bench: $name: $*" >&2
    timeout -k 10 "$TIMEOUT" "$@" > "$out" 2> "$err" &
    local pid=$!
    if [ "$have_smi" = 1 ]; then
        local max=0 used
        while kill -0 "$pid" 2>/dev/null; do
            used="$(nvidia-smi --query-compute-apps=used_memory --format=csv,noheader,nounits 2>/dev/null \
                | awk '{ s += $1 } END { print s + 0 }')"
            if [ -z "$used" ] || [ "$used" = 0 ]; then
                used="$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | head -n1)"
            fi
            if [[ "$used" =~ ^[0-9]+$ ]] && [ "$used" -gt "$max" ]; then max="$used"; fi
            sleep 0.2
        done
        peak="$max"
    fi
    wait "$pid"
    local rc=$?
    if [ "$rc" -ne 0 ]; then
        echo "gpu-bench: $name: exit $rc" >&2
        tail -n 20 "$err" >&2
        FAILED=1
        return 0
    fi
    grep -h "moe cache:" "$err" >&2 || true
    case "$engine" in
        cache:*) printf '%s\t%s\t%s\n' "${engine#cache:}" "$peak" "$out" >> "$WORK/cache.tsv" ;;
        *) printf '%s\t%s\t%s\t%s\t%s\n' "$engine" "$config" "$kv" "$peak" "$out" >> "$WORK/runs.tsv" ;;
    esac
}

: > "$WORK/runs.tsv"
: > "$WORK/cache.tsv"
i=0
for config in ${GPU_BENCH_CONFIGS:-cpu-moe ncmoe-half all-gpu}; do
    case "$config" in
        cpu-moe) H_FLAGS=(--cpu-moe --moe-cache 0); L_FLAGS=(--n-cpu-moe "$N_LAYER") ;;
        ncmoe-half) H_FLAGS=(--n-cpu-moe "$HALF" --moe-cache 0); L_FLAGS=(--n-cpu-moe "$HALF") ;;
        all-gpu) H_FLAGS=(); L_FLAGS=() ;;
    esac
    for kv in ${GPU_BENCH_KVS:-f16 q8_0}; do
        hmoe_half() {
            measure hmoe "$config" "$kv" "hmoe-$config-$kv-pp" "$HMOE" bench -m "$MODEL" \
                "${DEV[@]}" -ngl all "${H_FLAGS[@]}" -fa on -ctk "$kv" -ctv "$kv" \
                -p "$PP" -n "$TG" -r "$REPS" -o json
            [ -n "$DEPTH" ] || return 0
            measure hmoe "$config" "$kv" "hmoe-$config-$kv-depth" "$HMOE" bench -m "$MODEL" \
                "${DEV[@]}" -ngl all "${H_FLAGS[@]}" -fa on -ctk "$kv" -ctv "$kv" \
                -p 0 -n "$TG" -d "$DEPTH" -r "$REPS" -o json
        }
        llama_half() {
            [ -n "$LLAMA" ] || return 0
            measure llama.cpp "$config" "$kv" "llama-$config-$kv-pp" "$LLAMA" llama-bench \
                -m "$MODEL" -ngl 99 "${L_FLAGS[@]}" -fa 1 -ctk "$kv" -ctv "$kv" \
                -p "$PP" -n "$TG" -r "$REPS" -o json
            [ -n "$DEPTH" ] || return 0
            measure llama.cpp "$config" "$kv" "llama-$config-$kv-depth" "$LLAMA" llama-bench \
                -m "$MODEL" -ngl 99 "${L_FLAGS[@]}" -fa 1 -ctk "$kv" -ctv "$kv" \
                -p 0 -n "$TG" -d "$DEPTH" -r "$REPS" -o json
        }
        # Alternate which engine goes first, so that drift (clocks, heat) favours neither.
        if [ $(( i % 2 )) -eq 0 ]; then hmoe_half; llama_half; else llama_half; hmoe_half; fi
        i=$(( i + 1 ))
    done
done

# The device expert cache (hmoe only): --cpu-moe tg with the cache off and on (CACHE_MIB), on
# the file and on a twin of it with routing locality (same dimensions and seed).
if [ "${GPU_BENCH_CACHE:-1}" = 1 ]; then
    if [ "$LOCAL_OK" = 1 ] && [ -f "$LOCAL" ]; then
        for kind in random locality; do
            m="$MODEL"; [ "$kind" = locality ] && m="$LOCAL"
            on=(); [ -n "$CACHE_MIB" ] && on=(--moe-cache "$CACHE_MIB")
            measure "cache:$kind:off" cpu-moe f16 "cache-$kind-off" "$HMOE" bench -m "$m" \
                "${DEV[@]}" -ngl all --cpu-moe --moe-cache 0 -p 0 -n "$TG" -r "$REPS" -o json
            measure "cache:$kind:on" cpu-moe f16 "cache-$kind-on" "$HMOE" bench -m "$m" \
                "${DEV[@]}" -ngl all --cpu-moe "${on[@]}" -p 0 -n "$TG" -r "$REPS" -o json
        done
    else
        echo "gpu-bench: could not make the locality model: no cache runs" >&2
        FAILED=1
    fi
fi

# The machine, and the result.
GPU="none"
if [ "$have_smi" = 1 ]; then
    GPU="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1)"
fi
[ "$DRY" = 1 ] && GPU="REF0-dry-run"
DATE="$(date -u +%Y-%m-%d)"
CPU="$(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | sed 's/.*: //')"
"$PY" - "$WORK/machine.json" "$GPU" "$CPU" "$(nproc)" "$("$HMOE" --version 2>/dev/null | head -n1)" \
    "$(basename "$MODEL")" "$REPS" "$DRY" "$([ "$have_smi" = 1 ] && nvidia-smi --query-gpu=memory.total,driver_version --format=csv,noheader 2>/dev/null | head -n1)" <<'EOF'
import json, sys
out, gpu, cpu, cores, hmoe, model, reps, dry, smi = sys.argv[1:10]
mem = ""
try:
    with open("/proc/meminfo") as f:
        mem = f.readline().split(":")[1].strip()
except OSError:
    pass
json.dump({"gpu": gpu, "gpu_memory_driver": smi, "cpu": cpu, "cores": int(cores), "ram": mem,
           "hmoe": hmoe, "model": model, "reps": int(reps), "dry_run": dry == "1"},
          open(out, "w"))
EOF
SAFE_GPU="$(printf '%s' "$GPU" | tr -c 'A-Za-z0-9._-' '-' | sed 's/-\+/-/g; s/^-//; s/-$//')"
mkdir -p "$OUT_DIR"
RESULT="$OUT_DIR/$DATE-$SAFE_GPU${TAG:+-$TAG}.json"
"$PY" "$JSONPY" assemble --runs "$WORK/runs.tsv" --cache-runs "$WORK/cache.tsv" \
    --machine "$WORK/machine.json" --date "$DATE" --tests "$TESTS" -o "$RESULT" || FAILED=1
echo "gpu-bench: wrote $RESULT" >&2
rm -rf "$WORK"
exit "$FAILED"
