#!/usr/bin/env python3
"""Replay draft chains under stopping rules: where should a draft chain stop? (docs/draft_trees.md, "Stopping a
chain where the draft is unsure").

Step 1 (``trace``): greedy requests drafted K=MAX deep with no stop (``draft_confidence_threshold`` 0), recording per
draft the tokens, the draft's probability of each (``Sampler.logprob``) and, from the final output (plain
decoding's, token for token), how many the target accepted. Step 2 (``replay``): for each stopping rule, the
tokens each recorded draft would have proposed and committed and the time it would have cost with the calibrated
costs (a draft pass per proposed token, the target's pass over proposed + 1 rows), summed per category: decode
speed-ups over plain decoding, prefill and the draft's catch-up left out. It replays the recorded drafts' starting
points, so a rule that commits fewer tokens in a step is credited as if the next draft started where the recorded
one did: a comparison of rules, not a prediction of ``bench``.

Rules: ``fixed`` (K tokens), ``path`` (stop after the token whose path probability falls below the threshold: a
number for ``draft_confidence_threshold``), ``cost`` (the same with one threshold per depth, ``value`` x (c + the
next verify row's relative cost): ``draft_confidence_threshold`` "auto", draftwise's default, whose value 1.5 this
replay chose; ``--stop-values``), ``pathdrop`` (the path rule without proposing the crossing token), ``token`` /
``tokendrop`` (the token's own probability, as Hugging Face's ``assistant_confidence_threshold``).

Usage (idle machine; the CPU is printed):
    scripts/confidence_replay.py trace --limit 2 --max-k 8 --out trace.json
    scripts/confidence_replay.py replay trace.json --target-ms 61.6 --draft-ms 10.3 \\
        --verify 1.00,1.03,1.05,1.10,1.10,1.12,1.18,1.21,1.31   (v_1..v_9 from `draftwise costs --ks 1,...,9`)
        [--stop-values 1,1.5,2]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

RULES = ("fixed", "path", "cost", "pathdrop", "token", "tokendrop")


def trace(args: argparse.Namespace) -> None:
    """Run the requests and write the recorded drafts (JSON list per prompt)."""
    from draftwise.benchmark import default_prompts_path, encode_turn, load_prompts
    from draftwise.builder import build_engine
    from draftwise.config import SamplingParams, SpeculativeConfig
    from draftwise.machine import cpu_model_name
    from draftwise.proposers import draft_model

    records: list[dict] = []
    add_children, proposal = draft_model.DraftSlots._add_children, draft_model.DraftSlots._proposal

    def recording_add_children(self, growth, rows, depth):  # the draft's probability of each chain token
        add_children(self, growth, rows, depth)
        if not growth.is_tree:
            token = growth.nodes[-1].token
            growth.__dict__.setdefault("logprobs", []).append(growth.request.sampler.logprob(rows[-1], token))

    def recording_proposal(self, growth, draft_s):
        records.append({"base": growth.base, "offset": growth.request.offset,
                        "tokens": [n.token for n in growth.nodes], "logprobs": growth.__dict__.get("logprobs", [])})
        return proposal(self, growth, draft_s)

    draft_model.DraftSlots._add_children = recording_add_children
    draft_model.DraftSlots._proposal = recording_proposal
    config = SpeculativeConfig(method="draft_model", model=args.draft, num_speculative_tokens=args.max_k,
                               backend=args.speculative_backend, draft_confidence_threshold=0.0)
    bundle = build_engine(args.target, config, quantization=args.quantization, threads=args.threads)
    prompts = load_prompts(args.prompts or default_prompts_path(), None, args.limit)
    out = []
    for prompt in prompts:
        ids = encode_turn(bundle.target, prompt, 0, [], True)
        if len(ids) + args.max_tokens > bundle.target.backend.max_context:
            print(f"{prompt.category} {prompt.id}: skipped ({len(ids)} prompt tokens do not fit the context)")
            continue
        records.clear()
        start = time.perf_counter()
        result = bundle.engine.generate(ids, SamplingParams(max_tokens=args.max_tokens))
        full = list(ids) + list(result.token_ids)
        drafts = []
        for record in records:
            truth = full[record["base"] + record["offset"]:]
            accepted = next((i for i, (a, b) in enumerate(zip(record["tokens"], truth)) if a != b),
                            min(len(record["tokens"]), len(truth)))
            drafts.append({"accepted": accepted, "logprobs": record["logprobs"]})
        out.append({"id": prompt.id, "category": prompt.category, "prompt_tokens": len(ids),
                    "generated": len(result.token_ids), "seconds": time.perf_counter() - start, "drafts": drafts})
        print(f"{prompt.category} {prompt.id}: {len(ids)} prompt tokens, {len(result.token_ids)} generated, "
              f"{len(drafts)} drafts", flush=True)
    with open(args.out, "w") as handle:
        json.dump({"cpu": cpu_model_name(), "target": args.target, "draft": args.draft, "max_k": args.max_k,
                   "prompts": out}, handle)
    print(f"wrote {args.out} (CPU: {cpu_model_name()})")


def proposed_length(logprobs: list[float], k: int, rule: str, threshold: float | tuple[float, ...]) -> tuple[int, int]:
    """``(tokens proposed, draft passes paid)`` of a recorded chain under ``rule`` with at most ``k`` tokens (a
    ``*drop`` rule has paid the pass of the token it drops); ``threshold``: one number, or one per depth (``cost``,
    ``threshold[j - 1]`` after j tokens)."""
    import math

    depth = min(len(logprobs), k)
    path = 0.0
    for i in range(depth):
        path += logprobs[i]
        value = path if rule.startswith("path") or rule == "cost" else logprobs[i]
        bound = threshold[min(i, len(threshold) - 1)] if isinstance(threshold, tuple) else threshold
        if rule != "fixed" and math.exp(value) < bound:
            return (i, i + 1) if rule.endswith("drop") else (i + 1, i + 1)
    return depth, depth


def replay(args: argparse.Namespace) -> None:
    """Print decode speed-ups over plain decoding per rule, threshold and category."""
    from draftwise.speculation.cost_model import CostModel, draft_stop_thresholds

    data = json.load(open(args.trace))
    verify = [float(v) for v in args.verify.split(",")]
    costs = CostModel(tuple(v * args.target_ms for v in verify), args.draft_ms)
    table = []
    for rule in RULES:
        if rule == "fixed":
            settings = [(k, 0.0, "") for k in range(1, data["max_k"] + 1)]
        elif rule == "cost":
            settings = [(data["max_k"], draft_stop_thresholds(costs, data["max_k"], float(v)), f" x{float(v):g}")
                        for v in args.stop_values.split(",")]
        else:
            settings = [(data["max_k"], float(t), f" {float(t):g}") for t in args.thresholds.split(",")]
        for k, threshold, suffix in settings:
            per = defaultdict(lambda: [0, 0.0])
            for prompt in data["prompts"]:
                for draft in prompt["drafts"]:
                    proposed, passes = proposed_length(draft["logprobs"], k, rule, threshold)
                    cost = passes * args.draft_ms + verify[min(proposed, len(verify) - 1)] * args.target_ms
                    per[prompt["category"]][0] += min(draft["accepted"], proposed) + 1
                    per[prompt["category"]][1] += cost
            speedups = {c: tokens / cost * args.target_ms for c, (tokens, cost) in per.items()}
            overall = sum(t for t, _ in per.values()) / sum(c for _, c in per.values()) * args.target_ms
            table.append((f"{rule} K={k}{suffix}", overall, speedups))
    categories = sorted(table[0][2])
    print(f"{data['cpu']}: decode speed-up over plain by rule (replayed; see the module docstring)")
    print(f"{'rule':20s} {'all':>5s} {'min':>5s} " + " ".join(f"{c[:7]:>7s}" for c in categories))
    for name, overall, speedups in table:
        print(f"{name:20s} {overall:5.2f} {min(speedups.values()):5.2f} "
              + " ".join(f"{speedups[c]:7.2f}" for c in categories))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("trace")
    run.add_argument("--target", default="qwen2.5-coder-1.5b")
    run.add_argument("--draft", default="qwen2.5-coder-0.5b")
    run.add_argument("--quantization", default="int8")
    run.add_argument("--speculative-backend", default="auto")
    run.add_argument("--threads", type=int, default=2)
    run.add_argument("--max-k", type=int, default=8)
    run.add_argument("--max-tokens", type=int, default=128)
    run.add_argument("--prompts", default=None, help="JSONL prompts (default: Spec-Bench)")
    run.add_argument("--limit", type=int, default=2, help="prompts per category")
    run.add_argument("--out", default="confidence_trace.json")
    rep = sub.add_parser("replay")
    rep.add_argument("trace")
    rep.add_argument("--target-ms", type=float, required=True, help="the target's one-token pass, ms")
    rep.add_argument("--draft-ms", type=float, required=True, help="the draft's one-token pass, ms")
    rep.add_argument("--verify", required=True, help="v_1..v_(K+1): a pass over n rows / a one-row pass")
    rep.add_argument("--thresholds", default="0.1,0.2,0.3,0.4,0.5,0.6", help="comma-separated thresholds to try")
    rep.add_argument("--stop-values", default="1,1.5,2",
                     help="comma-separated values of the cost rule (draftwise.speculation.cost_model.DRAFT_STOP_VALUE)")
    args = parser.parse_args()
    (trace if args.command == "trace" else replay)(args)


if __name__ == "__main__":
    main()
