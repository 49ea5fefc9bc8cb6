#!/usr/bin/env bash
# hmoe against llama.cpp on the CPU: the same file, the same tests, the same threads, in one run,
# the two engines alternating round by round (the machines are noisy: medians and ratios count).
#
# usage: scripts/cpu-bench.sh -m MODEL [-r ROUNDS] [-t THREADS] [-p 512] [-n 128] [-d 0,4096]
#                             [--kv f16,q8_0] [--fa on|off] [-o results.json]
#
# HMOE is the hmoe binary (default: target/release/hmoe, else target/debug/hmoe); LLAMA_BENCH is
# llama.cpp's llama-bench (default: unpacked from ../shared/baselines/llama-cpu-x86-64-avx512.tar.xz
# into target/llama-cpu, on CPUs with the AVX-512 it needs; elsewhere set LLAMA_BENCH). Each
# round runs each engine once per KV type with `-r 2`; the table gives, per test, the median
# over rounds of each engine's mean t/s and hmoe / llama.cpp.
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL="" ROUNDS=3 THREADS=2 PP=512 TG=128 DEPTH=0 KV=f16 FA=on OUT=""
while [ $# -gt 0 ]; do
    case "$1" in
        -m) MODEL="$2"; shift 2 ;;
        -r) ROUNDS="$2"; shift 2 ;;
        -t) THREADS="$2"; shift 2 ;;
        -p) PP="$2"; shift 2 ;;
        -n) TG="$2"; shift 2 ;;
        -d) DEPTH="$2"; shift 2 ;;
        --kv) KV="$2"; shift 2 ;;
        --fa) FA="$2"; shift 2 ;;
        -o) OUT="$2"; shift 2 ;;
        *) echo "cpu-bench: unknown argument $1" >&2; exit 2 ;;
    esac
done
[ -n "$MODEL" ] || { echo "cpu-bench: -m MODEL is required" >&2; exit 2; }
case "$FA" in on) FA_LLAMA=1 ;; off) FA_LLAMA=0 ;; *) echo "cpu-bench: --fa on|off" >&2; exit 2 ;; esac

HMOE="${HMOE:-}"
if [ -z "$HMOE" ]; then
    for c in target/release/hmoe target/debug/hmoe; do [ -x "$c" ] && { HMOE="$c"; break; }; done
fi
[ -n "$HMOE" ] && [ -x "$HMOE" ] || { echo "cpu-bench: build hmoe first (cargo build --release -p hmoe-cli) or set HMOE" >&2; exit 1; }
LLAMA_BENCH="${LLAMA_BENCH:-}"
if [ -z "$LLAMA_BENCH" ]; then
    LLAMA_BENCH=target/llama-cpu/llama-cpu/bin/llama-bench
    # The prebuilt baseline needs AVX-512 F/BW/DQ/VL/VNNI/VBMI; elsewhere it dies of an illegal
    # instruction, so say what to do instead.
    flags=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2) "
    for f in avx512f avx512bw avx512dq avx512vl avx512_vnni avx512vbmi; do
        case "$flags" in
            *" $f "*) ;;
            *) echo "cpu-bench: this CPU lacks $f, which ../shared/baselines' llama-bench needs;" \
                    "build llama.cpp's llama-bench for this machine (outside the repo) and set" \
                    "LLAMA_BENCH to it" >&2; exit 1 ;;
        esac
    done
    # Its BF16 instructions run only for BF16 tensors: without avx512_bf16 the build still
    # measures every other type (checked on a Xeon VM that lacks it), so say so and go on.
    case "$flags" in
        *" avx512_bf16 "*) ;;
        *) echo "cpu-bench: this CPU lacks avx512_bf16: llama-bench would fault on BF16 tensors" \
                "(other types run)" >&2 ;;
    esac
    if [ ! -x "$LLAMA_BENCH" ]; then
        mkdir -p target/llama-cpu
        tar -C target/llama-cpu -xJf ../shared/baselines/llama-cpu-x86-64-avx512.tar.xz
    fi
fi

RUNS="$(mktemp -d)"
trap 'rm -rf "$RUNS"' EXIT
echo "cpu-bench: $HMOE vs $LLAMA_BENCH on $MODEL, $ROUNDS rounds, -t $THREADS, -fa $FA, KV $KV" >&2
for round in $(seq 1 "$ROUNDS"); do
    for kv in ${KV//,/ }; do
        common=(-m "$MODEL" -t "$THREADS" -p "$PP" -n "$TG" -d "$DEPTH" -r 2 -ctk "$kv" -ctv "$kv" -o json)
        echo "cpu-bench: round $round, KV $kv: hmoe" >&2
        # -dev none: on a machine with a GPU, hmoe would otherwise put the model there.
        "$HMOE" bench "${common[@]}" -dev none -fa "$FA" >"$RUNS/hmoe-$round-$kv.json"
        echo "cpu-bench: round $round, KV $kv: llama.cpp" >&2
        "$LLAMA_BENCH" "${common[@]}" -fa "$FA_LLAMA" >"$RUNS/llama-$round-$kv.json" 2>/dev/null
    done
done

python3 - "$RUNS" "$OUT" <<'PY'
import json, os, statistics, sys
runs, out = sys.argv[1], sys.argv[2]
by = {}
for f in sorted(os.listdir(runs)):
    engine = "hmoe" if f.startswith("hmoe") else "llama.cpp"
    for r in json.load(open(os.path.join(runs, f))):
        test = f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}"
        if r.get("n_depth"):
            test += f"@d{r['n_depth']}"
        by.setdefault((r["type_k"], test), {}).setdefault(engine, []).append(r["avg_ts"])
rows = []
print("| KV | test | hmoe t/s | llama.cpp t/s | hmoe / llama.cpp |")
print("|---|---|---|---|---|")
for (kv, test), e in by.items():
    h = statistics.median(e.get("hmoe", [float("nan")]))
    l = statistics.median(e.get("llama.cpp", [float("nan")]))
    rows.append({"kv": kv, "test": test, "hmoe_t_s": h, "llama_t_s": l, "ratio": h / l,
                 "hmoe_rounds": e.get("hmoe", []), "llama_rounds": e.get("llama.cpp", [])})
    print(f"| {kv} | {test} | {h:.2f} | {l:.2f} | {h / l:.2f}× |")
if out:
    json.dump({"runs": rows}, open(out, "w"), indent=1)
PY
