#!/usr/bin/env python
"""Time one draft forward pass of one token with the full LM head and with FR-Spec subset heads.

    python scripts/frspec_timing.py qwen2.5-coder-0.5b --sizes 0,32768 --quantization none,int8 --runs 30

For each (quantization, subset size) the model is loaded alone (size 0 = the full head), a 128-token context is
prefilled, then one-token passes are timed at that context (the cache is rolled back after each): the median
and the 10th / 90th percentiles of ``--runs`` passes after ``--warmup`` passes, in milliseconds.
"""

from __future__ import annotations

import argparse
import gc
import logging
import statistics
import sys
import time

import torch

from draftwise.frspec import HeadSubset, head_nbytes
from draftwise.models.loading import load_model

logger = logging.getLogger("frspec_timing")


def time_one_token(backend, context: list[int], runs: int, warmup: int) -> list[float]:
    """Seconds of ``runs`` one-token passes after ``context`` (rolled back after each pass)."""
    backend.reset()
    backend.forward(context[:-1])
    base = backend.num_cached
    times = []
    for i in range(warmup + runs):
        started = time.perf_counter()
        backend.forward(context[-1:], num_logits=1)
        elapsed = time.perf_counter() - started
        backend.rollback(base)
        if i >= warmup:
            times.append(elapsed)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--sizes", default="0,32768", help="subset sizes; 0 = the full head")
    parser.add_argument("--quantization", default="none,int8")
    parser.add_argument("--token-map", default=None)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for quantization in args.quantization.split(","):
        for size in (int(s) for s in args.sizes.split(",")):
            subset = HeadSubset(size=size, token_map=args.token_map) if size else None
            loaded = load_model(args.model, device="cpu", quantization=quantization, head_subset=subset)
            context = loaded.encode("def quicksort(items):\n    \"\"\"Sort a list.\"\"\"\n" * 8)[:128]
            times = sorted(time_one_token(loaded.backend, context, args.runs, args.warmup))
            head = loaded.backend.model.get_output_embeddings()
            q = statistics.quantiles(times, n=10)
            rows.append((quantization, size or "full", head_nbytes(head) / 2**20, 1e3 * statistics.median(times),
                         1e3 * q[0], 1e3 * q[-1]))
            logger.info("%s %s: head %.1f MiB, one token median %.2f ms (p10 %.2f, p90 %.2f)", *rows[-1])
            del loaded, head
            gc.collect()
    print(f"threads {torch.get_num_threads()}")
    print("| quantization | head rows | head MiB | one token, ms (median) | p10 | p90 |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print("| {} | {} | {:.1f} | {:.2f} | {:.2f} | {:.2f} |".format(*row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
