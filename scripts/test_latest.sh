#!/usr/bin/env bash
# `make test-latest`: the library's tests on the newest torch and Lightning, next to the pinned set.
# Creates .venv-latest/ once (idempotent: a stamp newer than this script and pyproject.toml skips
# the install) with uv's --no-config, so pyproject.toml's [tool.uv] constraint-dependencies (which
# pin torch 2.9.1 for every uv install of the checkout) do not apply, then runs pytest there.
# torchaudio has no release for the newest torch, so the ASR recipe's torchaudio tests skip there.
# Extra pytest arguments: LATEST_PYTEST_ARGS (default: the same selection as `make test`).
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH=${LATEST_TORCH:-2.15.0}
TORCHVISION=${LATEST_TORCHVISION:-0.29.2}
LIGHTNING=${LATEST_LIGHTNING:-2.6.6}
VENV=${LATEST_VENV:-.venv-latest}
PYTHON=${PYTHON:-python3}
UV=.tools/bin/uv
STAMP=$VENV/.lightning-gossip-latest-installed
WANT="torch==$TORCH torchvision==$TORCHVISION lightning==$LIGHTNING"

[ -x "$UV" ] || bash scripts/setup.sh   # setup.sh installs the pinned uv into .tools/
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ] || [ pyproject.toml -nt "$STAMP" ] \
    || [ "$0" -nt "$STAMP" ]; then
  start=$(date +%s)
  [ -x "$VENV/bin/python" ] || "$UV" venv --no-config --quiet --python "$PYTHON" "$VENV"
  echo "[test-latest] installing $WANT and lightning-gossip into $VENV/"
  # Every extra but torchaudio (asr = torchaudio + the three below).
  "$UV" pip install --no-config --quiet --python "$VENV/bin/python" $WANT \
    -e '.[vision,cli,plot,dev]' 'jiwer>=3.0' 'soundfile>=0.12' 'torchmetrics>=1.4'
  echo "[test-latest] installed in $(( $(date +%s) - start )) s"
  # As `make bytecode` does for .venv/: uv installs no .pyc files and with
  # PYTHONDONTWRITEBYTECODE set every launched rank would compile torch and Lightning again.
  start=$(date +%s)
  SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
  "$VENV/bin/python" -m compileall -q -j 0 "$SITE" >/dev/null || true
  echo "[test-latest] compiled the bytecode of $VENV/ in $(( $(date +%s) - start )) s"
  echo "$WANT" > "$STAMP"
fi
"$VENV/bin/python" -m compileall -q lightning_gossip tests recipes benchmarks testbed >/dev/null || true
"$VENV/bin/python" -c 'import torch, lightning; print("[test-latest] torch", torch.__version__,
      "lightning", lightning.__version__)'
start=$(date +%s)
set +e
# make test's selection; benchmarks/perf/parity.py (no doctests) imports the ASR recipe, so its
# doctest collection would fail without torchaudio (tests/conftest.py skips the tests' modules).
# shellcheck disable=SC2086
"$VENV/bin/python" -m pytest -q ${LATEST_PYTEST_ARGS:--n ${TEST_WORKERS:-3} --dist loadfile \
  --durations=25 --doctest-modules --ignore=benchmarks/perf/parity.py lightning_gossip \
  benchmarks testbed tests}
rc=$?
echo "[test-latest] pytest ran $(( $(date +%s) - start )) s (exit $rc)"
exit $rc
