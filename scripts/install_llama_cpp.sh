#!/usr/bin/env bash
# Compile llama-cpp-python (the version pinned by pyproject.toml's `llama` extra) into .venv from its PyPI
# source, for this machine's CPU (-march=native) but WITHOUT llama.cpp's AMX kernels: a plain
# `pip install llama-cpp-python` compiles them in on CPUs that report AMX, where they crash with SIGILL.
# Also left out: the multimodal library (mtmd), tests, examples, tools, server, CUDA.
#
# Usage: scripts/install_llama_cpp.sh [--force]
#   Skips the build when .venv already has the pinned version without AMX kernels (scripts/check_llama_cpp.py),
#   unless --force. Exits non-zero, with the end of the build log, when the build or the final check fails.
#   Environment: CMAKE_BUILD_PARALLEL_LEVEL (default: every CPU), CFLAGS/CXXFLAGS (extra flags, kept).
#   The build is not cached by pip (the wheel is only right for this CPU); it took 8.5 minutes on
#   2 shared cores here (see docs/llama_cpp.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
CHECK=scripts/check_llama_cpp.py
LOG=.venv/llama-cpp-build.log

if [ ! -x "$PY" ]; then
  echo "error: no .venv here; run scripts/setup.sh" >&2
  exit 1
fi
if [ "${1:-}" != "--force" ]; then
  if reason=$("$PY" "$CHECK" 2>&1); then
    exit 0
  fi
  echo "llama.cpp: $reason"
fi
requirement=$("$PY" "$CHECK" --requirement)

amx_off=""
case "$(uname -m)" in
  x86_64 | amd64)
    # -march=native turns AMX on where the CPU reports it; explicit -mno-* win over -march whatever their order.
    amx_off="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" ;;
esac
export CFLAGS="${CFLAGS:-} $amx_off"
export CXXFLAGS="${CXXFLAGS:-} $amx_off"
export CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
-DGGML_CUDA=OFF -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF \
-DLLAMA_BUILD_SERVER=OFF"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"

echo "compiling $requirement without AMX kernels ($CMAKE_BUILD_PARALLEL_LEVEL jobs; log: $LOG)"
"$PY" -m pip uninstall -q -y llama-cpp-python >/dev/null 2>&1 || true
start=$(date +%s)
if ! "$PY" -m pip install -v --no-cache-dir --no-binary llama-cpp-python "$requirement" >"$LOG" 2>&1; then
  tail -n 60 "$LOG" >&2
  echo "error: building $requirement failed (full log: $LOG)" >&2
  exit 1
fi
echo "llama.cpp build took $(($(date +%s) - start)) s"
if ! "$PY" "$CHECK"; then
  echo "error: $requirement was built but is not usable (see above; build log: $LOG)" >&2
  exit 1
fi
