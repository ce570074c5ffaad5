"""``draftwise generate``: one prompt through plain or speculative decoding, then the statistics."""

from __future__ import annotations

import argparse
import json
import sys

from draftwise.builder import build_engine
from draftwise.commands.common import (
    CliError,
    add_model_args,
    add_quantization_arg,
    add_backend_arg,
    add_sampling_args,
    check_device_args,
    default_target,
    sampling_params_from_args,
    speculative_config_from_args,
)
from draftwise.stats import hybrid_steps_line


def register(subparsers) -> None:
    parser = subparsers.add_parser("generate", help="generate text for one prompt")
    parser.add_argument("prompt", help="the prompt text ('-' reads stdin)")
    parser.add_argument("--model", default=None, help="target model (default: the demo target)")
    add_model_args(parser)
    add_quantization_arg(parser)
    add_backend_arg(parser)
    add_sampling_args(parser)
    parser.add_argument("--chat", choices=["auto", "on", "off"], default="auto",
                        help="apply the model's chat template (auto: when it has one)")
    parser.add_argument("--stream", action="store_true", help="print tokens as they are committed")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object to stdout: the generated text (\"text\"), the method and the "
                        "statistics (instead of the text, and the statistics on stderr); not with --stream")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    check_device_args(args)
    params = sampling_params_from_args(args)
    spec = speculative_config_from_args(args)
    if args.json and args.stream:
        raise CliError("--json prints one JSON object at the end; it does not combine with --stream")
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt.strip():
        raise CliError("the prompt is empty")
    bundle = build_engine(default_target(args.model), spec, device=args.device, dtype=args.dtype,
                          max_context=args.max_model_len, quantization=args.quantization,
                          backend=args.backend, threads=args.threads, runtime=args.runtime)
    target = bundle.target
    use_chat = args.chat == "on" or (args.chat == "auto" and target.has_chat_template)
    prompt_ids = target.encode_chat([{"role": "user", "content": prompt}]) if use_chat else target.encode(prompt)
    generation = bundle.engine.stream(prompt_ids, params)
    tokens: list[int] = []
    printed = ""
    for chunk in generation:
        tokens.extend(chunk)
        if args.stream:
            text = target.decode(tokens)
            print(text[len(printed):], end="", flush=True)
            printed = text
    result = generation.result
    assert result is not None
    stats = result.stats
    if args.json:
        print(json.dumps({"text": target.decode(result.token_ids), "method": bundle.method, **stats.to_dict()},
                         indent=2))
        return 0
    print(target.decode(result.token_ids) if not args.stream else "")
    print(format_stats(bundle.method, stats), file=sys.stderr)
    return 0


def format_stats(method: str, stats) -> str:
    """Human-readable statistics block."""
    lines = [
        f"--- {method}: {stats.num_generated_tokens} tokens in {stats.total_time_s:.2f} s "
        f"({stats.tokens_per_s:.2f} tokens/s), finish: {stats.finish_reason}",
        f"prompt {stats.num_prompt_tokens} tokens, prefill {stats.prefill_time_s:.2f} s, "
        f"target {stats.target_time_s:.2f} s, draft {stats.draft_time_s:.2f} s, overhead {stats.overhead_time_s:.3f} s",
    ]
    if stats.num_drafts:
        per_pos = " ".join(f"{a:.2f}" for a in stats.acceptance_by_position)
        lines.append(
            f"drafts {stats.num_drafts}, draft tokens {stats.num_draft_tokens}, accepted {stats.num_accepted_tokens}, "
            f"acceptance rate {stats.acceptance_rate:.3f}, mean accepted length {stats.mean_accepted_length:.2f}"
        )
        lines.append(f"acceptance by position: {per_pos}")
    if stats.hybrid_steps:
        lines.append(hybrid_steps_line(stats.hybrid_steps))
    lines.extend(f"warning: {w}" for w in stats.warnings)
    return "\n".join(lines)
