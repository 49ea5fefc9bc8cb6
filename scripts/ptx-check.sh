#!/usr/bin/env bash
# The GPU kernels through NVIDIA's own compilers, without a GPU: NVRTC (as a device compiles
# them at start) and ptxas (as the driver assembles the module it loads) for the GPUs hmoe
# users have: sm_70 (V100), sm_75 (T4, RTX 20), sm_80 (A100), sm_86 (RTX 30), sm_89 (RTX 40)
# and sm_90 (H100, H200). A kernel the driver would refuse (too much shared memory, PTX
# ptxas rejects) makes the whole module fail to load on the GPU, so every kernel with it.
#
#   scripts/ptx-check.sh [ARCH...]     # default: 7.0 7.5 8.0 8.6 8.9 9.0
#
# NVRTC and ptxas come from NVIDIA's Python wheels (nvidia-cuda-nvrtc-cu12,
# nvidia-cuda-nvcc-cu12), installed with pip into PTX_CHECK_DIR (default target/ptx-check)
# the first time. Prints each architecture's most registers and any spills; exit status 1
# when a compile or an assembly fails, 3 when the tools cannot be installed.
set -u
cd "$(dirname "$0")/.."
DIR="${PTX_CHECK_DIR:-${CARGO_TARGET_DIR:-target}/ptx-check}"
TOOLS="$DIR/tools"
mkdir -p "$DIR/out"
if [ ! -x "$TOOLS/nvidia/cuda_nvcc/bin/ptxas" ] || [ ! -e "$TOOLS/nvidia/cuda_nvrtc/lib/libnvrtc.so.12" ]; then
    echo "ptx-check: installing NVRTC and ptxas (pip, about 130 MB)"
    if ! python3 -m pip install -q --no-deps --target "$TOOLS" nvidia-cuda-nvrtc-cu12 nvidia-cuda-nvcc-cu12; then
        echo "ptx-check: could not install NVIDIA's NVRTC/ptxas wheels" >&2
        exit 3
    fi
fi
PTXAS="$TOOLS/nvidia/cuda_nvcc/bin/ptxas"
chmod +x "$PTXAS"
ARCHS=("$@")
[ ${#ARCHS[@]} -gt 0 ] || ARCHS=(7.0 7.5 8.0 8.6 8.9 9.0)
cargo build -q -p hmoe-cuda --example kernel_ptx || exit 1
EXE="${CARGO_TARGET_DIR:-target}/debug/examples/kernel_ptx"
HMOE_CUDA_CACHE=off LD_LIBRARY_PATH="$TOOLS/nvidia/cuda_nvrtc/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    "$EXE" "$DIR/out" "${ARCHS[@]}" || exit 1
status=0
for a in "${ARCHS[@]}"; do
    sm="sm_${a/./}"
    log="$DIR/out/$sm.ptxas.log"
    if ! "$PTXAS" -arch="$sm" -v "$DIR/out/$sm.ptx" -o "$DIR/out/$sm.cubin" > "$log" 2>&1; then
        echo "ptx-check: ptxas $sm FAILED:"
        grep -i -m 20 'error' "$log"
        status=1
        continue
    fi
    python3 - "$log" "$sm" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
parts = re.split(r"Compiling entry function '([^']+)'", text)
rows = []
for name, body in zip(parts[1::2], parts[2::2]):
    regs = re.search(r"Used (\d+) registers", body)
    spill = re.search(r"(\d+) bytes spill stores", body)
    rows.append((int(regs.group(1)) if regs else 0, name, int(spill.group(1)) if spill else 0))
rows.sort(reverse=True)
spills = [f"{n} ({s} B)" for _, n, s in rows if s]
print(f"ptx-check: {sys.argv[2]}: {len(rows)} kernels assembled; most registers "
      + ", ".join(f"{n} {r}" for r, n, _ in rows[:3])
      + (f"; spills: {', '.join(spills)}" if spills else "; no spills"))
PY
done
exit "$status"
