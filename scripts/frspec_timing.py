#!/usr/bin/env python
"""Time one draft forward pass of one token with the full LM head and with FR-Spec subset heads.

    python scripts/frspec_timing.py qwen2.5-coder-0.5b --sizes 0,32768 --quantization none,int8 --runs 30

For each quantization, the model is loaded once per subset size (size 0 = the full head) and a 128-token
context is prefilled in each; then one-token passes at that context (the cache rolled back after each) are
timed round robin across the sizes, so that on a shared machine every size sees the same interference. Printed:
the median and the 10th / 90th percentiles of ``--runs`` passes after ``--warmup`` passes, in milliseconds,
and each median over the full head's.
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


def prefill(backend, context: list[int]) -> int:
    """Fill the cache with all of ``context`` but its last token; returns the cache length."""
    backend.reset()
    backend.forward(context[:-1])
    return backend.num_cached


def one_token(backend, token: int, base: int) -> float:
    """Seconds of one one-token pass after a cache of ``base`` tokens (rolled back to it afterwards)."""
    started = time.perf_counter()
    backend.forward([token], num_logits=1)
    elapsed = time.perf_counter() - started
    backend.rollback(base)
    return elapsed


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
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = []
    for quantization in args.quantization.split(","):
        models = [load_model(args.model, device="cpu", quantization=quantization,
                             head_subset=HeadSubset(size=size, token_map=args.token_map) if size else None)
                  for size in sizes]
        context = models[0].encode("def quicksort(items):\n    \"\"\"Sort a list.\"\"\"\n" * 8)[:128]
        bases = [prefill(m.backend, context) for m in models]
        times: list[list[float]] = [[] for _ in models]
        for i in range(args.warmup + args.runs):
            for j, model in enumerate(models):
                elapsed = one_token(model.backend, context[-1], bases[j])
                if i >= args.warmup:
                    times[j].append(elapsed)
        full = None
        for size, model, runs in zip(sizes, models, times):
            median, q = statistics.median(runs), statistics.quantiles(runs, n=10)
            full = median if size == 0 else full
            head = head_nbytes(model.backend.model.get_output_embeddings()) / 2**20
            rows.append((quantization, size or "full", head, 1e3 * median, 1e3 * q[0], 1e3 * q[-1],
                         median / full if full else float("nan")))
            logger.info("%s %s: head %.1f MiB, one token median %.2f ms (p10 %.2f, p90 %.2f), x%.2f", *rows[-1])
        del models
        gc.collect()
    print(f"threads {torch.get_num_threads()}")
    print("| quantization | head rows | head MiB | one token, ms (median) | p10 | p90 | median / full head's |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print("| {} | {} | {:.1f} | {:.2f} | {:.2f} | {:.2f} | {:.2f} |".format(*row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
