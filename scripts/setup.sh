#!/usr/bin/env bash
# Idempotent set-up used by `make demo` and `make test`: a pinned uv in .tools/, the project
# and its tested dependency set in .venv/, and the system packages the recipes need.
set -euo pipefail
cd "$(dirname "$0")/.."

UV_VERSION=0.13.9
PYTHON=${PYTHON:-python3}
STAMP=.venv/.lightning-gossip-installed

if [ ! -x .tools/bin/uv ] || [ "$(.tools/bin/uv --version | cut -d' ' -f2)" != "$UV_VERSION" ]; then
  echo "[setup] installing uv $UV_VERSION into .tools/"
  "$PYTHON" -m venv .tools
  .tools/bin/pip install --quiet --disable-pip-version-check "uv==$UV_VERSION"
fi

if ! command -v espeak-ng >/dev/null 2>&1; then
  echo "[setup] installing espeak-ng (speech synthesizer for the synthetic ASR corpus)"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq espeak-ng >/dev/null
fi

if [ "$(id -u)" -eq 0 ] && ! command -v iptables >/dev/null 2>&1; then
  # the emulated cluster's link latency where the kernel has no netem (testbed/link_delay.py);
  # without it those tests skip and say why, so a failed install does not stop the set-up
  echo "[setup] installing iptables (link latency of the emulated cluster)"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iptables >/dev/null) \
    || echo "[setup] iptables not installed: the emulated cluster's latency test will skip"
fi

if [ -f "$STAMP" ] && [ "$STAMP" -nt pyproject.toml ] && [ "$STAMP" -nt constraints.txt ]; then
  exit 0
fi
[ -x .venv/bin/python ] || .tools/bin/uv venv --quiet --python "$PYTHON" .venv
echo "[setup] installing lightning-gossip and its pinned dependencies into .venv/ (first time: a few minutes)"
.tools/bin/uv pip install --quiet --python .venv/bin/python -c constraints.txt -e '.[all]'
touch "$STAMP"
