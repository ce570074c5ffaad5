"""Print the linear-kernel self-test tables (markdown) for the Qwen2.5-Coder layer shapes, with the machine's
CPU line and DRAM read bandwidth: the figures of docs/kernels.md.

    PYTHONPATH=src python scripts/bench/kernel_table.py --models qwen2.5-coder-1.5b,qwen2.5-coder-0.5b --modes none,int8,int4

No model files are needed: the self-test runs on synthetic weights of the models' shapes
(draftwise.backends.kernels.llama_linear_shapes). Results are cached under draftwise_home()/kernels/ like any
self-test (--refresh measures again).
"""

from __future__ import annotations

import argparse
import logging
import os
import time

import torch

from draftwise.backends.kernels import (
    TIMED_ROWS,
    KernelError,
    cpu_description,
    llama_linear_shapes,
    measure_dram_bandwidth,
    select_linear_kernel,
)

#: Layer geometry of the demo pair (config.json of Qwen/Qwen2.5-Coder-*-Instruct).
PRESETS = {
    "qwen2.5-coder-1.5b": dict(hidden=1536, heads=12, kv_heads=2, head_dim=128, intermediate=8960, vocab=151936,
                               layers=28),
    "qwen2.5-coder-0.5b": dict(hidden=896, heads=14, kv_heads=2, head_dim=64, intermediate=4864, vocab=151936,
                               layers=24),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(PRESETS), help=f"comma-separated of {', '.join(PRESETS)}")
    parser.add_argument("--modes", default="none,int8,int4")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--refresh", action="store_true", help="measure even when a cached result exists")
    parser.add_argument("--fastest-only", action="store_true",
                        help="check invariance only until the fastest invariant kernel is found (as at model load); "
                        "default: check every kernel, for the full table")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    print(f"CPU: {cpu_description()}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"load average at start {load}\n")
    started = time.perf_counter()
    bandwidth = measure_dram_bandwidth()
    print(f"DRAM read bandwidth: {bandwidth / 1e9:.1f} GB/s (torch.sum over 512 MiB fp32, best of 5, "
          f"{time.perf_counter() - started:.1f} s)\n")
    for model in args.models.split(","):
        shapes = llama_linear_shapes(**PRESETS[model])
        print(f"## {model}: " + ", ".join(f"{s.name} {s.out_features}x{s.in_features} x{s.count}" for s in shapes) + "\n")
        for mode in args.modes.split(","):
            try:
                choice = select_linear_kernel(mode, shapes, refresh=args.refresh, check_all=not args.fastest_only)
            except KernelError as exc:
                print(f"mode {mode}: {exc}\n")
                continue
            print_table(model, mode, choice, shapes, bandwidth)
    print(f"load average at the end: {', '.join(f'{v:.1f}' for v in os.getloadavg())}")
    return 0


def print_table(model, mode, choice, shapes, bandwidth) -> None:
    source = "cached" if choice.cached else f"self-test {choice.selftest_seconds:.1f} s"
    load = "?" if choice.load_average is None else ", ".join(f"{v:.1f}" for v in choice.load_average)
    print(f"### {model}, mode {mode} ({source}, {choice.threads} threads, load average {load})\n")
    print("Linear layers of one forward pass, ms, by rows m (shapes x layer counts):\n")
    header = ["kernel", "row-invariant", *(f"m={m}" for m in TIMED_ROWS), "weighted", "GB read", "GB/s at m=1", "chosen"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in choice.table_rows():
        invariant = {True: "yes", False: "**no**", None: "-"}[row["invariant"]] if row["available"] else "n/a"
        ms = ["-" if row["ms"][m] is None else f"{row['ms'][m]:.1f}" for m in TIMED_ROWS]
        nbytes = row["weight_bytes"]
        rate = "-" if row["ms"][1] is None else f"{nbytes / (row['ms'][1] / 1e3) / 1e9:.1f}"
        cost = "-" if row["cost_ms"] is None else f"{row['cost_ms']:.1f}"
        gb = f"{nbytes / 1e9:.2f}"
        print(f"| {row['kernel']} | {invariant} | " + " | ".join(ms) + f" | {cost} | {gb} | {rate} | "
              f"{'**yes**' if row['chosen'] else ''} |")
    print("\nPer layer shape, ms at m = 1 / 8 / 16 (one call):\n")
    print("| kernel | " + " | ".join(f"{s.name} {s.key}" for s in shapes) + " |")
    print("|" + "---|" * (len(shapes) + 1))
    for trial in choice.trials:
        cells = [" / ".join(f"{trial.seconds[s.key][m] * 1e3:.2f}" if m in trial.seconds.get(s.key, {}) else "-"
                            for m in (1, 8, 16)) for s in shapes]
        print(f"| {trial.name} | " + " | ".join(cells) + " |")
    print(f"\nChosen: {choice.reason}\n")
    for row in choice.table_rows():
        print(f"- {row['kernel']}: {row['detail']}")
    print(f"\nWeight-streaming bound at {bandwidth / 1e9:.1f} GB/s for the chosen kernel: "
          f"{choice.trial.weight_bytes / bandwidth * 1e3:.1f} ms per token\n")


if __name__ == "__main__":
    raise SystemExit(main())
