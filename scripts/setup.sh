#!/usr/bin/env bash
# Installs hicache_async and what it needs on a fresh Debian/Ubuntu machine.
#   scripts/setup.sh          the package (torch==2.13.0 from pip's index) — enough for the demo
#   scripts/setup.sh --dev    also test tools (uvloop among them), redis-server and Mooncake,
#                             for the test suite and the benchmarks
set -euo pipefail
cd "$(dirname "$0")/.."

dev=0
[ "${1:-}" = "--dev" ] && dev=1

python=${PYTHON:-python3}
# torch is pinned here, not in pyproject.toml: a bare "torch" resolves to a multi-GB CUDA build.
torch_pin=${HICACHE_TORCH:-torch==2.13.0}

if [ "$dev" = 1 ]; then
  sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo"
  if ! command -v redis-server >/dev/null 2>&1 || ! ldconfig -p | grep -q libibverbs.so.1; then
    export DEBIAN_FRONTEND=noninteractive
    $sudo apt-get update -qq
    $sudo apt-get install -y -qq redis-server libibverbs1 >/dev/null
  fi
  "$python" -m pip install -q --disable-pip-version-check -e '.[dev,mooncake]' "$torch_pin" numpy
else
  "$python" -m pip install -q --disable-pip-version-check -e . "$torch_pin" numpy
fi
