#!/usr/bin/env python3
"""Fill-in-the-middle benchmark (issue 52, part 4): HumanEval-style Python functions with the body cut out,
the signature and docstring given as the prefix and the code after the body (the next function, its test) as the
suffix, run through the engine in the model's FIM order (:mod:`draftwise.server.fim`, the prompt
``/v1/completions`` builds for ``suffix``), greedy: plain decoding against n-gram, suffix decoding and the draft
model. The suffix is in the prompt, so the n-gram and suffix proposers can draft from the code after the cursor.

Prints, per method, tokens per second (generated tokens over the requests' wall time), the draft acceptance
(accepted / drafted), the mean accepted length (tau), the speed-up over plain, and whether every output equals
plain decoding's token for token (greedy speculation is exact, so anything else is a bug); then the CPU.

Usage (an idle machine; the Qwen pair comes from ``draftwise pull qwen2.5-coder-1.5b qwen2.5-coder-0.5b``):
    scripts/bench/fim.py [--target qwen2.5-coder-1.5b] [--draft qwen2.5-coder-0.5b] \\
        [--methods plain,ngram,suffix,draft] [--k 4] [--max-tokens 128] [--limit 12] [--json OUT]
    scripts/bench/fim.py --prompts-only   # load the tokenizer only and print each prompt's token counts

The functions live in ``data/fim/functions.jsonl`` (``name``, ``prefix``, ``suffix``, and the ``middle`` that was
cut out, for reference).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "data" / "fim" / "functions.jsonl"
METHODS = ("plain", "ngram", "suffix", "draft")

log = logging.getLogger("fim_bench")


@dataclass(frozen=True)
class FimTask:
    """One function: the text before the cut (``prefix``), after it (``suffix``), and the cut body (``middle``)."""

    name: str
    prefix: str
    suffix: str
    middle: str


@dataclass
class MethodResult:
    """One method's run over every task: outputs (token ids per task) and the summed counts."""

    method: str
    outputs: list[list[int]] = field(default_factory=list)
    seconds: float = 0.0
    drafted: int = 0
    accepted: int = 0
    passes: int = 0

    @property
    def tokens(self) -> int:
        return sum(len(output) for output in self.outputs)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def tau(self) -> float:
        return 1.0 + self.accepted / self.passes if self.passes else 1.0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring).

    Raises:
        SystemExit: an unknown method, or a K or token count below 1 (argparse's error).
    """
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b", help="the draft model of the draft method")
    parser.add_argument("--methods", default=",".join(METHODS), type=_methods,
                        help=f"comma-separated, among {', '.join(METHODS)} (plain always runs first)")
    parser.add_argument("--k", type=_positive, default=4, help="K of the speculative methods (default 4)")
    parser.add_argument("--max-tokens", type=_positive, default=128)
    parser.add_argument("--limit", type=_positive, default=None, help="the first N functions only")
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--quantization", default="int8")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None, help="write the results here too")
    parser.add_argument("--prompts-only", action="store_true",
                        help="load the tokenizer only and print each FIM prompt's token counts")
    return parser.parse_args(argv)


def _methods(value: str) -> tuple[str, ...]:
    methods = tuple(m.strip() for m in value.split(",") if m.strip())
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise argparse.ArgumentTypeError(f"unknown method(s) {unknown}: choose among {', '.join(METHODS)}")
    return ("plain",) + tuple(m for m in methods if m != "plain")


def _positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {number}")
    return number


def load_tasks(path: Path, limit: int | None = None) -> list[FimTask]:
    """The functions of a JSONL file (one ``{"name", "prefix", "suffix", "middle"}`` object a line)."""
    tasks = [FimTask(**json.loads(line)) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return tasks[:limit] if limit else tasks


def build_prompts(codec, tasks: Sequence[FimTask]) -> list[list[int]]:
    """Each task's FIM prompt ids, as ``/v1/completions`` builds them for ``suffix``
    (:meth:`draftwise.server.text.TextCodec.encode_fim`).

    Raises:
        ValueError: the model's vocabulary has no FIM tokens.
    """
    prompts = [codec.encode_fim(task.prefix, task.suffix) for task in tasks]
    if any(prompt is None for prompt in prompts):
        raise ValueError("the target's vocabulary has no fill-in-the-middle tokens (e.g. Qwen2.5-Coder's "
                         "<|fim_prefix|>): choose a FIM-trained code model")
    return prompts


def speculative_config(method: str, args: argparse.Namespace):
    """The :class:`~draftwise.config.SpeculativeConfig` of a method (None: plain decoding)."""
    from draftwise.config import SpeculativeConfig

    if method == "plain":
        return None
    if method == "draft":
        return SpeculativeConfig(model=args.draft, num_speculative_tokens=args.k)
    return SpeculativeConfig(method=method, num_speculative_tokens=args.k)


def run_method(method: str, args: argparse.Namespace, tasks: Sequence[FimTask]) -> MethodResult:
    """Build the method's engine (:func:`draftwise.builder.build_engine`, no prefix reuse between the functions)
    and run every task's FIM prompt greedily, one request at a time."""
    from draftwise.builder import build_engine
    from draftwise.config import SamplingParams
    from draftwise.server.text import TextCodec

    bundle = build_engine(args.target, speculative_config(method, args), quantization=args.quantization,
                          threads=args.threads, kv_cache_memory=0)
    codec = TextCodec(bundle.target)
    prompts = build_prompts(codec, tasks)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, stop_token_ids=codec.fim_format().stop_ids)
    result = MethodResult(method)
    for task, prompt in zip(tasks, prompts):
        t0 = time.perf_counter()
        generated = bundle.engine.generate(prompt, params)
        result.seconds += time.perf_counter() - t0
        stats = generated.stats
        result.outputs.append(list(generated.token_ids))
        result.drafted += stats.num_draft_tokens
        result.accepted += stats.num_accepted_tokens
        result.passes += stats.num_target_passes
        log.info("%s %s: %d tokens, %d/%d accepted", method, task.name, len(generated.token_ids),
                 stats.num_accepted_tokens, stats.num_draft_tokens)
    return result


def table(results: Sequence[MethodResult]) -> str:
    """The results as a Markdown table (speed-up and identity against the first result, plain)."""
    plain = results[0]
    lines = ["| method | tokens | tok/s | speed-up | acceptance | tau | identical to plain |",
             "|---|---|---|---|---|---|---|"]
    for result in results:
        acceptance = "-" if result.acceptance is None else f"{result.acceptance:.2f}"
        same = sum(a == b for a, b in zip(result.outputs, plain.outputs))
        speedup = result.tokens_per_s / plain.tokens_per_s if plain.tokens_per_s else 0.0
        lines.append(f"| {result.method} | {result.tokens} | {result.tokens_per_s:.1f} | {speedup:.2f}x | "
                     f"{acceptance} | {result.tau:.2f} | {same}/{len(plain.outputs)} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    tasks = load_tasks(args.data, args.limit)
    if args.prompts_only:
        from draftwise.models.loading import load_model
        from draftwise.server.text import TextCodec

        codec = TextCodec(load_model(args.target, quantization=args.quantization))
        for task, prompt in zip(tasks, build_prompts(codec, tasks)):
            print(f"{task.name}: {len(prompt)} prompt tokens")
        return 0
    from draftwise.machine import cpu_model_name

    results = [run_method(method, args, tasks) for method in args.methods]
    print(table(results))
    print(f"\nCPU: {cpu_model_name()}; target {args.target}, draft {args.draft}, K={args.k}, "
          f"{len(tasks)} functions, max {args.max_tokens} tokens, greedy")
    if args.json is not None:
        args.json.write_text(json.dumps({
            "cpu": cpu_model_name(), "target": args.target, "draft": args.draft, "k": args.k,
            "max_tokens": args.max_tokens, "functions": [task.name for task in tasks],
            "results": [{"method": r.method, "tokens": r.tokens, "seconds": r.seconds, "drafted": r.drafted,
                         "accepted": r.accepted, "passes": r.passes, "outputs": r.outputs} for r in results],
        }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
