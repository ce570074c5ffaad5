"""Probe: what a captured CUDA graph would save per decoded token on a GPU (docs/gpu.md, section 4).

draftwise's ``TorchCausalLM`` runs transformers eagerly: on an H200 one token of a 1.5B model costs ~20 ms,
about 15x its weight-streaming bound, and a 0.5B draft costs as much as the 1.5B target (c ~ 1), so a draft model
cannot pay there. This script times, for each ``--models`` directory (config.json + tokenizer: random weights, as
``random:DIR``) and dtype, one decode step (1 token after a ``--context``-token prompt, transformers'
``StaticCache``) run eagerly and replayed from a captured ``torch.cuda.CUDAGraph``, and a 5-token pass eagerly.
It measures the gap only; nothing in draftwise captures graphs yet.

Usage: ``python scripts/cuda_graph_probe.py --models .gpu/q05:bf16,.gpu/q15:fp32 [--context 200] [--device cuda]``
(``--device cpu`` times the eager steps alone, to try the script without a GPU). Prints one line per measurement.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM, StaticCache

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _timed_ms(fn, repeats: int, synchronize) -> float:
    """Mean milliseconds of ``fn()`` over ``repeats`` calls (after a synchronize on each side)."""
    synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    synchronize()
    return (time.perf_counter() - start) / repeats * 1e3


def probe(directory: str, dtype: torch.dtype, context: int, device: str) -> None:
    """Print eager 1-token and 5-token pass times and the CUDA graph replay time of ``directory``'s shapes."""
    synchronize = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    config = AutoConfig.from_pretrained(directory)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    cache = StaticCache(config=config, max_cache_len=context + 256)  # newer transformers count positions themselves
    label = f"{directory} {str(dtype).removeprefix('torch.')}"
    with torch.no_grad():
        prompt = torch.randint(0, 1000, (1, context), device=device)
        model(input_ids=prompt, cache_position=torch.arange(context, device=device), past_key_values=cache)
        token = torch.zeros(1, 1, dtype=torch.long, device=device)   # [1, 1], static for the graph
        position = torch.tensor([context], device=device)            # [1]: the step rewrites one slot
        five = torch.zeros(1, 5, dtype=torch.long, device=device)
        five_positions = torch.arange(context, context + 5, device=device)

        def step():
            return model(input_ids=token, cache_position=position, past_key_values=cache).logits

        eager = _timed_ms(step, 20, synchronize)
        eager5 = _timed_ms(lambda: model(input_ids=five, cache_position=five_positions, past_key_values=cache), 10,
                           synchronize)
        print(f"{label}: eager 1 token {eager:.2f} ms, 5 tokens {eager5:.2f} ms", flush=True)
        if device != "cuda":
            return
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the default stream, as capture requires
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        replay = _timed_ms(graph.replay, 50, synchronize)
        print(f"{label}: CUDA graph 1 token {replay:.2f} ms ({eager / replay:.1f}x faster than eager)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=".gpu/q05:bf16,.gpu/q15:fp32", help="DIR:DTYPE,... (dtype fp32/bf16/fp16)")
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    for entry in args.models.split(","):
        directory, _, dtype = entry.partition(":")
        probe(directory, DTYPES[dtype or "fp32"], args.context, args.device)
        if args.device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
