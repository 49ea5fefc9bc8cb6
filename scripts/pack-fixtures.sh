#!/usr/bin/env bash
# Packs a fixtures folder (default: ../shared/fixtures, where the team regenerates them) into the
# repository's fixtures/: one reproducible .tar.xz per top-level folder, the top-level plain files
# as they are. The tests unpack them (crates/testdata); its test compares the two when both exist.
#   scripts/pack-fixtures.sh [FIXTURES_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
SRC="$(cd "${1:-../shared/fixtures}" && pwd)"
OUT="$PWD/fixtures"
rm -rf "$OUT" && mkdir -p "$OUT"
cd "$SRC"
for entry in *; do
    if [ -d "$entry" ]; then
        tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -cf - "$entry" \
            | xz -6 -T1 > "$OUT/$entry.tar.xz"
    else
        cp "$entry" "$OUT/"
    fi
done
du -sh "$OUT"
