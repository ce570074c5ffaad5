"""Per layer shape and GGUF block type: ms of one call and the weight bytes per second it streams, against the
machine's DRAM read bandwidth (draftwise.machine.measure_dram_bandwidth): how close each row-invariant kernel
(Q4_K, Q6_K, Q8_0, Q5_0, and int8 for comparison) comes to the weight-streaming bound.

    PYTHONPATH=src python scripts/bench/gguf_kernels.py --models qwen2.5-coder-1.5b,qwen2.5-coder-0.5b --rows 1,8

No model files are needed: each layer is built from random but valid blocks of the model's shapes (the kernels'
speed does not depend on the values). So that the weights come from DRAM, not from the cache, as in a decoding
step where every layer is read once, each timed pass calls enough copies of the layer to stream at least
--stream-mib MiB (default 512), one after the other; the time per call is the pass's time divided by the copies,
the fastest of --repeats passes. Run it on an idle machine; the table says which types each model's GGUF file
stores in which layers (Q4_K_M of Qwen2.5-Coder: see docs/kernels.md).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import time

import numpy as np
import torch

from draftwise.backends.kernels import cpu_description, llama_linear_shapes, measure_dram_bandwidth
from draftwise.backends.kernels.gguf_blocks import BLOCK_FORMATS, GGUFBlockLinear, gguf_linear
from draftwise.backends.kernels.q4k import GGUF_BLOCK_BYTES, Q4KLinear
from draftwise.backends.quantization import Int8Linear
from draftwise.machine import torch_threads
from kernel_table import PRESETS

TYPES = ("Q4_K", "Q6_K", "Q8_0", "Q5_0", "int8")
#: bytes per block and where its fp16 scales lie, for the random blocks
_LAYOUT = {"Q4_K": (256, GGUF_BLOCK_BYTES, (0, 2)), **{
    name: (f.block_weights, f.block_bytes, (208,) if name == "Q6_K" else (0,)) for name, f in BLOCK_FORMATS.items()}}


def random_rows(kind: str, out_features: int, in_features: int, rng: np.random.Generator) -> np.ndarray:
    """Random valid GGUF rows of type ``kind`` (not int8) for an ``[out, in]`` weight (``in`` a multiple of the
    type's block), as a file stores them: ``[out, in / block * block bytes]`` uint8."""
    block, nbytes, scales = _LAYOUT[kind]
    nb = in_features // block
    raw = rng.integers(0, 256, size=(out_features, nb, nbytes), dtype=np.uint8)
    for at in scales:
        raw[..., at:at + 2] = np.array([1e-3], dtype=np.float16).view(np.uint8).reshape(1, 1, 2)
    return raw.reshape(out_features, nb * nbytes)


def random_packed(kind: str, out_features: int, in_features: int, rng: np.random.Generator) -> torch.Tensor:
    """:func:`random_rows` in the layout its kernel reads (Q4_K and Q6_K regrouped, the others as stored)."""
    return random_layer(kind, out_features, in_features, rng).packed


def random_layer(kind: str, out_features: int, in_features: int, rng: np.random.Generator) -> torch.nn.Module | None:
    """A layer of type ``kind`` with random valid blocks ``[out, in]``, or None when ``in`` is not a multiple
    of the type's block."""
    if kind == "int8":
        return Int8Linear(torch.randn(out_features, in_features) / math.sqrt(in_features), None)
    if in_features % _LAYOUT[kind][0]:
        return None
    return gguf_linear(kind, random_rows(kind, out_features, in_features, rng))


def layer_bytes(layer: torch.nn.Module) -> int:
    """Weight bytes one call reads (scales included)."""
    if isinstance(layer, Int8Linear):
        return layer.out_features * layer.in_features + 8 * layer.out_features
    return layer.weight_bytes


def clone_layer(layer: torch.nn.Module) -> torch.nn.Module:
    """A copy with its own weight memory (a different address, so not in the cache with the original)."""
    if isinstance(layer, Int8Linear):
        return Int8Linear(torch.randn(layer.out_features, layer.in_features), None)
    if isinstance(layer, Q4KLinear):
        return Q4KLinear(layer.packed.clone())
    return GGUFBlockLinear(layer.format, layer.gguf_rows().clone())


@torch.inference_mode()
def time_call(layer: torch.nn.Module, rows: int, stream_bytes: int, repeats: int) -> float:
    """Seconds of one ``rows``-row call with the weights streamed from memory (see the module docstring)."""
    copies = [layer] + [clone_layer(layer) for _ in range(max(0, -(-stream_bytes // layer_bytes(layer)) - 1))]
    x = torch.randn(rows, layer.in_features)
    for copy in copies:
        copy(x)
    best = math.inf
    for _ in range(repeats):
        started = time.perf_counter()
        for copy in copies:
            copy(x)
        best = min(best, (time.perf_counter() - started) / len(copies))
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(PRESETS), help=f"comma-separated of {', '.join(PRESETS)}")
    parser.add_argument("--types", default=",".join(TYPES), help=f"comma-separated of {', '.join(TYPES)}")
    parser.add_argument("--rows", default="1", help="comma-separated row counts per call (1: decoding)")
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads (default: torch's)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--stream-mib", type=int, default=512, help="weights streamed per timed pass (MiB)")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    rows = [int(r) for r in args.rows.split(",")]
    by_name = {name.lower().replace("_", ""): name for name in TYPES}
    unknown = [t for t in args.types.split(",") if t.lower().replace("_", "") not in by_name]
    if unknown:
        parser.error(f"--types: unknown {', '.join(unknown)}; choose from {', '.join(TYPES)}")
    args.types = ",".join(by_name[t.lower().replace("_", "")] for t in args.types.split(","))
    rng = np.random.default_rng(0)
    with torch_threads(args.threads) as threads:
        print(f"CPU: {cpu_description()}; torch {torch.__version__}, {threads} threads; load average at start "
              f"{', '.join(f'{v:.1f}' for v in os.getloadavg())}\n")
        bandwidth = measure_dram_bandwidth(threads=threads)
        print(f"DRAM read bandwidth: {bandwidth / 1e9:.1f} GB/s (draftwise.machine.measure_dram_bandwidth)\n")
        for model in args.models.split(","):
            shapes = llama_linear_shapes(**PRESETS[model])
            print(f"## {model}\n")
            print("| layer | type | rows | ms per call | MB read | GB/s | % of DRAM bandwidth |")
            print("|---|---|---|---|---|---|---|")
            for shape in shapes:
                for kind in args.types.split(","):
                    layer = random_layer(kind, shape.out_features, shape.in_features, rng)
                    if layer is None:
                        continue
                    nbytes = layer_bytes(layer)
                    for m in rows:
                        seconds = time_call(layer, m, args.stream_mib << 20, args.repeats)
                        rate = nbytes / seconds
                        print(f"| {shape.name} {shape.key} | {kind} | {m} | {seconds * 1e3:.3f} | {nbytes / 1e6:.2f} | "
                              f"{rate / 1e9:.1f} | {100 * rate / bandwidth:.0f} |", flush=True)
                    del layer
            print()
        print(f"load average at the end: {', '.join(f'{v:.1f}' for v in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
