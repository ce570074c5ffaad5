"""Device check of the CUDA-graph runtime (``draftwise.backends.cuda_graphs.GraphedCausalLM``) on a GPU.

For each ``--models`` entry (``DIR:DTYPE``; DIR holds config.json and tokenizer files: random weights, as
``random:DIR``) one module is run by three backends, each with its own cache, through the same sequence of passes
(a prompt, one-token steps, five-token passes each followed by a rollback of three tokens, a long pass that makes
the static cache grow, then one-token steps again):

- ``graphs``: GraphedCausalLM, passes of up to 8 tokens replayed from captured CUDA graphs;
- ``static eager``: the same backend with ``max_graph_width=0`` (the same code, no graphs);
- ``dynamic``: TorchCausalLM (transformers' dynamic cache; what the runtime replaces).

It prints, per model, the largest logit difference and the positions whose argmax differs between graphs and
static eager (a replay must compute what the eager pass computes) and between graphs and dynamic (a draft's
numerics may differ; a target's must not, which is why a target stays on TorchCausalLM by default), and the
median time of a 1-token and a 5-token ``forward`` call on each backend (milliseconds, CPU copy of the logits
included) and of the 1-token graph's replay alone. Exit code 0 when every replay's argmax matched static
eager's, 1 otherwise, 2 without CUDA.

Usage: ``python scripts/bench/cuda_graph_check.py --models .gpu/q05:bf16,.gpu/q15:fp32 [--out DIR] [--device cpu]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from draftwise.backends.cuda_graphs import GraphedCausalLM
from draftwise.backends.torch_backend import TorchCausalLM
from draftwise.models.loading import load_model

PROMPT = 200
STEPS = 24
TIMED = 15


def sequence(vocab: int) -> list[tuple[str, object]]:
    """The passes every backend runs: ``("forward", ids)`` or ``("rollback", drop)``."""
    ids = lambda n, seed: [(seed * 7919 + 13 * i) % vocab for i in range(n)]  # noqa: E731
    steps: list[tuple[str, object]] = [("forward", ids(PROMPT, 1))]
    steps += [("forward", ids(1, 100 + i)) for i in range(STEPS)]
    for i in range(6):
        steps += [("forward", ids(5, 200 + i)), ("rollback", 3), ("forward", ids(2, 300 + i))]
    steps += [("forward", ids(900, 2))]  # past the first 1,024 positions: the static cache grows
    steps += [("forward", ids(1, 400 + i)) for i in range(STEPS)]
    return steps


def compare(module, vocab: int) -> dict:
    """Run :func:`sequence` on the three backends; differences of graphs against the other two."""
    backends = {"graphs": GraphedCausalLM(module, name="graphs"),
                "static eager": GraphedCausalLM(module, name="static", max_graph_width=0),
                "dynamic": TorchCausalLM(module, name="dynamic")}
    logits: dict[str, list[torch.Tensor]] = {name: [] for name in backends}
    for kind, arg in sequence(vocab):
        for name, backend in backends.items():
            if kind == "rollback":
                backend.rollback(backend.num_cached - arg)
            else:
                logits[name].append(backend.forward(arg, num_logits=min(len(arg), 5)).logits)
    result = {"graphs captured": backends["graphs"].num_graphs, "capacity": backends["graphs"].capacity}
    graphs = torch.cat(logits["graphs"])
    for other in ("static eager", "dynamic"):
        theirs = torch.cat(logits[other])
        result[f"vs {other}"] = {"max_abs_diff": (graphs - theirs).abs().max().item(),
                                 "argmax_flips": int((graphs.argmax(-1) != theirs.argmax(-1)).sum()),
                                 "positions": graphs.shape[0]}
    result["ms"] = {name: timings(backend, vocab) for name, backend in backends.items()}
    return result


def timings(backend, vocab: int) -> dict:
    """Median ms of 1-token and 5-token forward calls on top of a PROMPT-token context (rolled back each time)."""
    backend.reset()
    backend.forward([(3 * i) % vocab for i in range(PROMPT)], num_logits=1)
    out = {}
    for width in (1, 5):
        times = []
        for i in range(TIMED):
            t0 = time.perf_counter()
            backend.forward([(i + j) % vocab for j in range(width)], num_logits=width)
            times.append((time.perf_counter() - t0) * 1e3)
            backend.rollback(PROMPT)
        out[f"{width} token"] = round(statistics.median(times[3:]), 3)
    graph = getattr(backend, "_graphs", {}).get(1)
    if graph is not None:  # the replay alone: what the forward call adds on the host is the difference
        times = []
        for _ in range(TIMED):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            graph.graph.replay()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        out["1 token replay only"] = round(statistics.median(times[3:]), 3)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=".gpu/q05:bf16,.gpu/q15:fp32", help="DIR:DTYPE,...")
    parser.add_argument("--out", default=None, help="folder for cuda_graph_check.json")
    parser.add_argument("--device", default="cuda", help="cpu: try the script itself (no graphs are captured)")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    results, consistent = {}, True
    for entry in args.models.split(","):
        directory, _, dtype = entry.partition(":")
        torch.manual_seed(0)
        loaded = load_model(f"random:{directory}", device=args.device, dtype=dtype or "fp32",
                            runtime="transformers")
        result = compare(loaded.backend.model, loaded.backend.vocab_size)
        results[entry] = result
        consistent &= result["vs static eager"]["argmax_flips"] == 0
        print(entry, json.dumps(result), flush=True)
        del loaded
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if args.out:
        Path(args.out, "cuda_graph_check.json").write_text(json.dumps(results, indent=1))
    return 0 if consistent else 1


if __name__ == "__main__":
    sys.exit(main())
