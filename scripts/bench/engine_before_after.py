#!/usr/bin/env python
"""Before/after speed of two revisions of the engine, run alternately on this idle machine.

Each revision is checked out in its own git worktree and run with this checkout's ``.venv`` (its ``src`` first
on ``PYTHONPATH``), so only the engine code differs. Two workloads, on the first ``--prompts`` Spec-Bench coding
prompts, greedy, ``--max-tokens`` tokens, the Qwen2.5-Coder 1.5B target and 0.5B draft with ``--quantization``:

1. one request at a time: ``draftwise bench --methods plain,draft,ngram --ks K`` (the library's one-request
   engine), in rounds that alternate which revision runs first (A B, B A, ...);
2. ``--clients`` concurrent clients against ``draftwise serve --max-num-seqs CLIENTS`` for plain, the draft
   model and n-gram lookup (``scripts/bench/load_test.py --serve``, in process), revisions alternating per method.

It prints a Markdown table of tokens per second per revision and the after/before ratio, with the CPU, and
writes it to ``--output``. Goals (issue "One engine"): one request within 3% of before, the clients no slower.

Example::

    python scripts/bench/engine_before_after.py --before 730b28b --after HEAD --output bench_results/engine_core.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PYTHON = ROOT / ".venv" / "bin" / "python"
QUESTIONS = ROOT.parent / "shared" / "data" / "spec_bench" / "question.jsonl"
TARGET, DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def worktree(rev: str, into: Path) -> Path:
    """A detached worktree of ``rev`` under ``into``."""
    path = into / rev.replace("/", "_")
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(path), rev], check=True)
    return path


def run(tree: Path, args: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    subprocess.run([str(PYTHON), *args], cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)


def one_request(tree: Path, out: Path, opts: argparse.Namespace) -> dict[str, float]:
    """tok/s per method of one ``draftwise bench`` run."""
    run(tree, ["-m", "draftwise.cli", "bench", "--model", TARGET, "--draft", DRAFT, "--prompts", str(QUESTIONS), "--category", "coding",
               "--limit", str(opts.prompts), "--max-tokens", str(opts.max_tokens), "--methods", "plain,draft,ngram",
               "--ks", str(opts.k), "--quantization", opts.quantization, "--no-plots", "--output", str(out)])
    summary = json.loads(out.read_text())["summary"]
    return {row["method"]: row["tokens_per_s"] for row in summary}


def clients(tree: Path, method: str, prompts: Path, out: Path, opts: argparse.Namespace) -> float:
    """Aggregate tok/s of ``opts.clients`` concurrent clients against an in-process server."""
    config = {"plain": None, "draft": {"method": "draft_model", "model": DRAFT},
              "ngram": {"method": "ngram"}}[method]
    args = [str(ROOT / "scripts" / "bench" / "load_test.py"), "--serve", TARGET, "--quantization", opts.quantization,
            "--max-num-seqs", str(opts.clients), "--concurrency", str(opts.clients), "--requests-per-client",
            str(opts.requests_per_client), "--max-tokens", str(opts.max_tokens), "--prompts-file", str(prompts),
            "--json", str(out)]
    if config is not None:
        args += ["--speculative-config", json.dumps({**config, "num_speculative_tokens": opts.k})]
    run(tree, args)
    return json.loads(out.read_text())["summaries"][0]["aggregate_tokens_per_s"]


def coding_prompts(n: int, path: Path) -> Path:
    lines = []
    for line in QUESTIONS.read_text().splitlines():
        question = json.loads(line)
        if question.get("category") == "coding" and len(lines) < n:
            lines.append(question["turns"][0].replace("\n", " "))
    path.write_text("\n".join(lines) + "\n")
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="git revision before")
    parser.add_argument("--after", default="HEAD", help="git revision after (default HEAD)")
    parser.add_argument("--rounds", type=int, default=2, help="one-request rounds per revision (default 2)")
    parser.add_argument("--prompts", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--quantization", default="int8")
    parser.add_argument("--client-rounds", type=int, default=1,
                        help="server runs per method and revision, alternating (default 1; 0: none)")
    parser.add_argument("--output", default=None, help="Markdown file for the table")
    opts = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="draftwise-ba-") as tmp:
        tmp = Path(tmp)
        trees = {"before": worktree(opts.before, tmp), "after": worktree(opts.after, tmp)}
        try:
            prompts = coding_prompts(opts.prompts, tmp / "prompts.txt")
            single: dict[str, dict[str, list[float]]] = {"before": {}, "after": {}}
            for r in range(opts.rounds):
                for name in (("before", "after") if r % 2 == 0 else ("after", "before")):
                    rates = one_request(trees[name], tmp / f"bench-{name}-{r}.json", opts)
                    for method, rate in rates.items():
                        single[name].setdefault(method, []).append(rate)
                    print(f"round {r + 1} {name}: " + ", ".join(f"{m} {v:.2f}" for m, v in rates.items()),
                          file=sys.stderr)
            multi: dict[str, dict[str, list[float]]] = {"before": {}, "after": {}}
            for r in range(opts.client_rounds):
                for i, method in enumerate(("plain", "draft", "ngram")):
                    for name in (("before", "after") if (i + r) % 2 == 0 else ("after", "before")):
                        rate = clients(trees[name], method, prompts, tmp / f"load-{name}-{method}-{r}.json", opts)
                        multi[name].setdefault(method, []).append(rate)
                        print(f"{opts.clients} clients {method} {name}: {rate:.2f}", file=sys.stderr)
        finally:
            for tree in trees.values():
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)

    rows = [f"CPU: {cpu_name()}, {os.cpu_count()} cores. {opts.prompts} Spec-Bench coding prompts x {opts.max_tokens} "
            f"tokens, greedy, {TARGET} / {DRAFT}, --quantization {opts.quantization}, K={opts.k}; before "
            f"`{opts.before}`, after `{opts.after}`.", "",
            "| workload | method | before tok/s | after tok/s | after / before |", "|---|---|---|---|---|"]
    for method in single["before"]:
        b, a = statistics.median(single["before"][method]), statistics.median(single["after"][method])
        rows.append(f"| 1 request (median of {opts.rounds}) | {method} | {b:.2f} | {a:.2f} | {a / b:.3f} |")
    for method in multi["before"]:
        b, a = statistics.median(multi["before"][method]), statistics.median(multi["after"][method])
        rows.append(f"| {opts.clients} clients, serve (median of {opts.client_rounds}) | {method} | {b:.2f} | "
                    f"{a:.2f} | {a / b:.3f} |")
    table = "\n".join(rows)
    print(table)
    if opts.output:
        Path(opts.output).write_text("# Engine core: before / after\n\n" + table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
