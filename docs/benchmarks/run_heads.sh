#!/bin/bash
# Medusa / EAGLE vs n-gram vs plain on the held-out Spec-Bench prompts (2 per category), int8, 1 thread.
set -x
cd /work/benchwt2
export PYTHONPATH=/work/benchwt2/src OMP_NUM_THREADS=1
PY=/work/main/.venv/bin/python
OUT=/work/main/bench_results
M=$1   # smollm2-135m or qwen2.5-coder-0.5b
H=/work/main/heads
$PY -m draftwise.cli -v bench --model $M --prompts $H/$M-medusa/heldout.jsonl --limit 1 \
  --methods plain,ngram,medusa,eagle --medusa-heads $H/$M-medusa --eagle-heads $H/$M-eagle --ks 3 --tree-widths 1,3 \
  --quantization int8 --max-tokens 128 --output $OUT/$M-int8-heads.json > $OUT/$M-int8-heads.log 2>&1
echo HEADS DONE $M
