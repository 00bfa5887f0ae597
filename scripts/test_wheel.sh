#!/usr/bin/env bash
# `make test-wheel`: the wheel on its own. Builds the wheel, installs it (with the pinned
# dependency set of constraints.txt) into a new virtual environment outside the repository, and
# from a directory outside the repository, without PYTHONPATH, runs `lightning-gossip --help`
# and a 2-rank fit under each strategy (scripts/wheel_fit.py, copied out) with torchrun.
# WHEEL_WORK: where to build (default: a new temporary directory, removed afterwards).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
UV=$REPO/.tools/bin/uv
PYTHON=${PYTHON:-python3}
[ -x "$UV" ] || bash scripts/setup.sh
WORK=${WHEEL_WORK:-$(mktemp -d)}
[ -n "${WHEEL_WORK:-}" ] || trap 'rm -rf "$WORK"' EXIT
start=$(date +%s)
rm -rf "$WORK/dist" "$WORK/venv" "$WORK/run"
"$UV" build --no-config --quiet --wheel --out-dir "$WORK/dist" "$REPO"
echo "[test-wheel] built $(basename "$WORK"/dist/*.whl) in $(( $(date +%s) - start )) s"
"$UV" venv --no-config --quiet --python "$PYTHON" "$WORK/venv"
"$UV" pip install --no-config --quiet --python "$WORK/venv/bin/python" \
  -c "$REPO/constraints.txt" "$(ls "$WORK"/dist/*.whl)"
echo "[test-wheel] installed into a clean venv after $(( $(date +%s) - start )) s"
mkdir -p "$WORK/run"
cp "$REPO/scripts/wheel_fit.py" "$WORK/run/"
cd "$WORK/run"
export -n PYTHONPATH 2>/dev/null || true
unset PYTHONPATH
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
"$WORK/venv/bin/lightning-gossip" --help | head -3
PORT=$("$WORK/venv/bin/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
out=$(timeout 900 "$WORK/venv/bin/torchrun" --nproc-per-node 2 --master-addr 127.0.0.1 \
  --master-port "$PORT" wheel_fit.py "$WORK/run" 2>&1) || { echo "$out" | tail -40; exit 1; }
# torchrun merges the ranks' output: two lines may run together, so count the ranks named
ok=$(echo "$out" | grep -o "WHEEL-OK [0-9]*" | sort -u | wc -l)
echo "$out" | grep -o "WHEEL-OK [0-9]* [^ ]*\.py" || true
[ "$ok" = 2 ] || { echo "$out" | tail -40; echo "[test-wheel] FAILED: $ok of 2 ranks"; exit 1; }
echo "[test-wheel] passed in $(( $(date +%s) - start )) s"
