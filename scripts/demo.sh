#!/usr/bin/env bash
# The main job on a fresh machine: set up, pull the Qwen2.5-Coder demo pair, and benchmark plain vs
# speculative decoding on a few Spec-Bench coding prompts (greedy; prints speedup and acceptance), then
# replay a short agent session (one 3-turn coding session from data/agent_sessions.jsonl, each turn carrying
# the whole conversation so far: plain with and without prefix reuse vs draft model, n-gram and suffix
# decoding; prints the agent-loop speed-up). Both runs use the batch-invariant int8 path (exact, and the
# fastest on these CPUs); the draft runs on the runtime `--speculative-backend auto` measures fastest here (the
# lean PyTorch one, llama.cpp on the GGUF file or on a Q4_0 copy; measured once, cached per machine). Extra
# arguments go to both `draftwise bench` runs and win (e.g. --ks 2,4,6, or --speculative-backend torch).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/draftwise pull qwen2.5-coder-1.5b qwen2.5-coder-0.5b
.venv/bin/draftwise bench --category coding --limit 3 --max-tokens 64 --ks 4 --quantization int8 \
  --speculative-backend auto "$@"
.venv/bin/draftwise bench --workload agent --limit 1 --agent-turns 3 --max-tokens 96 \
  --methods plain,plain-nocache,draft,ngram,suffix --ks 4 --quantization int8 --speculative-backend auto "$@"
