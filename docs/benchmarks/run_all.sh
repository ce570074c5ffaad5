#!/bin/bash
# Sequential Qwen-pair measurements for issues 4, 8 (bench) and 3 (server load), from a frozen worktree.
set -x
cd /work/benchwt
export PYTHONPATH=/work/benchwt/src OMP_NUM_THREADS=1
PY=/work/main/.venv/bin/python
OUT=/work/main/bench_results
SB=/work/shared/data/spec_bench/question.jsonl
$PY -m draftwise.cli -v bench --prompts $SB,data/prompts/code_edit.jsonl --category coding,summarization,code_editing \
  --limit 4 --methods plain,draft,ngram,hf --ks 4 --k-policies fixed,auto --quantization int8 --max-tokens 128 \
  --output $OUT/qwen-int8-all-methods.json > $OUT/qwen-int8-all-methods.log 2>&1
$PY -m draftwise.cli -v bench --speculative-model random:qwen2.5-coder-0.5b --prompts $SB,data/prompts/code_edit.jsonl \
  --category coding,code_editing --limit 2 --methods plain,draft --ks 4 --k-policies fixed,auto --quantization int8 \
  --max-tokens 128 --output $OUT/qwen-int8-random-draft.json > $OUT/qwen-int8-random-draft.log 2>&1
for mode in plain spec; do
  extra=""; [ $mode = spec ] && extra="--speculative-model qwen2.5-coder-0.5b --num-speculative-tokens 4"
  $PY -m draftwise.cli serve qwen2.5-coder-1.5b $extra --quantization int8 --port 8011 > $OUT/serve-$mode.log 2>&1 &
  pid=$!
  for i in $(seq 300); do curl -sf http://127.0.0.1:8011/health >/dev/null && break; sleep 2; done
  $PY scripts/load_test.py --base-url http://127.0.0.1:8011 --concurrency 1,8 --requests-per-client 2 --max-tokens 64 \
    --ignore-eos --json $OUT/load-$mode.json > $OUT/load-$mode.log 2>&1
  kill $pid; wait $pid
done
echo ALL DONE
