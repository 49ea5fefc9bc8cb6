#!/usr/bin/env bash
# Runs llama.cpp's server test suite (tools/server/tests, pytest) against hmoe or llama-server,
# with local stand-in models in place of its downloads. Fetches nothing: the suite's folder and
# the server binary are arguments. See docs/server-parity.md.
#
#   scripts/llama-server-tests.sh SUITE_DIR hmoe|llama SERVER_BIN OUT.xml [pytest args, default: unit]
#
# SUITE_DIR: a checkout of llama.cpp's tools/server/tests. SERVER_BIN: the hmoe binary (kind
# hmoe, started as `hmoe serve`) or llama-server (kind llama). Needs HMOE_FIXTURES (the stand-in
# models) and a Python with pytest, requests, openai ($HMOE_PYTHON, else python3).
# SUITE_EXTRA_ARGS: flags added to every server start. PORT: the port (default 18080).
set -euo pipefail
if [ $# -lt 4 ]; then
    sed -n '2,10p' "$0"
    exit 2
fi
suite=$(cd "$1" && pwd)
kind=$2
server=$(realpath "$3")
out=$(realpath -m "$4")
shift 4
here=$(cd "$(dirname "$0")/llama_server_tests" && pwd)
: "${HMOE_FIXTURES:?set HMOE_FIXTURES to the fixtures folder}"
case $kind in hmoe|llama) ;; *) echo "kind must be hmoe or llama" >&2; exit 2 ;; esac
export SUITE_KIND=$kind SUITE_SERVER=$server HMOE_FIXTURES
export LLAMA_SERVER_BIN_PATH=$here/shim.py
export PORT=${PORT:-18080}
export PYTHONPATH=$here${PYTHONPATH:+:$PYTHONPATH}
cd "$suite"
mkdir -p tmp
"${HMOE_PYTHON:-python3}" "$here/cache.py" tmp
[ $# -gt 0 ] || set -- unit
"${HMOE_PYTHON:-python3}" -m pytest -q -p no:cacheprovider --junitxml="$out" "$@" || true
"${HMOE_PYTHON:-python3}" "$here/summary.py" "$kind=$out"
