#!/usr/bin/env bash
# Create .venv with a CPU build of torch, draftwise (editable, with test extras) and llama-cpp-python compiled
# here without AMX kernels (scripts/install_llama_cpp.sh: 8.5 minutes on 2 shared cores the first time).
# Usage: scripts/setup.sh            (idempotent; quick when already set up)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  # torch 2.13.0 CPU: on these machines the wheel lies in pip's find-links (/opt/wheels). Elsewhere set
  # TORCH_INDEX=https://download.pytorch.org/whl/cpu to avoid pulling a multi-GB CUDA build.
  if [ -n "${TORCH_INDEX:-}" ]; then
    .venv/bin/pip install -q --index-url "$TORCH_INDEX" "torch==2.13.0"
  else
    .venv/bin/pip install -q "torch==2.13.0"
  fi
fi
.venv/bin/pip install -q -e '.[test]'
scripts/install_llama_cpp.sh
