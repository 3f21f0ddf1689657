#!/usr/bin/env bash
# The CPU test suite (what CI runs, after scripts/setup.sh): Rust unit tests, JIT compilation
# of every production kernel configuration for sm_80 and sm_90a with no register spills, and
# the Python tests that need no GPU. GPU tests (`-m gpu`) run through scripts/gpu_check.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH" VIRTUAL_ENV="$PWD/.venv"
export PYO3_PYTHON="$PWD/.venv/bin/python"
# NVRTC is loaded from the pip wheels; precompile writes to a throw-away cache.
if [ -z "${FERROATTN_CACHE_DIR:-}" ]; then
    FERROATTN_CACHE_DIR=$(mktemp -d)
    trap 'rm -rf "$FERROATTN_CACHE_DIR"' EXIT
fi
export FERROATTN_CACHE_DIR
# The Rust NVRTC tests compile real kernels against the headers of the nvidia-cuda-runtime wheel.
export FERROATTN_TEST_CUDA_INCLUDE="$(python -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13", "include"))')"
echo "== cargo test =="
cargo test --release --quiet
echo "== precompile sm_80, sm_90a (fails on compile errors or spills) =="
python -m ferroattn precompile --arch sm_80,sm_90a --check-spills
echo "== pytest (CPU) =="
python -m pytest -q -m "not gpu" tests
