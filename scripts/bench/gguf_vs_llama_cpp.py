#!/usr/bin/env python
"""Issue-24 benchmark: draftwise against llama.cpp on the same GGUF file, one process, idle machine.

For llama.cpp (llama-cpp-python as scripts/setup.sh builds it, its normal one-token decoding, flash attention)
and for draftwise's lean runtime in each ``--modes`` quantization (``q4k``: the GGUF's own Q4_K blocks on the
row-invariant kernel; ``int8``): one-token time at contexts 200 and 2,000, the verify curve v_k = t_k / t_1 for
k = 1..8 (context 200), prefill of 130- and 2,000-token prompts, then greedy generations of ``--prompts`` Spec-Bench
coding prompts (``--max-tokens`` tokens): llama.cpp plain, and per draftwise mode plain, n-gram (K = 4), the
draft model (K = 4, ``--speculative-backend auto``) and the draft model with the auto K policy (K <= 8). Every
draftwise output is compared with draftwise's plain output of the same mode (exactness); llama.cpp's plain
output is reported next to it (another numeric path, so it may differ).

Each runtime lives in a worker process of its own (one runtime's thread pool never competes with another's),
and the parent alternates between them (A B C A B C), one at a time; a pass's time is the fastest of 3, and
the tables give medians over rounds. Speeds are
generated tokens per second of wall time, prefill included. The CPU is printed with the figures.

Usage: scripts/bench/gguf_vs_llama_cpp.py [--target qwen2.5-coder-1.5b] [--draft qwen2.5-coder-0.5b]
       [--modes q4k,int8] [--prompts 5] [--max-tokens 64] [--repeats 3] [--threads 2] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from draftwise.backends.kernels import cpu_description, measure_dram_bandwidth
from draftwise.backends.llama_cpp_backend import LlamaCppCausalLM, llama_cpp_available
from draftwise.benchmark import default_prompts_path, encode_turn, first_difference, load_prompts
from draftwise.builder import assemble_engine, build_proposer
from draftwise.config import SamplingParams, SpeculativeConfig
from draftwise.models.loading import load_model, resolve_model

CONTEXTS = (200, 2000)
KS = tuple(range(1, 9))
PREFILL = 2000
#: the short prompt's prefill (a coding prompt's length with its chat template)
SHORT_PREFILL = 130


def prompt_ids(n: int) -> list[int]:
    """n token ids spread over the first 20,000 of the vocabulary."""
    return [(1000 + i * 7919) % 20000 for i in range(n)]


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


#: passes timed per measurement, the fastest kept: one pass alone moved by 30% here (a first pass after a
#: prefill or a reset, and the machine's drift)
PASSES = 3


def pass_seconds(backend, context: int, k: int, passes: int = PASSES) -> float:
    """Seconds of a k-token pass on ``context`` cached tokens, the fastest of ``passes`` (the cache is cut back
    after each)."""
    best = float("inf")
    for _ in range(passes):
        best = min(best, timed(lambda: backend.forward([100 + i for i in range(k)], num_logits=k)))
        backend.rollback(context)
    return best


def cost_round(backend) -> dict:
    """One round of timings on ``backend``: prefill of PREFILL tokens, one token on top of it, and on a fresh
    200-token context one token and t_k for k in KS (seconds)."""
    backend.reset()
    short = timed(lambda: backend.forward(prompt_ids(SHORT_PREFILL), num_logits=1))
    backend.reset()
    prefill = timed(lambda: backend.forward(prompt_ids(PREFILL), num_logits=1))
    t1 = {CONTEXTS[1]: pass_seconds(backend, PREFILL, 1)}
    backend.reset()
    backend.forward(prompt_ids(CONTEXTS[0]), num_logits=1)
    t1[CONTEXTS[0]] = pass_seconds(backend, CONTEXTS[0], 1)
    tk = {k: pass_seconds(backend, CONTEXTS[0], k) for k in KS}
    return {"prefill": prefill, "short_prefill": short, "t1": t1, "tk": tk}


def summarize_costs(rounds: list[dict]) -> dict:
    """Medians over rounds: one-token ms per context, v_k, prefill tokens per second."""
    t1 = {c: statistics.median(r["t1"][c] for r in rounds) for c in CONTEXTS}
    tk = {k: statistics.median(r["tk"][k] for r in rounds) for k in KS}
    return {"one_token_ms": {c: 1e3 * v for c, v in t1.items()}, "v_k": {k: tk[k] / tk[1] for k in KS},
            "prefill_tokens_per_s": PREFILL / statistics.median(r["prefill"] for r in rounds),
            "short_prefill_tokens_per_s": SHORT_PREFILL / statistics.median(r["short_prefill"] for r in rounds)}


def llama_cpp_generate(backend: LlamaCppCausalLM, ids: list[int], max_tokens: int, eos: set[int]) -> list[int]:
    """llama.cpp's plain greedy decoding: prefill, then one token per pass."""
    backend.reset()
    logits = backend.forward(ids, num_logits=1).logits[-1]
    out: list[int] = []
    while len(out) < max_tokens:
        token = int(torch.argmax(logits))
        if token in eos:
            break
        out.append(token)
        logits = backend.forward([token], num_logits=1).logits[-1]
    return out


class Runtime:
    """One runtime in a worker process of its own, so that one runtime's thread pool (llama.cpp's or
    torch's OpenMP threads) never competes with the other's: measured in one process, llama.cpp's pool
    slowed the torch runtimes' one-token pass from about 140 to 175 ms. The parent sends one command at a
    time (``("costs",)`` or ``("generate", ids)``) and waits for its answer, so one runtime runs at a time."""

    def __init__(self, name: str, args) -> None:
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        self.name = name
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_worker, args=(name, vars(args), child), daemon=True)
        self.process.start()
        self.methods, self.eos_ids = self.conn.recv()  # loaded: method labels, EOS ids (draftwise only)

    def call(self, *command):
        self.conn.send(command)
        answer = self.conn.recv()
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def close(self) -> None:
        self.conn.send(("exit",))
        self.process.join(timeout=30)


def _worker(name: str, args: dict, conn) -> None:
    torch.set_num_threads(args["threads"])
    if name == "llama.cpp":
        backend = LlamaCppCausalLM(resolve_model(args["target"]), n_threads=args["threads"], batch_invariant=False,
                                   max_context=4096)
        target, engines = None, {}
        conn.send((["plain"], []))
    else:
        target = load_model(args["target"], quantization=name, runtime="lean", threads=args["threads"],
                            max_context=4096)
        backend, engines = target.backend, {}
        for label, config in draftwise_methods(args["draft"]).items():
            proposer = None
            if config is not None:
                proposer, _ = build_proposer(config, target, device="cpu", dtype=None, quantization=name,
                                             threads=args["threads"], runtime="lean")
            engines[label] = assemble_engine(target, proposer, 4 if config is None else config.num_speculative_tokens)
        conn.send((list(engines), list(target.eos_token_ids)))
    params = SamplingParams(max_tokens=args["max_tokens"], temperature=0.0)
    while True:
        command = conn.recv()
        try:
            if command[0] == "exit":
                return
            if command[0] == "costs":
                conn.send(cost_round(backend))
            elif command[0] == "generate":
                ids, label, eos = command[1], command[2], set(command[3])
                start = time.perf_counter()
                if name == "llama.cpp":
                    tokens, stats = llama_cpp_generate(backend, ids, args["max_tokens"], eos), None
                else:
                    result = engines[label].generate(ids, params)
                    tokens, stats = result.token_ids, result.stats
                seconds = time.perf_counter() - start
                conn.send((seconds, tokens, None if stats is None else
                           (stats.num_target_passes, stats.num_accepted_tokens, stats.num_draft_tokens)))
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it
            conn.send(exc)


def draftwise_methods(draft: str) -> dict:
    """The draftwise methods timed per mode: plain, n-gram K = 4, the draft model K = 4 and with auto K <= 8."""
    return {"plain": None,
            "ngram K=4": SpeculativeConfig(method="ngram", num_speculative_tokens=4),
            "draft K=4": SpeculativeConfig(method="draft_model", model=draft, num_speculative_tokens=4,
                                           backend="auto"),
            "draft auto K<=8": SpeculativeConfig(method="draft_model", model=draft, num_speculative_tokens=8,
                                                 backend="auto", k_policy="auto")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--modes", default="q4k,int8")
    parser.add_argument("--prompts", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-costs", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args()
    if not llama_cpp_available():
        print("llama-cpp-python is not installed (scripts/setup.sh builds it)", file=sys.stderr)
        return 2
    modes = [m for m in args.modes.split(",") if m]
    print(f"CPU: {cpu_description()}; threads {args.threads}", flush=True)
    print(f"DRAM read bandwidth: {measure_dram_bandwidth(threads=args.threads) / 1e9:.1f} GB/s", flush=True)
    runtimes = {}
    for name in ("llama.cpp", *modes):  # loaded one after the other (each load is CPU-heavy)
        runtimes[name] = Runtime(name, args)
        print(f"loaded {name}", flush=True)
    report: dict = {"cpu": cpu_description(), "threads": args.threads, "target": args.target, "draft": args.draft}
    try:
        if not args.skip_costs:
            rounds = {name: [] for name in runtimes}
            for _ in range(args.repeats):
                for name, runtime in runtimes.items():
                    rounds[name].append(runtime.call("costs"))
            report["costs"] = {("draftwise " + n if n != "llama.cpp" else n): summarize_costs(r)
                               for n, r in rounds.items()}
            print_costs(report["costs"])
        report["generation"] = generation(runtimes, modes, args)
        print_generation(report["generation"])
    finally:
        for runtime in runtimes.values():
            runtime.close()
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2, default=str)
    return 0


def generation(runtimes: dict, modes: list[str], args) -> dict:
    """Greedy generations of the coding prompts, runtimes alternating per prompt; per draftwise method the
    output is compared with the same mode's plain output."""
    tokenizer_owner = load_tokenizer_only(args.target)
    prompts = load_prompts(default_prompts_path(), categories=["coding"], limit=args.prompts)
    rows: dict[str, dict] = {}
    eos = runtimes[modes[0]].eos_ids
    for prompt in prompts:
        ids = encode_turn(tokenizer_owner, prompt, 0, [], chat=True)
        seconds, tokens, _ = runtimes["llama.cpp"].call("generate", ids, "plain", eos)
        add(rows, "llama.cpp plain", seconds, tokens, None)
        for mode in modes:
            plain = None
            for label in runtimes[mode].methods:
                seconds, tokens, stats = runtimes[mode].call("generate", ids, label, eos)
                plain = tokens if label == "plain" else plain
                add(rows, f"draftwise {mode} {label}", seconds, tokens, None if label == "plain" else plain, stats)
    return rows


def load_tokenizer_only(spec: str):
    """A stand-in with the target's tokenizer and chat template for :func:`encode_turn` (no weights)."""
    from draftwise.models.loading import LoadedModel, load_tokenizer

    tokenizer = load_tokenizer(spec)
    return LoadedModel(backend=None, tokenizer=tokenizer, name=spec, eos_token_ids=(), quantization="none")


def add(rows: dict, name: str, seconds: float, tokens: list[int], plain: list[int] | None, stats=None) -> None:
    row = rows.setdefault(name, {})
    row["seconds"] = row.get("seconds", 0.0) + seconds
    row["tokens"] = row.get("tokens", 0) + len(tokens)
    if plain is not None and first_difference(tokens, plain) is not None:
        row["mismatches"] = row.get("mismatches", 0) + 1
    row.setdefault("mismatches", 0)
    if stats is not None and stats[0]:
        row["steps"] = row.get("steps", 0) + stats[0]
        row["accepted"] = row.get("accepted", 0) + stats[1]
        row["drafted"] = row.get("drafted", 0) + stats[2]


def print_costs(costs: dict) -> None:
    print("\nruntime            | 1 token @200 | 1 token @2000 | prefill 130 | prefill 2000 | v_2  v_4  v_5  v_8")
    for name, row in costs.items():
        v = row["v_k"]
        print(f"{name:<18} | {row['one_token_ms'][200]:9.1f} ms | {row['one_token_ms'][2000]:10.1f} ms | "
              f"{row['short_prefill_tokens_per_s']:6.1f} tok/s | {row['prefill_tokens_per_s']:7.1f} tok/s | "
              f"{v[2]:.2f} {v[4]:.2f} {v[5]:.2f} {v[8]:.2f}", flush=True)


def print_generation(rows: dict) -> None:
    base = rows.get("llama.cpp plain", {})
    base_speed = base.get("tokens", 0) / max(base.get("seconds", 1e-9), 1e-9)
    print("\nmethod                              | tok/s  | vs llama.cpp plain | alpha | identical to plain")
    for name, row in rows.items():
        speed = row["tokens"] / max(row["seconds"], 1e-9)
        alpha = f"{row['accepted'] / row['drafted']:.2f}" if row.get("drafted") else "-"
        same = "-" if name.startswith("llama.cpp") or name.endswith(" plain") else \
            ("yes" if row["mismatches"] == 0 else f"NO ({row['mismatches']} prompts)")
        print(f"{name:<35} | {speed:6.2f} | {speed / base_speed:6.2f}x            | {alpha:>5} | {same}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
