#!/usr/bin/env python3
"""Where one speculative step's time goes (issue 23, item 4): measured step against the sum of its passes.

Runs greedy requests with a draft model through the engine core, one step at a time, and splits each step's wall
time into: the target's verification pass, the draft's passes (catch-up and one per depth, timed at the draft
backend's ``forward``), the rest of drafting (sampling, top-k, bookkeeping in Python) and the rest of the step
(verification, commit, engine bookkeeping). Prints the means per step, the calibrated one-token costs (c =
draft / target) and the speed-up the cost model predicts from the measured tau against the one measured.

Usage (idle machine; the CPU is printed):
    scripts/bench/profile_step.py --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --k 4 --prompts 3 \
        --max-tokens 64 [--tree-width 2] [--speculative-backend llama.cpp --threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from draftwise.backends.slots import as_slot_backend
from draftwise.config import SamplingParams
from draftwise.engine import EngineCore
from draftwise.machine import cpu_model_name
from draftwise.models.loading import load_model
from draftwise.proposers.draft_model import DraftModelProposer

CODE_PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome, ignoring case and punctuation.",
    "Write a Python function merge_intervals(intervals) that merges overlapping intervals and returns them sorted.",
    "Implement binary search in Python: def binary_search(items, target) returning the index or -1.",
    "Write a Python class LRUCache with get and put methods, both O(1), using an OrderedDict.",
    "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring and tests.",
]


def one_token_seconds(backend, context: int = 200, repeats: int = 5, rows: int = 1) -> float:
    """Best seconds of a ``rows``-token pass on top of ``context`` tokens (cache emptied afterwards)."""
    ids = [(7 * i + 3) % backend.vocab_size for i in range(context)]
    backend.reset()
    backend.forward(ids, num_logits=1)
    best = float("inf")
    for i in range(repeats):
        t0 = time.perf_counter()
        backend.forward([(11 * i + 5 + j) % backend.vocab_size for j in range(rows)], num_logits=rows)
        best = min(best, time.perf_counter() - t0)
        backend.rollback(context)
    backend.reset()
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--quantization", default="int8")
    parser.add_argument("--speculative-backend", default="torch", choices=("torch", "llama.cpp"))
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--tree-width", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()

    target = load_model(args.target, quantization=args.quantization, runtime="lean")
    if args.speculative_backend == "llama.cpp":
        draft = load_model(args.draft, backend="llama.cpp", threads=args.threads,
                           max_context=target.backend.max_context, drafting=True)
    else:
        draft = load_model(args.draft, quantization=args.quantization, runtime="lean",
                           max_context=target.backend.max_context)
    tb, db = target.backend, draft.backend
    costs = {"target_1": one_token_seconds(tb), "draft_1": one_token_seconds(db),
             f"target_{args.k + 1}": one_token_seconds(tb, rows=args.k + 1)}
    costs["c"] = costs["draft_1"] / costs["target_1"]
    costs["v"] = costs[f"target_{args.k + 1}"] / costs["target_1"]

    proposer = DraftModelProposer(db, tb.vocab_size, tree_width=args.tree_width)
    draft_slots = proposer.slots.backend
    draft_forward = draft_slots.forward
    draft_pass_s: list[float] = []

    def timed_forward(pieces):
        t0 = time.perf_counter()
        out = draft_forward(pieces)
        draft_pass_s.append(time.perf_counter() - t0)
        return out

    draft_slots.forward = timed_forward
    engine = EngineCore(as_slot_backend(tb), proposer, args.k, target.eos_token_ids,
                        max_num_batched_tokens=tb.max_context)
    plain = EngineCore(as_slot_backend(tb), None, 1, target.eos_token_ids, max_num_batched_tokens=tb.max_context)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    steps, committed, plain_s, spec_s = [], 0, 0.0, 0.0
    for text in CODE_PROMPTS[:args.prompts]:
        prompt = target.tokenizer.encode(text)
        for core in (plain, engine):
            sequence = core.add(prompt, params)
            core.step()  # the prefill and the first token
            t_start = time.perf_counter()
            while not sequence.finish_reason:
                draft_pass_s.clear()
                t0 = time.perf_counter()
                core.step()
                wall = time.perf_counter() - t0
                info = core.last_step
                if core is engine and info is not None:
                    steps.append({"wall": wall, "pass": info.pass_s, "draft": info.draft_s,
                                  "draft_passes": sum(draft_pass_s), "num_draft_passes": len(draft_pass_s),
                                  "committed": info.committed_tokens, "rows": info.rows})
            elapsed = time.perf_counter() - t_start
            if core is engine:
                spec_s += elapsed
                committed += len(sequence.generated) - 1
            else:
                plain_s += elapsed

    def mean(key: str) -> float:
        return statistics.fmean(s[key] for s in steps)

    tau = committed / len(steps)
    step = {key: mean(key) for key in ("wall", "pass", "draft", "draft_passes", "num_draft_passes", "committed")}
    step["draft_python"] = step["draft"] - step["draft_passes"]
    step["rest"] = step["wall"] - step["pass"] - step["draft"]
    predicted = tau / (args.k * costs["c"] + costs["v"]) if args.tree_width == 1 else None
    measured = plain_s / spec_s
    print(f"CPU: {cpu_model_name()}; target {args.target} ({args.quantization}), draft {args.draft} "
          f"({args.speculative_backend}), K={args.k}, tree width {args.tree_width}, {len(steps)} steps")
    print(f"calibration @200: target 1 token {costs['target_1'] * 1e3:.1f} ms, draft 1 token "
          f"{costs['draft_1'] * 1e3:.1f} ms, c = {costs['c']:.3f}, v_{args.k + 1} = {costs['v']:.2f}")
    print(f"per step: wall {step['wall'] * 1e3:.1f} ms = target pass {step['pass'] * 1e3:.1f} + draft passes "
          f"{step['draft_passes'] * 1e3:.1f} ({step['num_draft_passes']:.2f} passes) + draft Python "
          f"{step['draft_python'] * 1e3:.1f} + rest {step['rest'] * 1e3:.1f}; tau {tau:.2f}")
    pred = f"{predicted:.2f}x" if predicted else "n/a (tree)"
    print(f"speed-up: measured {measured:.2f}x (decode only, plain {plain_s:.1f} s vs {spec_s:.1f} s), "
          f"predicted from calibration and tau {pred}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"cpu": cpu_model_name(), "args": vars(args), "costs": costs, "step": step, "tau": tau,
                       "measured": measured, "predicted": predicted}, out, indent=2)


if __name__ == "__main__":
    main()
