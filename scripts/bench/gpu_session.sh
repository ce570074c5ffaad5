#!/usr/bin/env bash
# One lent GPU session's checks, in one command (docs/gpu.md, "Re-running it"). Run from the repository root
# on the GPU machine:  OUT=/some/dir bash scripts/bench/gpu_session.sh
#
# Expects, prepared on the developer's machine and carried (both ignored by git):
#   .gpu/stories260K.gguf, .gpu/question.jsonl (Spec-Bench), .gpu/q15 and .gpu/q05 (config.json, tokenizer files
#   and generation_config.json of Qwen2.5-Coder 1.5B and 0.5B: `random:DIR` builds their shapes, no weights);
#   .whl/ (optional): wheels of the packages the machine lacks (gguf, fastapi, pydantic, ...).
# Each step runs under its own time limit and writes to $OUT; a failed step does not stop the others.
set -u
OUT=${OUT:?set OUT to a writable directory}
export PYTHONUNBUFFERED=1 DRAFTWISE_HOME=/tmp/dwhome HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=$PWD/src:/tmp/site
else
    export PYTHONPATH=$PWD/src
fi
DW="python3 -m draftwise.cli"
DEVICE=${DEVICE:-cuda}  # cpu only to try this script itself

step() {  # step NAME SECONDS COMMAND...: run COMMAND under a limit, log to $OUT/NAME.log, stamp its wall time
    local name=$1 limit=$2; shift 2
    local start=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name rc=$rc ${limit}s-limit took=$((SECONDS - start))s" | tee -a "$OUT/steps.txt"
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; lscpu | grep "Model name";
  python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"; } >"$OUT/env.txt" 2>&1

# 1. The CUDA-graph runtime against the same passes run eagerly (static and dynamic cache), and its pass times.
step graph_check 150 python3 scripts/bench/cuda_graph_check.py --models .gpu/q05:bf16,.gpu/q15:fp32 \
    --out "$OUT"
# 2. Costs of Qwen2.5-Coder shapes (random weights): the target's k-token passes and the 0.5B draft's c (a draft
#    on a GPU runs on CUDA graphs by default).
step costs 100 $DW costs random:.gpu/q15 --draft random:.gpu/q05 --device "$DEVICE" --ks 1,2,3,5,9 --repeats 5
# 3. End to end on the 1.5B's shapes: the fp32 target (eager) drafted by the same weights in bf16 (CUDA graphs);
#    the auto draft stop and full K=4 chains (random weights' flat distributions stop auto chains early).
step bench_q15 150 $DW bench --model random:.gpu/q15 --speculative-model random:.gpu/q15 --methods plain,draft,ngram \
    --ks 4 --draft-confidence auto,0 --device "$DEVICE" --prompts .gpu/question.jsonl --category coding --limit 3 \
    --max-tokens 64 --ignore-eos --no-plots --output "$OUT/bench_q15.json"
# 4. The same with the target on CUDA graphs too (--runtime cuda-graphs): plain decoding and its verify passes.
step bench_q15_graphs 200 $DW bench --model random:.gpu/q15 --speculative-model random:.gpu/q15 \
    --methods plain,draft --ks 4 --runtime cuda-graphs --device "$DEVICE" --prompts .gpu/question.jsonl \
    --category coding --limit 3 --max-tokens 64 --ignore-eos --no-plots --output "$OUT/bench_q15_graphs.json"
# 5. Exactness with the default dtypes (fp32 target, eager): a trained tiny model and a random 2048-wide Llama.
step gpu_check 150 python3 scripts/bench/gpu_check.py --model .gpu/stories260K.gguf --prompts 6 --max-tokens 48 \
    --out "$OUT" --device "$DEVICE"
ls -R "$OUT" >"$OUT/files.txt" 2>&1  # only 8 files come back from a lent machine: read the rest from the tail
for log in "$OUT"/*.log; do echo "== $log"; tail -n 12 "$log"; done
