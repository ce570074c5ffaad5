#!/usr/bin/env bash
# The main job on a fresh machine: set up, pull the Qwen2.5-Coder demo pair, and benchmark plain vs
# speculative decoding on a few Spec-Bench coding prompts (greedy; prints speedup and acceptance).
# Extra arguments go to `draftwise bench` (e.g. --limit 10 --ks 2,4,6 --max-tokens 128).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/draftwise pull qwen2.5-coder-1.5b qwen2.5-coder-0.5b
.venv/bin/draftwise bench --category coding --limit 3 --max-tokens 64 --ks 4 "$@"
