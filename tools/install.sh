#!/usr/bin/env bash
# Installs what tierkv and its tests need on a fresh Debian 12 / Python 3.11 machine:
# fio (the NVMe benchmark baseline), the xxhash header for the C key chain, torch
# (the CPU wheel 2.13.0 first, so the range in pyproject.toml does not pull a CUDA
# build), then tierkv itself in editable mode with its test extras.
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
if command -v apt-get >/dev/null; then
    $SUDO apt-get update -qq
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fio libxxhash-dev gcc >/dev/null
fi
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e '.[test,metrics]'
python3 -c "import tierkv.keys as k; print('tierkv installed; native key chain:', k.native_available())"
