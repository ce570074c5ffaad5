#!/usr/bin/env python3
"""Several draft files for one target, side by side in one process (issue 23, item 1): which GGUF type of the
draft pays on this machine, end to end.

Loads the target once (lean runtime) and each draft GGUF on llama.cpp's native kernels, as drafts run
(``load_model(..., drafting=True)``), then runs plain decoding, each draft at a fixed K, and plain decoding again
(A B ... A: a machine that changes speed shows as a spread between the two plain passes) on the same Spec-Bench
prompts through :func:`draftwise.benchmark.run_benchmark`. Prints one JSON line per method and category: tokens/s,
speed-up over the plain passes, acceptance, tau, identical outputs. ``--requantize Q4_0`` adds a copy of the
first draft in that type (llama.cpp's quantizer), as ``--speculative-backend auto`` makes one; ``--head-type Q4_0``
adds a second copy whose LM head is Q4_0 too.

Usage (idle machine; the CPU is printed):
    scripts/compare_drafts.py --target qwen2.5-coder-1.5b --draft q4km=qwen2.5-coder-0.5b --requantize Q4_0 \
        [--head-type Q4_0] --category coding --limit 5 --k 4 --max-tokens 96
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from draftwise.backends.llama_cpp_backend import REQUANTIZE_TYPES, copy_recipe, requantize_gguf
from draftwise.benchmark import MethodSpec, default_prompts_path, load_prompts, run_benchmark, summarize
from draftwise.builder import assemble_engine
from draftwise.config import SamplingParams
from draftwise.machine import cpu_model_name
from draftwise.speculation.measurement import with_baseline_repeat
from draftwise.models.loading import load_model, resolve_model
from draftwise.proposers.draft_model import DraftModelProposer

FIELDS = ("category", "method", "tokens_per_s", "speedup_total", "acceptance_rate", "mean_accepted_length", "identical")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--quantization", default="int8")
    parser.add_argument("--draft", action="append", required=True, metavar="LABEL=GGUF",
                        help="a draft file (registry name or .gguf path) and its label; repeatable")
    parser.add_argument("--requantize", choices=REQUANTIZE_TYPES, default=None,
                        help="also run a copy of the first draft in this GGUF type")
    parser.add_argument("--head-type", choices=REQUANTIZE_TYPES, default=None,
                        help="with --requantize: also run a second copy whose LM head is this type")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--category", default="coding")
    parser.add_argument("--limit", type=int, default=5)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()

    drafts = [tuple(item.split("=", 1)) for item in args.draft]
    if any(len(d) != 2 for d in drafts):
        parser.error("--draft takes LABEL=GGUF")
    workdir = tempfile.TemporaryDirectory(prefix="compare-drafts-")
    if args.requantize:
        label, spec = drafts[0]
        source = resolve_model(spec)
        for head_type in (None, args.head_type) if args.head_type else (None,):
            recipe = copy_recipe(args.requantize, head_type)
            copy = Path(workdir.name) / f"{label}-{recipe}.gguf"
            drafts.append((recipe.lower(), str(requantize_gguf(source, copy, args.requantize, head_type=head_type))))

    target = load_model(args.target, quantization=args.quantization, runtime="lean")
    vocab = target.backend.vocab_size
    specs = [MethodSpec("plain", "plain", engine=assemble_engine(target))]
    for label, spec in drafts:
        draft = load_model(spec, backend="llama.cpp", threads=args.threads, max_context=target.backend.max_context,
                           drafting=True)
        proposer = DraftModelProposer(draft.backend, vocab)
        specs.append(MethodSpec(f"{label} K={args.k}", "draft", args.k,
                                engine=assemble_engine(target, proposer, args.k)))
    prompts = load_prompts(default_prompts_path(), args.category.split(","), args.limit)
    runs = run_benchmark(target, with_baseline_repeat(specs), prompts, SamplingParams(max_tokens=args.max_tokens),
                         chat=True)
    print(json.dumps({"cpu": cpu_model_name(), "target": args.target, "drafts": dict(drafts), "k": args.k,
                      "prompts": len(prompts), "max_tokens": args.max_tokens}))
    for row in summarize(runs, by_category=True):
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items() if k in FIELDS}))
    workdir.cleanup()


if __name__ == "__main__":
    main()
