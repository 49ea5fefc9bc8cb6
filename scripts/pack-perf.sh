#!/usr/bin/env bash
# Packs this machine's `perf` with the shared libraries it loads (all but the C library's own,
# which the device machine has) for `scripts/gpu-session.sh` step 6 on a machine without perf:
#   scripts/pack-perf.sh .carry/perf.tar.xz
# The call then unpacks it into .baseline (`tar -C .baseline -xJf .carry/perf.tar.xz`), where
# step 6 looks for .baseline/perf/perf.
set -euo pipefail
out="${1:?usage: pack-perf.sh OUT.tar.xz}"
perf_bin="$(command -v perf)" || { echo "pack-perf: no perf on this machine" >&2; exit 1; }
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/perf/lib"
cp -L "$perf_bin" "$tmp/perf/perf"
ldd "$perf_bin" | awk '$3 ~ /^\// {print $3}' | while read -r lib; do
    case "$(basename "$lib")" in
        libc.so.*|libm.so.*|ld-linux*) ;;
        *) cp -L "$lib" "$tmp/perf/lib/" ;;
    esac
done
tar -C "$tmp" -cJf "$out" perf
echo "pack-perf: $out ($(du -h "$out" | cut -f1))"
