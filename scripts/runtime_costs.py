#!/usr/bin/env python
"""Issue-14 cost table: the lean runtime against the transformers runtime on one machine, side by side.

For each runtime (same weights, same quantization): linear weight bytes and the weight-streaming bound at the
measured DRAM bandwidth, one-token time at contexts 200 and 2,000, the verify curve v_k = t_k / t_1, prefill
of a 2,000-token prompt, and the draft's cost ratio c = t_draft(1) / t_target(1) (also with an FR-Spec head).
Timings alternate between runtimes (A B A B) and report medians, so machine noise hits both alike.

Usage: scripts/runtime_costs.py [--target qwen2.5-coder-1.5b] [--draft qwen2.5-coder-0.5b] [--quantization int8]
       [--runtimes lean,transformers] [--repeats 5] [--draft-vocab-size 32768] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time

import torch

from draftwise.backends.kernels import cpu_description, linear_weight_bytes, measure_dram_bandwidth
from draftwise.frspec import HeadSubset
from draftwise.models.loading import load_model

KS = (2, 4, 8, 16)
PREFILL = 2000


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def step_time(backend, context: int, k: int) -> float:
    """Seconds of one k-token pass on top of ``context`` cached tokens (cache restored afterwards)."""
    seconds = timed(lambda: backend.forward([100 + i for i in range(k)], num_logits=k))
    backend.rollback(context)
    return seconds


VOCAB = [20000]


def prompt(n: int) -> list[int]:
    """n token ids spread over the vocabulary (below VOCAB[0])."""
    return [(1000 + i * 7919) % VOCAB[0] for i in range(n)]


def weights_of(backend) -> int:
    return linear_weight_bytes(backend.model)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--quantization", default="int8")
    parser.add_argument("--runtimes", default="lean,transformers")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--draft-vocab-size", type=int, default=32768)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    runtimes = args.runtimes.split(",")
    bandwidth = measure_dram_bandwidth()
    out = {"cpu": cpu_description(), "threads": torch.get_num_threads(), "dram_bytes_per_s": bandwidth, "runtimes": {}}
    print(out["cpu"], f"| torch threads {out['threads']} | DRAM read {bandwidth / 1e9:.1f} GB/s", flush=True)
    models = {}
    for runtime in runtimes:
        t0 = time.perf_counter()
        target = load_model(args.target, quantization=args.quantization, runtime=runtime).backend
        draft = load_model(args.draft, quantization=args.quantization, runtime=runtime).backend
        fr = load_model(args.draft, quantization=args.quantization, runtime=runtime,
                        head_subset=HeadSubset(size=args.draft_vocab_size)).backend
        models[runtime] = (target, draft, fr)
        VOCAB[0] = min(20000, target.vocab_size)
        global PREFILL
        PREFILL = min(PREFILL, target.max_context - 40)
        print(f"loaded {runtime} in {time.perf_counter() - t0:.0f} s", flush=True)
    # prefill of a 2,000-token prompt (once per runtime, alternating)
    long_prompt = prompt(PREFILL)
    for runtime, (target, draft, fr) in models.items():
        target.reset()
        seconds = timed(lambda: target.forward(long_prompt, num_logits=1))
        out["runtimes"][runtime] = {"prefill_2000_s": seconds, "prefill_tokens_per_s": PREFILL / seconds}
    samples = {r: {} for r in models}
    for context in (min(200, PREFILL // 4), PREFILL):
        for runtime, (target, draft, fr) in models.items():
            for model in (target, draft, fr) if context < PREFILL else (target,):
                model.reset()
                model.forward(prompt(context), num_logits=1)
        for _ in range(args.repeats):
            for runtime, (target, draft, fr) in models.items():
                s = samples[runtime]
                short = context < PREFILL
                for k in (1,) + (KS if short else ()):
                    s.setdefault(("target", "short" if short else "long", k), []).append(step_time(target, context, k))
                if short:
                    s.setdefault(("draft", "short", 1), []).append(step_time(draft, context, 1))
                    s.setdefault(("fr", "short", 1), []).append(step_time(fr, context, 1))
    for runtime, (target, draft, fr) in models.items():
        s = {key: statistics.median(v) for key, v in samples[runtime].items()}
        t1 = s[("target", "short", 1)]
        row = out["runtimes"][runtime]
        row.update({
            "name": target.name, "weight_bytes": weights_of(target), "draft_weight_bytes": weights_of(draft),
            "fr_draft_weight_bytes": weights_of(fr),
            "one_token_ms_ctx200": 1e3 * t1, "one_token_ms_ctx2000": 1e3 * s[("target", "long", 1)],
            "v_k": {k: s[("target", "short", k)] / t1 for k in KS},
            "draft_ms": 1e3 * s[("draft", "short", 1)], "c": s[("draft", "short", 1)] / t1,
            "fr_draft_ms": 1e3 * s[("fr", "short", 1)], "c_fr": s[("fr", "short", 1)] / t1,
        })
        row["bound_ms"] = 1e3 * row["weight_bytes"] / bandwidth
        print(f"\n{runtime} ({target.name}): linear weights {row['weight_bytes'] / 1e9:.2f} GB -> bound "
              f"{row['bound_ms']:.0f} ms/token at {bandwidth / 1e9:.1f} GB/s")
        print(f"  one token: ctx 200 {row['one_token_ms_ctx200']:.0f} ms ({row['one_token_ms_ctx200'] / row['bound_ms']:.2f}x "
              f"bound), ctx 2000 {row['one_token_ms_ctx2000']:.0f} ms ({row['one_token_ms_ctx2000'] / row['one_token_ms_ctx200']:.2f}x ctx 200)")
        print("  v_k: " + "  ".join(f"v_{k} {v:.2f}" for k, v in row["v_k"].items()))
        print(f"  prefill 2000 tokens: {row['prefill_2000_s']:.1f} s ({row['prefill_tokens_per_s']:.0f} tokens/s)")
        print(f"  draft one token {row['draft_ms']:.0f} ms (c = {row['c']:.2f}); FR-Spec {args.draft_vocab_size} "
              f"head {row['fr_draft_ms']:.0f} ms (c = {row['c_fr']:.2f}); draft weights "
              f"{row['draft_weight_bytes'] / 1e9:.2f} -> {row['fr_draft_weight_bytes'] / 1e9:.2f} GB")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(out, handle, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
