#!/usr/bin/env bash
# The GPU check, in one script for a machine with one CUDA GPU (sized for under 5 minutes
# on one H200): the `gpu`-marked tests of the engine copies and the HBM tier, the kernel's
# NVRTC build checks, then the GPU copy benchmark (tierkv.bench.gpu) and the codec's GPU
# decoder benchmark (tierkv.bench.gpu_codec). Self-contained: it
# builds nothing, needs no network, and runs without tierkv's C extensions. Python
# packages the machine lacks (lmdb on the H200 image) travel as wheels in .whl/, which
# this script installs into /tmp/site first. Results go to $OUT (or out/gpu_check):
# nvidia-smi.txt, pytest.log, gpu_bench.json, gpu_bench.log, gpu_codec.json, gpu_codec.log.
# Exits non-zero when a test
# fails or the benchmark does not finish; the benchmark runs even after a test failure.
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS="${OUT:-out/gpu_check}"
mkdir -p "$RESULTS"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null; then
    # Wheels are built for the GPU image's Python (cp312); elsewhere carry on with what is installed.
    if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl; then
        export PYTHONPATH="$PYTHONPATH:/tmp/site"
    else
        echo "gpu_check: could not install .whl/*.whl; using the packages already installed" >&2
    fi
fi
nvidia-smi >"$RESULTS/nvidia-smi.txt" 2>&1 || echo "gpu_check: nvidia-smi failed" >&2
"$PY" - <<'EOF' 2>&1 | tee -a "$RESULTS/nvidia-smi.txt"
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
try:
    import cupy
    print("cupy", cupy.__version__)
except Exception as exc:  # noqa: BLE001
    print("cupy missing:", exc)
EOF

status=0
start=$(date +%s)
timeout 150 "$PY" -m pytest -p no:cacheprovider -q -m gpu tests/engine tests/tiers tests/codec/test_gpu_device.py \
    2>&1 | tee "$RESULTS/pytest.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
timeout 30 "$PY" -m pytest -p no:cacheprovider -q tests/engine/test_kernel_source.py \
    tests/codec/test_gpu_device.py::test_kernel_compiles_for_hopper 2>&1 | tee -a "$RESULTS/pytest.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
echo "gpu_check: tests took $(( $(date +%s) - start )) s" | tee -a "$RESULTS/pytest.log"

start=$(date +%s)
# BENCH_ARGS="--device cpu" smoke-tests this script on a machine without a GPU.
timeout 150 "$PY" -m tierkv.bench.gpu --json ${BENCH_ARGS:-} >"$RESULTS/gpu_bench.json" 2>"$RESULTS/gpu_bench.log"
bench=$?
cat "$RESULTS/gpu_bench.log"
[ "$bench" -eq 0 ] || { echo "gpu_check: benchmark failed (exit $bench)" >&2; status=1; }
echo "gpu_check: benchmark took $(( $(date +%s) - start )) s"
[ "$bench" -eq 0 ] && "$PY" - "$RESULTS/gpu_bench.json" <<'EOF' 
import json, sys
r = json.load(open(sys.argv[1]))
print("device:", r["device"], "kernel:", r["kernel_available"])
for case in r["engine"] + r["tiers"]:
    for path, ratios in case["ratios"].items():
        print(f"{case.get('layout', 'tiers'):>26} x{case['blocks']:<4} {path:>16}: "
              + "  ".join(f"{op} {v:.2f}" for op, v in ratios.items()))
print("headline:", json.dumps(r["headline"]))
EOF

start=$(date +%s)
# The codec's GPU decoder against the raw pages' copy (tierkv.bench.gpu_codec).
timeout 90 "$PY" -m tierkv.bench.gpu_codec --json ${BENCH_ARGS:-} >"$RESULTS/gpu_codec.json" 2>"$RESULTS/gpu_codec.log"
codec_bench=$?
cat "$RESULTS/gpu_codec.json" "$RESULTS/gpu_codec.log"
[ "$codec_bench" -eq 0 ] || { echo "gpu_check: codec benchmark failed (exit $codec_bench)" >&2; status=1; }
echo "gpu_check: codec benchmark took $(( $(date +%s) - start )) s"
exit $status
