#!/usr/bin/env python
"""A running server's chat turn on an idle machine and beside busy processes (an agent's tests and builds run on
the machine that serves it): the seconds per turn in each case and the slowdown, busy over idle.

Runs, one after the other: idle, with ``--busy`` busy-loop processes, idle again (the idle figure is the mean of the
two, so drift shows). Each case sends ``--turns`` chat requests of ``--max-tokens`` tokens (temperature 0,
``ignore_eos``) and takes the median turn. The busy processes are plain Python ``while True: pass`` loops, one core
each.

Example (the README's server)::

    draftwise serve qwen2.5-coder-1.5b --speculative-model qwen2.5-coder-0.5b --num-speculative-tokens 5 &
    python scripts/bench/shared_machine.py --url http://127.0.0.1:8000 --busy 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager

PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring and a test."


@contextmanager
def busy_processes(count: int):
    """``count`` busy-loop processes for the duration of the block."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        time.sleep(1.0)  # let the scheduler see them
        yield procs
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


def chat_turn(url: str, model: str, max_tokens: int, timeout: float) -> tuple[float, int]:
    """One chat request; returns (seconds, completion tokens)."""
    import httpx

    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "temperature": 0,
            "max_tokens": max_tokens, "ignore_eos": True}
    started = time.perf_counter()
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=timeout)
    reply.raise_for_status()
    return time.perf_counter() - started, int(reply.json()["usage"]["completion_tokens"])


def measure(label: str, url: str, model: str, turns: int, max_tokens: int, timeout: float) -> float:
    """The median seconds of ``turns`` chat turns, printed as they finish."""
    seconds = []
    for turn in range(turns):
        elapsed, tokens = chat_turn(url, model, max_tokens, timeout)
        seconds.append(elapsed)
        print(f"  {label} turn {turn + 1}/{turns}: {elapsed:.2f} s, {tokens} tokens", flush=True)
    return statistics.median(seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="served model name (default: the server's first)")
    parser.add_argument("--busy", type=int, default=1, help="busy-loop processes beside the server")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one turn may take")
    parser.add_argument("--goal", type=float, default=3.0, help="the slowdown the check allows (exit 1 above it)")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    import httpx

    from draftwise.machine import cpu_description

    model = args.model or httpx.get(f"{args.url}/v1/models", timeout=30).json()["data"][0]["id"]
    print(f"CPU: {cpu_description()}; {os.cpu_count()} CPUs; server {args.url}, model {model}", flush=True)
    chat_turn(args.url, model, 8, args.timeout)  # warm-up
    idle_before = measure("idle", args.url, model, args.turns, args.max_tokens, args.timeout)
    with busy_processes(args.busy):
        busy = measure(f"{args.busy} busy", args.url, model, args.turns, args.max_tokens, args.timeout)
    idle_after = measure("idle again", args.url, model, args.turns, args.max_tokens, args.timeout)
    idle = (idle_before + idle_after) / 2
    slowdown = busy / idle
    print(f"idle {idle_before:.2f} / {idle_after:.2f} s per turn; with {args.busy} busy process(es) {busy:.2f} s: "
          f"slowdown {slowdown:.2f}x (goal <= {args.goal:.1f}x)")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"cpu": cpu_description(), "idle_s": [idle_before, idle_after], "busy_s": busy,
                       "busy_processes": args.busy, "slowdown": slowdown, "max_tokens": args.max_tokens}, out)
    return 0 if slowdown <= args.goal else 1


if __name__ == "__main__":
    sys.exit(main())
