#!/usr/bin/env python3
"""Two or more builds of the GGUF kernel source side by side in one process: the same layers, the calls of each
build interleaved round by round, so that the machine's drift (measured here: up to 2x between runs) hits every
build alike. Only ratios within one run mean anything.

Each build is ``NAME:SOURCE[:-DFLAG...]``: a copy of ``src/draftwise/backends/kernels/q4k.cpp`` (e.g. from ``git
show REV:src/draftwise/backends/kernels/q4k.cpp > old.cpp``) compiled with the extension's flags and the given
macros. The library namespace is renamed per build, so the copies load side by side.

    PYTHONPATH=src python scripts/bench/kernel_ab.py old:old.cpp new:src/draftwise/backends/kernels/q4k.cpp \\
        [--types Q4_K,Q6_K] [--shapes 2048x1536,17920x1536,1536x8960] [--rows 1] [--threads 2] [--rounds 5]

Per build and layer: microseconds of one call with the weights streamed from DRAM (copies of the layer, 384 MiB
in all, one after the other) and with the one layer hot in the cache, and the GB/s each means; a float-sum probe
of the same copies gives the DRAM rate of the moment. Builds whose outputs differ from the first build's by
more than rounding are flagged.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import re
import time
from pathlib import Path

import numpy as np
import torch

from draftwise.backends.kernels.q4k import _CFLAGS
from draftwise.files import draftwise_home
from draftwise.machine import cpu_model_name
from gguf_kernels import random_packed

#: the op of each type
_OPS = {"Q4_K": "linear", "Q6_K": "linear_q6_k", "Q8_0": "linear_q8_0", "Q5_0": "linear_q5_0"}


def build(name: str, source: Path, flags: list[str], index: int):
    """Compile ``source`` with the namespace renamed to ``ab{index}``; returns ``torch.ops.ab{index}``."""
    from torch.utils import cpp_extension

    text = re.sub(r"TORCH_LIBRARY(_IMPL)?\(draftwise_q4k", rf"TORCH_LIBRARY\1(ab{index}", source.read_text())
    key = hashlib.sha256((text + " ".join(flags)).encode()).hexdigest()[:12]
    build_dir = draftwise_home() / "extensions" / f"ab-{key}"
    build_dir.mkdir(parents=True, exist_ok=True)
    renamed = build_dir / f"ab{index}.cpp"
    renamed.write_text(text)
    torch_lib = Path(torch.__file__).parent / "lib"
    print(f"building {name} ({source}{' ' + ' '.join(flags) if flags else ''})", flush=True)
    cpp_extension.load(name=f"ab_{key}", sources=[str(renamed)], build_directory=str(build_dir),
                       is_python_module=False, extra_cflags=[*_CFLAGS, *flags],
                       extra_ldflags=[f"-L{torch_lib}", "-lgomp", f"-Wl,-rpath,{torch_lib}"], verbose=False)
    return getattr(torch.ops, f"ab{index}")


def seconds(fn, calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - started) / calls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("builds", nargs="+", help="NAME:SOURCE[:-DFLAG...]")
    parser.add_argument("--types", default="Q4_K")
    parser.add_argument("--shapes", default="2048x1536,17920x1536,1536x8960", help="OUTxIN,...")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_model_name()}, {os.cpu_count()} CPUs; {args.threads} threads; rows {args.rows}")
    ops = {}
    for index, spec in enumerate(args.builds):
        name, source, *flags = spec.split(":")
        ops[name] = build(name, Path(source), flags, index)
    rng = np.random.default_rng(0)
    empty = torch.empty(0)
    print("\n| type | layer | build | DRAM us | DRAM GB/s | hot us | hot GB/s |\n|---|---|---|---|---|---|---|")
    for kind in args.types.split(","):
        for shape in args.shapes.split(","):
            out, width = (int(v) for v in shape.split("x"))
            weight = random_packed(kind, out, width, rng)
            copies = [weight] + [weight.clone() for _ in range((384 << 20) // weight.numel())]
            x = torch.randn(args.rows, width)
            op_name = _OPS[kind]
            reference = None
            best = {name: [math.inf, math.inf] for name in ops}
            for _ in range(args.rounds):
                for name, namespace in ops.items():
                    op = getattr(namespace, op_name)
                    y = op(x, weight, empty)
                    if reference is None:
                        reference = y
                    elif not (torch.isfinite(y).all() and torch.isfinite(reference).all() and torch.allclose(
                            y, reference, rtol=1e-4, atol=1e-4 * float(reference.abs().max()))):
                        # builds of different packed layouts read the same bytes differently: timing only
                        print(f"warning: {name} differs from {next(iter(ops))} on {kind} {shape}")
                    streamed = seconds(lambda: [op(x, c, empty) for c in copies], 1) / len(copies)
                    hot = seconds(lambda: op(x, weight, empty), 50)
                    best[name] = [min(best[name][0], streamed), min(best[name][1], hot)]
            probe = min(seconds(lambda: [c.view(-1)[: c.numel() // 4 * 4].view(torch.float32).sum() for c in copies], 1)
                        for _ in range(3)) / len(copies)
            for name, (streamed, hot) in best.items():
                print(f"| {kind} | {shape} | {name} | {streamed * 1e6:.1f} | {weight.numel() / streamed / 1e9:.1f} | "
                      f"{hot * 1e6:.1f} | {weight.numel() / hot / 1e9:.1f} |")
            print(f"| {kind} | {shape} | float-sum probe | | {weight.numel() / probe / 1e9:.1f} | | |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
