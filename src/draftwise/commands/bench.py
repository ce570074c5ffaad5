"""``draftwise bench``: every method side by side on the same models and prompts, in one process.

Methods: ``plain`` (always first, the baseline and exactness oracle), ``draft`` (draft model), ``ngram``
(prompt lookup), each at fixed K for every ``--ks`` value and/or with the cost-model controller (``--k-policies
auto``, K_max = max(ks)), plus the transformers anchors ``hf`` (assisted generation and prompt lookup) when
asked. Writes JSON (after every prompt; ``--resume`` continues it), a Markdown report and PNG plots.

Plain runs again after the other methods on every prompt (``plain (repeat)``: the order A B ... A) and every
speed-up is over the mean of the two plain passes. Each run records its CPU time, wall time and the load
average; a row whose figures are doubtful by :mod:`draftwise.speculation.measurement`'s rules (baseline moved, machine
busy, far from the cost model's prediction) carries a marker in the table, ``warnings`` in the JSON, and the
command ends with a WARNING line saying why.

``--workload agent`` replays multi-turn coding sessions instead (:mod:`draftwise.agent_bench`): in process,
one engine per method built like ``draftwise serve`` builds it, or with ``--url`` against OpenAI-compatible
servers (the first URL is the baseline).

``--workload agent-tools`` replays tool-using coding sessions (:mod:`draftwise.tool_agent_bench`): every model call
is a chat request with ``tools`` over HTTP, in process against the real server app started per method on
loopback, or against ``--url`` servers; each method's transcript must equal the baseline's.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import logging
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from draftwise.speculation import measurement
from draftwise.benchmark import (
    MethodSpec,
    PromptRun,
    default_prompts_path,
    doubts_of,
    draftwise_mismatches,
    load_prompts,
    load_results,
    run_benchmark,
    summarize,
    write_json,
)
from draftwise.builder import (
    DEMO_DRAFT,
    DEMO_TARGET,
    KV_CACHE_MEMORY_DEFAULT_HELP,
    assemble_engine,
    backend_kind,
    kv_cache_budget,
    load_draft_model,
)
from draftwise.speculation.calibration import ForwardCosts, draft_passes, draft_seconds, forward_pass_samples
from draftwise.commands.common import (
    CliError,
    add_backend_arg,
    add_quantization_arg,
    add_sampling_args,
    add_speculative_backend_arg,
    default_speculative_backend,
    check_device_args,
    memory_size,
    positive_int,
    print_table,
    sampling_params_from_args,
)
from draftwise.config import DEFAULT_DRAFT_CONFIDENCE as DEFAULT_CONFIDENCE
from draftwise.config import MAX_SPECULATIVE_TOKENS
from draftwise.methods import CATCH_UP_MODES, DEFAULT_CATCH_UP, K_POLICIES, MIN_DRAFT_WINDOW, is_confidence_threshold
from draftwise.models.loading import LoadedModel, load_model

logger = logging.getLogger(__name__)

METHODS = ("plain", "draft", "ngram", "medusa", "eagle", "hf")
#: Methods of the agent workload only: suffix decoding, the hybrid proposer, and plain decoding with the prefix
#: cache off (the baseline an agent loop gets from a server without prefix reuse).
AGENT_METHODS = METHODS + ("suffix", "hybrid", "plain-nocache")
#: Tokens in the cache under the calibration's timed passes.
CALIBRATION_CONTEXT = 200


def register(subparsers) -> None:
    parser = subparsers.add_parser("bench", help="benchmark plain vs speculative decoding")
    parser.add_argument("--model", "--target", dest="model", default=DEMO_TARGET, help=f"target (default {DEMO_TARGET})")
    parser.add_argument("--speculative-model", "--draft", dest="draft", default=DEMO_DRAFT,
                        help=f"draft model for the draft and hf methods (default {DEMO_DRAFT})")
    add_speculative_backend_arg(parser)
    parser.add_argument("--methods", default="plain,draft",
                        help=f"comma-separated, from {','.join(METHODS)}; with --workload agent from "
                             f"{','.join(m for m in AGENT_METHODS if m != 'hf')} (default plain,draft; plain is "
                             "always run)")
    parser.add_argument("--ks", default="4", help="comma-separated fixed K values (default 4)")
    parser.add_argument("--medusa-heads", default=None, help="heads directory for --methods medusa (draftwise train-heads)")
    parser.add_argument("--eagle-heads", default=None, help="heads directory for --methods eagle (draftwise train-heads)")
    parser.add_argument("--tree-widths", default="1",
                        help="draft/hybrid/medusa/eagle: comma-separated draft-tree widths (1 = a chain; default 1; "
                             "draft-model trees need the lean runtime)")
    parser.add_argument("--draft-windows", default="full",
                        help="draft/hybrid: comma-separated draft windows, 'full' (the whole context; default) or a "
                             "token count >= 32: the draft reads only the context's first 4 and most recent tokens "
                             "(draft_window, docs/draft_trees.md)")
    parser.add_argument("--draft-confidence", default=None,
                        help="draft/hybrid: comma-separated draft confidence thresholds, 'auto' or numbers in [0, 1): "
                             "a draft chain stops once the draft's probability of its path falls below the threshold "
                             "(auto: one per depth from the calibrated costs; 0: always K deep; default "
                             f"{DEFAULT_CONFIDENCE}, the rows without conf=; chains only: draft trees are sized by the "
                             "verify cost; draft_confidence_threshold, docs/draft_trees.md)")
    parser.add_argument("--k-policies", default="fixed", help="fixed, auto or fixed,auto (auto: K_max = max(ks))")
    parser.add_argument("--catch-up", default=DEFAULT_CATCH_UP,
                        help="draft (and, with --workload agent, hybrid) with --k-policies auto: deferred, eager or "
                        "deferred,eager: price the draft's catch-up prefill against the tokens generated so far "
                        f"(deferred, ski rental) or the remaining max_tokens (eager); default {DEFAULT_CATCH_UP}, "
                        "the rows without a catch-up in their name; see docs/draft_trees.md")
    parser.add_argument("--draft-vocab-size", type=int, default=None, metavar="N",
                        help="FR-Spec: the draft's LM head over the N most frequent tokens only (docs/frspec.md)")
    parser.add_argument("--token-map", default=None, help="FR-Spec: ranked token map file for --draft-vocab-size")
    parser.add_argument("--prompts", default=None, help="JSONL prompt file(s), comma-separated (default: Spec-Bench questions)")
    parser.add_argument("--category", default=None, help="comma-separated categories (default: all)")
    parser.add_argument("--limit", type=positive_int, default=None, help="prompts per category")
    parser.add_argument("--turns", choices=["first", "all"], default="first",
                        help="first turn only, or all turns (later turns see the model's own answers)")
    parser.add_argument("--chat", choices=["auto", "off"], default="auto", help="apply the chat template")
    parser.add_argument("--output", default=None, help="JSON output (default bench_results/bench-<time>.json); "
                        "the Markdown report and plots go next to it")
    parser.add_argument("--resume", default=None, help="continue an interrupted run from its JSON file")
    parser.add_argument("--no-calibrate", action="store_true", help="skip the forward-cost calibration")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument("--baseline-repeat", action=argparse.BooleanOptionalAction, default=True,
                        help="run the baseline (plain, or the first --url) again after the other methods (A B ... A) "
                        "and report its spread; speed-ups are over the mean of both passes (default: on; "
                        "--no-baseline-repeat saves that run but cannot tell whether the machine's speed moved)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None)
    add_quantization_arg(parser)
    add_backend_arg(parser)
    add_sampling_args(parser, max_tokens=128)
    _add_agent_args(parser)
    parser.set_defaults(func=run)


def _add_agent_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", choices=("prompts", "agent", "agent-tools"), default="prompts",
                        help="prompts: single prompts (default); agent: multi-turn coding sessions where every turn "
                        "carries the whole conversation so far; agent-tools: coding sessions whose turns call tools "
                        "(read_file, write_file, list_files, run_tests) over a virtual repository and feed the "
                        "results back, through the server's /v1/chat/completions (see docs/agent_bench.md)")
    group = parser.add_argument_group("agent workload (--workload agent)")
    group.add_argument("--sessions", default=None,
                       help="sessions file (.json or .jsonl; default data/agent_sessions.jsonl, with --workload "
                       "agent-tools data/agent_tool_sessions.jsonl), or 'spec-bench' to "
                       "build sessions from --prompts (category coding unless --category) plus coding follow-ups; "
                       "--limit caps the number of sessions")
    group.add_argument("--kv-cache-memory", type=memory_size, default=None, metavar="SIZE",
                       help="in process: prefix-cache budget of every method's engine (default: "
                       f"{KV_CACHE_MEMORY_DEFAULT_HELP}, read once for all methods; 0 = no prefix reuse); the method "
                       "plain-nocache always runs without")
    group.add_argument("--agent-turns", type=int, default=None,
                       help="turns per session (default: all of a file's; 4 for spec-bench)")
    group.add_argument("--system-prompt", default=None, help="system prompt for every session (replaces the file's)")
    group.add_argument("--url", action="append", default=None, metavar="[LABEL=]URL",
                       help="an OpenAI-compatible server (draftwise, vLLM, llama-server) to replay the sessions "
                       "against instead of loading models; repeat for several servers, the first is the baseline "
                       "for the identical-output check")
    group.add_argument("--api-key", default=None, help="bearer key for --url servers")
    group.add_argument("--model-name", default=None, help="model name to send to --url servers (default: the "
                       "first of GET /v1/models)")
    group.add_argument("--concurrency", type=int, default=1,
                       help="sessions in flight at once (--url only; in process the engine serves one request at a "
                       "time, so sessions run one after another)")
    group.add_argument("--chat-template", default=None,
                       help="in process: a Jinja chat template (file or inline) for models without one")
    group.add_argument("--request-timeout", type=float, default=600.0, help="seconds per --url request (default 600)")
    tools = parser.add_argument_group("tool-using agent workload (--workload agent-tools)")
    tools.add_argument("--max-calls", type=positive_int, default=None, metavar="N",
                       help="model calls per session at most (default: each session's max_calls)")
    tools.add_argument("--tool-choice", choices=("auto", "required"), default="auto",
                       help="the requests' tool_choice (default auto; required makes the server constrain every "
                       "reply to tool calls by a grammar, and a session then ends at --max-calls)")
    tools.add_argument("--tool-call-parser", default="auto", choices=["auto", "hermes", "llama3_json", "mistral"],
                       help="in process: the server's tool-call parser (default auto: from the chat template)")


def _head_subset(args: argparse.Namespace):
    """The draft's FR-Spec head subset from ``--draft-vocab-size`` / ``--token-map`` (None: the full head).

    Raises:
        CliError: a size below 1.
    """
    if args.draft_vocab_size is None and args.token_map is None:
        return None
    from draftwise.frspec import HeadSubset

    try:
        return HeadSubset(size=args.draft_vocab_size, token_map=args.token_map)
    except ValueError as exc:
        raise CliError(str(exc)) from exc


def _csv(text: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    items = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [item for item in items if item not in allowed]
    if unknown or not items:
        raise CliError(f"{flag}: unknown {unknown or text!r}; choose from {', '.join(allowed)}")
    return list(dict.fromkeys(items))


def parse_ks(text: str) -> list[int]:
    try:
        ks = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError as exc:
        raise CliError(f"--ks must be comma-separated integers, got {text!r}") from exc
    if not ks or min(ks) < 1 or max(ks) > MAX_SPECULATIVE_TOKENS:
        raise CliError(f"--ks: every K must be in 1..{MAX_SPECULATIVE_TOKENS}, got {text!r}")
    return ks


def method_label(kind: str, k: int, policy: str = "fixed", tree_width: int = 1, window: int | None = None,
                 catch_up: str = DEFAULT_CATCH_UP, confidence: float | str = DEFAULT_CONFIDENCE) -> str:
    """A method's name in tables and JSON: ``"draft K=4"``, ``"ngram auto(K<=4)"``, ``"eagle K=4 w=2"``,
    ``"draft K=4 win=256"`` (a draft window), ``"draft auto(K<=4) eager"`` (a catch-up other than the default),
    ``"draft K=8 conf=0.4"`` (a draft confidence threshold other than the default, written exactly: two thresholds
    never share a label)."""
    label = f"{kind} K={k}" if policy == "fixed" else f"{kind} auto(K<={k})"
    return (label + (f" w={tree_width}" if tree_width > 1 else "") + (f" win={window}" if window else "")
            + (f" {catch_up}" if catch_up != DEFAULT_CATCH_UP else "")
            + (f" conf={confidence!r}" if confidence != DEFAULT_CONFIDENCE else ""))  # repr: distinct values, labels


def build_methods(target: LoadedModel, draft: LoadedModel | None, methods: list[str], ks: list[int],
                  policies: list[str], calibrated: dict, heads: dict[str, str] | None = None,
                  tree_widths: list[int] = (1,), anchors: tuple | None = None,
                  windows: list[int | None] = (None,), catch_ups: list[str] = (DEFAULT_CATCH_UP,),
                  confidences: list[float | str] = (DEFAULT_CONFIDENCE,)) -> list[MethodSpec]:
    """Plain first, then each requested method x policy x K (x tree width x draft window x confidence threshold for
    the draft model, and x ``catch_ups`` for its auto policy; x tree width for Medusa / EAGLE at fixed K only),
    sharing the target backend. ``heads`` maps ``"medusa"`` / ``"eagle"`` to heads directories; ``anchors`` is
    ``(target, draft)`` on the transformers runtime for the ``hf`` methods (default: ``target`` and ``draft``)."""
    from draftwise.anchors import hf_runner
    from draftwise.builder import draft_confidence, tree_verify_seconds
    from draftwise.proposers.draft_model import DraftModelProposer
    from draftwise.proposers.ngram import NgramProposer

    eos = target.eos_token_ids
    specs = [MethodSpec("plain", "plain", engine=assemble_engine(target))]
    proposers = []  # (kind, tree width, draft window, confidence threshold, proposer)
    if "draft" in methods:
        widths = sorted(set(tree_widths)) if target.backend.supports_tree else [1]
        for w in widths:
            verify = tree_verify_seconds(target.backend, max(ks), w, None)  # None for a chain
            for window, confidence in itertools.product(windows, chain_confidences(confidences, w)):
                stop = draft_confidence(confidence, target.backend, draft.backend, max(ks), w)
                proposers.append(("draft", w, window, confidence, DraftModelProposer(
                    draft.backend, target.backend.vocab_size, tree_width=w, verify_seconds=verify, window=window,
                    confidence_threshold=stop)))
    if "ngram" in methods:
        proposers.append(("ngram", 1, None, DEFAULT_CONFIDENCE, NgramProposer()))
    for kind, width, window, confidence, proposer in proposers:
        for policy in policies:
            for k in (ks if policy == "fixed" else [max(ks)]):
                for catch_up in (catch_ups if policy == "auto" and kind == "draft" else [DEFAULT_CATCH_UP]):
                    label = method_label(kind, k, policy, width, window, catch_up, confidence)
                    factory = _controller_factory(policy, k, kind, target, draft, proposer, calibrated, catch_up)
                    engine = assemble_engine(target, proposer, k, controller_factory=factory)
                    specs.append(MethodSpec(label, kind, k, policy, engine=engine))
    for kind in ("medusa", "eagle"):
        if kind in methods:
            specs.extend(_head_methods(target, kind, (heads or {})[kind], ks, tree_widths))
    if "hf" in methods:
        hf_target, hf_draft = anchors or (target, draft)
        for k in ks:
            if hf_draft is not None:
                specs.append(MethodSpec(f"hf-assisted K={k}", "hf-assisted", k, runner=hf_runner(
                    hf_target.backend, eos, assistant=hf_draft.backend, num_assistant_tokens=k)))
            specs.append(MethodSpec(f"hf-lookup K={k}", "hf-lookup", k, runner=hf_runner(
                hf_target.backend, eos, prompt_lookup_tokens=k)))
    return specs


def _anchor_models(args, methods: list[str], target: LoadedModel, draft: LoadedModel | None,
                   options: dict) -> tuple | None:
    """The transformers-runtime models the ``hf`` anchors run (``transformers.generate`` needs a transformers
    model): the target and draft themselves when they already are, else copies loaded with the same
    quantization (so the anchor and draftwise run the same weights)."""
    from draftwise.backends.torch_backend import TorchCausalLM

    if "hf" not in methods:
        return None
    if isinstance(target.backend, TorchCausalLM) and (draft is None or isinstance(draft.backend, TorchCausalLM)):
        return target, draft
    hf_target = load_model(args.model, runtime="transformers", **options)
    hf_draft = None
    if draft is not None:
        hf_draft = load_model(args.draft, max_context=hf_target.backend.max_context, runtime="transformers", **options)
    return hf_target, hf_draft


def _head_methods(target: LoadedModel, kind: str, heads_dir: str, ks: list[int], widths) -> list[MethodSpec]:
    from draftwise.builder import build_head_proposer
    from draftwise.config import SpeculativeConfig

    specs = []
    for k in ks:
        for width in widths:
            config = SpeculativeConfig(method=kind, model=heads_dir, num_speculative_tokens=k, tree_width=width)
            engine = assemble_engine(target, build_head_proposer(config, target), k)
            label = method_label(kind, k, "fixed", width)
            specs.append(MethodSpec(label, kind, k, "fixed", engine=engine))
    return specs


def _catch_up_modes(args: argparse.Namespace, policies: list[str]) -> list[str]:
    """``--catch-up``'s modes (both workloads). Raises CliError: an unknown mode, or a non-default one without the
    auto K policy, whose choice it is."""
    catch_ups = _csv(args.catch_up, CATCH_UP_MODES, "--catch-up")
    if "auto" not in policies and catch_ups != [DEFAULT_CATCH_UP]:
        raise CliError("--catch-up is a choice of the auto K policy: add --k-policies auto")
    return catch_ups


def _controller_factory(policy, k, kind, target, draft, proposer, calibrated, catch_up=DEFAULT_CATCH_UP):
    from draftwise.speculation.calibration import calibrate_cost_model
    from draftwise.speculation.controller import MODEL_PRIOR_STRENGTH, k_controller_factory

    if policy == "fixed":
        return k_controller_factory("fixed", k)
    key = (kind, k)
    if key not in calibrated:
        calibrated[key] = calibrate_cost_model(target.backend, k, draft=draft.backend if kind == "draft" else None,
                                               proposer=proposer if kind != "draft" else None)
    strength = MODEL_PRIOR_STRENGTH if kind == "draft" else 1.0
    return k_controller_factory("auto", k, calibrated[key], prior_strength=strength, catch_up=catch_up)


def run(args: argparse.Namespace) -> int:
    check_device_args(args)
    args.speculative_backend = default_speculative_backend(args)
    if args.workload == "agent":
        return run_agent(args)
    if args.workload == "agent-tools":
        return run_tool_agent(args)
    if args.kv_cache_memory is not None:
        raise CliError("--kv-cache-memory applies to --workload agent (the prompts workload sends each prompt fresh, "
                       "as Spec-Bench does: no prefix reuse)")
    console = Console()
    params = sampling_params_from_args(args)
    ks = parse_ks(args.ks)
    methods = _csv(args.methods, METHODS, "--methods")
    policies = _csv(args.k_policies, K_POLICIES, "--k-policies")
    catch_ups = _catch_up_modes(args, policies)
    done: list[PromptRun] = []
    output = _output_file(args.resume or args.output or f"bench_results/bench-{time.strftime('%Y%m%d-%H%M%S')}.json")
    if args.resume:
        _, done, _ = load_results(args.resume)
        console.print(f"resuming {args.resume}: {len({r.prompt_id for r in done})} prompts already measured")
    prompt_paths = [Path(p.strip()) for p in args.prompts.split(",") if p.strip()] if args.prompts else [default_prompts_path()]
    prompts_path = ",".join(str(p) for p in prompt_paths)
    categories = [c.strip() for c in args.category.split(",")] if args.category else None
    prompts = [prompt for path in prompt_paths for prompt in load_prompts(path, categories, args.limit)]
    if not prompts:
        raise CliError(f"no prompts selected from {prompts_path} (category={args.category})")
    if len({p.id for p in prompts}) != len(prompts):
        raise CliError(f"prompt ids repeat across {prompts_path}; give each prompt a distinct question_id")

    heads = _heads_dirs(args, methods)
    tree_widths = _tree_widths(args.tree_widths)
    windows = draft_windows(args.draft_windows)
    confidences = draft_confidences(args.draft_confidence)
    if "hf" in methods and args.backend != "torch":
        raise CliError("--methods hf runs transformers' own generate and needs --backend torch")
    needs_draft = bool({"draft", "hf"} & set(methods))
    console.print(f"loading target {args.model}" + (f" and draft {args.draft}" if needs_draft else "") + " ...")
    options = dict(device=args.device, dtype=args.dtype, quantization=args.quantization, backend=args.backend,
                   threads=args.threads)
    # the heads methods run on the transformers model (as build_engine gives them): plain shares that target
    runtime = "transformers" if args.runtime == "auto" and {"medusa", "eagle"} & set(methods) else args.runtime
    target = load_model(args.model, runtime=runtime, **options)
    draft = _load_draft(args, target, options) if needs_draft else None
    anchors = _anchor_models(args, methods, target, draft, options)
    calibration, target_costs, draft_cost = _calibrate(console, args, target, draft, ks)
    prefill_s = calibration.get("draft_prefill_token_s")
    specs = build_methods(target, draft, methods, ks, policies, {}, heads, tree_widths, anchors=anchors,
                          windows=windows, catch_ups=catch_ups, confidences=confidences)
    if args.baseline_repeat:
        specs = measurement.with_baseline_repeat(specs)
    config = {"target": args.model, "draft": args.draft if needs_draft else None, "methods": [s.label for s in specs],
              "ks": ks, "k_policies": policies, "catch_up": catch_ups, "draft_confidence": confidences,
              "prompts": str(prompts_path),
              "categories": categories,
              "limit": args.limit, "turns": args.turns, "quantization": args.quantization, "backend": args.backend,
              "draft_backend": backend_kind(draft) if draft is not None else None,
              "threads": args.threads, "dtype": args.dtype, "max_tokens": params.max_tokens, "greedy": params.greedy,
              "temperature": params.temperature, "draft_vocab_size": args.draft_vocab_size, "token_map": args.token_map}

    def save(runs: list[PromptRun], complete: bool = False) -> None:
        write_json(output, config, runs, summarize(runs, target_costs, draft_cost, draft_prefill_s=prefill_s),
                   calibration, complete=complete)

    runs = _run_with_progress(console, target, specs, prompts, params, args, done, save)
    if not runs:
        raise CliError(f"no selected prompt fits the context of {target.backend.max_context} tokens "
                       "(see the warnings above; raise --max-model-len or pick other prompts)")
    summary = summarize(runs, target_costs, draft_cost, draft_prefill_s=prefill_s)
    by_category = summarize(runs, target_costs, draft_cost, by_category=True, draft_prefill_s=prefill_s)
    save(runs, complete=True)
    _print_tables(console, summary, by_category, calibration)
    _print_measurements(console, summary, runs, calibration)
    _write_reports(console, output, config, runs, summary, by_category, calibration, plots=not args.no_plots)
    differing = [r for r in runs if params.greedy and not r.identical_to_plain]
    mismatches = draftwise_mismatches(differing)
    if mismatches:
        console.print(f"[red]{len(mismatches)} run(s) differ from plain decoding[/red]")
    if len(differing) > len(mismatches):
        console.print(f"{len(differing) - len(mismatches)} run(s) of transformers' own generate (hf anchors) differ "
                      "from draftwise's plain decoding: another runtime's numerics, not counted as a draftwise error")
    print_warning(console, doubts_of(_shown_rows(summary, by_category), calibration))
    return 1 if mismatches else 0


def _output_file(path: str) -> Path:
    """``--output`` as the JSON file to write, checked before anything is measured.

    Raises:
        CliError: the path is an existing directory (the results are one JSON file, with the report beside it).
    """
    output = Path(path)
    if output.is_dir():
        raise CliError(f"--output {path}: is a directory; name the JSON file to write, e.g. {output / 'bench.json'}")
    return output


def print_warning(console: Console, doubts) -> None:
    """End a command with :func:`draftwise.speculation.measurement.warning_line` of ``(what, doubt)`` pairs, if any."""
    line = measurement.warning_line(doubts)
    if line:
        console.print(line, style="bold yellow", markup=False, highlight=False, soft_wrap=True)


def _load_draft(args: argparse.Namespace, target: LoadedModel, options: dict) -> LoadedModel:
    """The draft model ``--speculative-model``, loaded as :func:`draftwise.builder.build_engine` loads one: like the
    target, or on ``--speculative-backend``; tokenizer checked, llama.cpp's native one-token passes.

    Raises:
        CliError: an invalid draft backend choice; ModelLoadError, TokenizerMismatchError: see
            :func:`draftwise.builder.load_draft_model`.
    """
    from draftwise.config import SpeculativeConfig
    from draftwise.builder import BuildOptions

    try:
        config = SpeculativeConfig(method="draft_model", model=args.draft, backend=args.speculative_backend,
                                   draft_vocab_size=args.draft_vocab_size, token_map=args.token_map,
                                   tree_width=max(_tree_widths(args.tree_widths)))  # one draft serves every width
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    return load_draft_model(config, target, BuildOptions(runtime=args.runtime, **options))


def _heads_dirs(args: argparse.Namespace, methods: list[str]) -> dict[str, str | None]:
    """``{"medusa": dir, "eagle": dir}`` from the flags. Raises CliError: a heads method without its directory."""
    heads = {"medusa": args.medusa_heads, "eagle": args.eagle_heads}
    for kind in ("medusa", "eagle"):
        if kind in methods and not heads[kind]:
            raise CliError(f"--methods {kind} needs --{kind}-heads DIR (train them with: draftwise train-heads)")
    return heads


def draft_confidences(text: str | None) -> list[float | str]:
    """``--draft-confidence``: comma-separated thresholds, ``auto`` or numbers in [0, 1) (None: the default only).

    Raises:
        CliError: anything else.
    """
    if text is None:
        return [DEFAULT_CONFIDENCE]
    values: list[float | str] = []
    for item in (v.strip() for v in text.split(",")):
        if not item:
            continue
        if item == "auto":
            value: float | str = item
        else:
            try:
                value = float(item)
            except ValueError:
                value = -1.0
            if not is_confidence_threshold(value):
                raise CliError(f"--draft-confidence: each value must be 'auto' or a number in [0, 1), got {item!r}")
        if value not in values:
            values.append(value)
    if not values:
        raise CliError("--draft-confidence: give at least one threshold, e.g. auto,0,0.3")
    return values


def chain_confidences(confidences: list[float | str], tree_width: int) -> list[float | str]:
    """The draft confidence thresholds a draft of ``tree_width`` runs with: all of them for a chain (width 1), the
    default alone for a tree (trees are sized by the verify cost; a threshold beside one is refused)."""
    return list(confidences) if tree_width == 1 else [DEFAULT_CONFIDENCE]


def draft_windows(text: str) -> list[int | None]:
    """``--draft-windows``: comma-separated ``full`` (None) or token counts >= ``MIN_DRAFT_WINDOW`` (32).

    Raises:
        CliError: anything else.
    """
    windows: list[int | None] = []
    for item in (w.strip() for w in text.split(",")):
        if not item:
            continue
        if item == "full":
            windows.append(None)
        elif item.isdigit() and int(item) >= MIN_DRAFT_WINDOW:
            windows.append(int(item))
        else:
            raise CliError(f"--draft-windows takes 'full' or token counts >= {MIN_DRAFT_WINDOW}, got {item!r}")
    if not windows:
        raise CliError("--draft-windows needs at least one value ('full' or a token count)")
    return list(dict.fromkeys(windows))


def _tree_widths(text: str) -> list[int]:
    try:
        widths = [int(w) for w in text.split(",") if w.strip()]
    except ValueError as exc:
        raise CliError(f"--tree-widths must be comma-separated integers, got {text!r}") from exc
    if not widths or min(widths) < 1:
        raise CliError("--tree-widths needs integers >= 1")
    return widths


def _calibrate(console, args, target, draft, ks) -> tuple[dict, ForwardCosts | None, float | None]:
    """The forward-cost calibration for the predictions: the target's verify curve, the draft's one-token pass
    and its prefill rate (the passes of :func:`~draftwise.speculation.calibration.draft_passes`, timed as the cost model
    times them; seconds per token under ``"draft_prefill_token_s"``: the predictions price each prompt's
    catch-up with it), with their measurement and doubts (machine busy, noisy repeated timings) under
    ``"measurement"`` and ``"warnings"``."""
    if args.no_calibrate:
        return {}, None, None
    passes = draft_passes(draft.backend, CALIBRATION_CONTEXT) if draft is not None else []
    console.print("calibrating forward costs (target k = 1..K+1"
                  + (f", draft k = {' and '.join(map(str, passes))})" if draft else ")") + " ...")
    with measurement.measure(measurement.backend_threads(target.backend)) as measured:
        target_samples = forward_pass_samples(target.backend, range(1, max(ks) + 2), context_len=CALIBRATION_CONTEXT)
        draft_samples = (forward_pass_samples(draft.backend, passes, context_len=CALIBRATION_CONTEXT, num_logits=1)
                         if draft is not None else None)
    target_costs = ForwardCosts.from_samples(target_samples, CALIBRATION_CONTEXT)
    calibration = {"target": target_costs.to_dict()}
    draft_cost = None
    if draft_samples is not None:
        draft_cost, prefill_cost = draft_seconds(ForwardCosts.from_samples(draft_samples, CALIBRATION_CONTEXT))
        calibration.update(draft_1_token_s=draft_cost, cost_ratio_c=draft_cost / target_costs.seconds[1],
                           draft_prefill_token_s=prefill_cost)
    doubts = [measurement.machine_busy(measured.result, "calibration")]
    doubts += [measurement.noisy_timings(t, f"target {k}-token pass") for k, t in sorted(target_samples.items())]
    if draft_samples is not None:
        doubts.append(measurement.noisy_timings(draft_samples[passes[0]], "draft 1-token pass"))
        doubts.append(measurement.noisy_timings(draft_samples[passes[-1]], f"draft {passes[-1]}-token prefill pass"))
    calibration.update(measurement=measured.result.to_dict(), warnings=[d.to_dict() for d in doubts if d])
    return calibration, target_costs, draft_cost


def _run_with_progress(console, target, specs, prompts, params, args, done, save) -> list[PromptRun]:
    turns = sum(len(p.turns) if args.turns == "all" else 1 for p in prompts)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        task = progress.add_task("benchmarking", total=turns * len(specs))

        def on_run(run: PromptRun) -> None:
            progress.update(task, advance=1, description=f"prompt {run.prompt_id} {run.method}")
            logger.info("prompt %s turn %d %s: %.2f tokens/s, CPU share %s", run.prompt_id, run.turn, run.method,
                        run.tokens_per_s, _fmt(run.measurement.get("cpu_share")))

        return run_benchmark(target, specs, prompts, params, chat=args.chat == "auto", all_turns=args.turns == "all",
                             done=done, on_run=on_run, on_prompt=save)


def _fmt(value, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def _shown_rows(summary: list[dict], by_category: list[dict]) -> list[dict]:
    """The rows of the printed table: overall, then per category when there are several."""
    return summary + (by_category if len({r["category"] for r in by_category}) > 1 else [])


def _print_hybrid_lines(console: Console, summary: list[dict]) -> None:
    """Under a table: each hybrid method's passes by side (:func:`draftwise.report.hybrid_lines`)."""
    from draftwise.report import hybrid_lines

    for line in hybrid_lines(summary):
        console.print(line, markup=False, highlight=False, soft_wrap=True)


def _print_tables(console: Console, summary: list[dict], by_category: list[dict], calibration: dict) -> None:
    columns = ("!", "category", "method", "tok/s", "speedup", "decode speedup", "median [min, max]", "alpha", "tau",
               "K", "identical", "predicted")
    rows = []
    shown = _shown_rows(summary, by_category)
    for row in shown:
        spread = f"{_fmt(row['speedup_median'])} [{_fmt(row['speedup_min'])}, {_fmt(row['speedup_max'])}]"
        rows.append((measurement.marker(row.get("warnings", [])), row["category"], row["method"],
                     _fmt(row["tokens_per_s"]), _fmt(row["speedup_total"]),
                     _fmt(row.get("decode_speedup_total")), spread,
                     _fmt(row["acceptance_rate"], ".3f"), _fmt(row["mean_accepted_length"]), _fmt(row["mean_k"], ".1f"),
                     f"{row['identical']}/{row['runs']}", _fmt(row.get("predicted_speedup"))))
    print_table(console, "speculative decoding vs plain (same prompts, same process)", columns, rows)
    _print_hybrid_lines(console, summary)
    footnote = measurement.legend(d for row in shown for d in row.get("warnings", []))
    if footnote:
        console.print(footnote, markup=False, highlight=False, soft_wrap=True)
    if calibration:
        rel = calibration["target"]["relative"]
        curve = ", ".join(f"v{k}={float(v):.2f}" for k, v in rel.items())
        draft_part = (f"draft 1 token {calibration['draft_1_token_s'] * 1000:.0f} ms; c={calibration['cost_ratio_c']:.2f}; "
                      if "draft_1_token_s" in calibration else "")
        if calibration.get("draft_prefill_token_s"):
            draft_part += f"draft prefill {1 / calibration['draft_prefill_token_s']:.0f} tokens/s; "
        console.print(f"calibration: target 1 token {calibration['target']['seconds']['1'] * 1000:.0f} ms; "
                      f"{draft_part}{curve}")


def _print_measurements(console: Console, summary: list[dict], runs: list[PromptRun], calibration: dict) -> None:
    """The plain passes' speeds and spread, plain's time per token against the calibrated one-token forward,
    and the measured CPU share and load of all runs."""
    rows = {row["method"]: row for row in summary}
    passes = [rows[label] for label in measurement.baseline_labels(runs) if label in rows]
    if passes:
        speeds = ", ".join(f"{row['method']} {_fmt(row['tokens_per_s'])} tok/s" for row in passes)
        spread = passes[0].get("baseline_spread")
        line = f"baseline: {speeds}" + (f" ({spread:.0%} apart; speed-ups are over their mean)" if spread is not None
                                        else " (not repeated: --no-baseline-repeat)")
        plain = passes[0]
        tokens = sum(r.num_tokens for r in runs if r.method == plain["method"])
        if calibration and tokens:
            per_token = plain["decode_time_s"] / tokens
            one = calibration["target"]["seconds"]["1"]
            line += (f"; plain decode {per_token * 1e3:.1f} ms per token vs the calibrated one-token forward "
                     f"{one * 1e3:.1f} ms ({per_token / one:.2f}x)")
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    combined = measurement.combine(measurement.Measurement.from_dict(r.measurement) for r in runs)
    if combined is not None:
        console.print(measurement.describe(combined), markup=False, highlight=False, soft_wrap=True)


def _write_reports(console, output: Path, config, runs, summary, by_category, calibration, *, plots: bool) -> None:
    from draftwise.report import write_markdown, write_plots

    markdown = write_markdown(output.with_suffix(".md"), config, summary, by_category, calibration, runs)
    console.print(f"wrote {output} and {markdown}")
    if plots:
        for path in write_plots(output.parent / (output.stem + "-plots"), runs, by_category, summary):
            console.print(f"wrote {path}")


# ---------------------------------------------------------------------- --workload agent
def run_agent(args: argparse.Namespace) -> int:
    """``bench --workload agent``: replay multi-turn sessions in process (one engine per method) or against
    ``--url`` servers, the baseline again at the end (unless ``--no-baseline-repeat``); print the tables and
    write JSON, Markdown and plots, ending with a WARNING line when a figure is doubtful. Returns 1 when a
    greedy output differs from the baseline's."""
    from draftwise.agent_bench import AgentBenchError, agent_doubts, session_totals, summarize_agent

    console = Console()
    params = sampling_params_from_args(args)
    if args.resume:
        raise CliError("--resume is not supported with --workload agent")
    if args.concurrency < 1:
        raise CliError(f"--concurrency must be >= 1, got {args.concurrency}")
    if args.request_timeout <= 0:
        raise CliError(f"--request-timeout must be > 0, got {args.request_timeout}")
    sessions, source = _agent_sessions(args)
    methods, config = _agent_methods(args, params)
    if args.baseline_repeat:
        methods = measurement.with_baseline_repeat(methods)
        config["methods"] = [m.label for m in methods]
    note = None
    if not args.url and args.concurrency > 1:
        note = "in process the engine serves one request at a time: sessions ran one after another"
        console.print(f"--concurrency {args.concurrency}: {note}")
    config.update(sessions=source, num_sessions=len(sessions), max_turns=max(len(s.turns) for s in sessions),
                  concurrency=args.concurrency, concurrency_note=note, max_tokens=params.max_tokens,
                  greedy=params.greedy, temperature=params.temperature, seed=params.seed)
    output = _output_file(args.output or f"bench_results/agent-{time.strftime('%Y%m%d-%H%M%S')}.json")
    try:
        turns, elapsed = _run_agent_with_progress(console, methods, sessions, args.concurrency)
    except AgentBenchError as exc:
        raise CliError(str(exc)) from exc
    summary, per_session = summarize_agent(turns, elapsed), session_totals(turns)
    _print_agent_tables(console, summary, per_session)
    _write_agent_reports(console, output, config, turns, summary, per_session, plots=not args.no_plots)
    mismatches = [t for t in turns if params.greedy and not t.identical_to_plain]
    if mismatches:
        console.print(f"[red]{len(mismatches)} turn(s) differ from {methods[0].label}[/red]")
    print_warning(console, agent_doubts(summary))
    return 1 if mismatches else 0


def run_tool_agent(args: argparse.Namespace) -> int:
    """``bench --workload agent-tools``: replay the tool-using sessions with every method (in process: the real
    server app per method on loopback; or ``--url`` servers), the baseline again at the end (unless
    ``--no-baseline-repeat``); print the agent table and the tool-call table, write JSON and Markdown (and
    plots). Returns 1 when a method's transcript differs from the baseline's under greedy decoding."""
    import functools

    from draftwise.agent_bench import AgentBenchError, agent_doubts, session_totals
    from draftwise.tool_agent_bench import default_tool_sessions_path, load_tool_sessions, replay_tool_session, \
        summarize_tool_agent

    console = Console()
    params = sampling_params_from_args(args)
    if args.resume:
        raise CliError("--resume is not supported with --workload agent-tools")
    if args.request_timeout <= 0:
        raise CliError(f"--request-timeout must be > 0, got {args.request_timeout}")
    if args.concurrency < 1:
        raise CliError(f"--concurrency must be >= 1, got {args.concurrency}")
    if args.sessions == "spec-bench" or args.agent_turns is not None:
        raise CliError("--sessions spec-bench and --agent-turns apply to --workload agent; tool sessions come from a "
                       "file (--sessions FILE) and end after --max-calls calls")
    path = Path(args.sessions) if args.sessions else default_tool_sessions_path()
    try:
        sessions = load_tool_sessions(path, limit=args.limit, max_calls=args.max_calls)
    except (OSError, ValueError) as exc:
        raise CliError(str(exc)) from exc
    if args.system_prompt:
        sessions = [dataclasses.replace(s, system=args.system_prompt) for s in sessions]
    methods, config = _agent_methods(args, params, in_process=_served_engine_method)
    if args.baseline_repeat:
        methods = measurement.with_baseline_repeat(methods)
        config["methods"] = [m.label for m in methods]
    config.update(workload="agent-tools", sessions=str(path), num_sessions=len(sessions),
                  max_turns=max(s.max_calls for s in sessions), concurrency=args.concurrency,
                  tool_choice=args.tool_choice, max_tokens=params.max_tokens, greedy=params.greedy,
                  temperature=params.temperature, seed=params.seed)
    output = _output_file(args.output or f"bench_results/agent-tools-{time.strftime('%Y%m%d-%H%M%S')}.json")
    replay = functools.partial(replay_tool_session, tool_choice=args.tool_choice)
    try:
        turns, elapsed = _run_agent_with_progress(console, methods, sessions, args.concurrency, replay)
    except AgentBenchError as exc:
        raise CliError(str(exc)) from exc
    summary, per_session = summarize_tool_agent(turns, elapsed), session_totals(turns)
    _print_agent_tables(console, summary, per_session)
    _print_tool_table(console, summary)
    _write_agent_reports(console, output, config, turns, summary, per_session, plots=not args.no_plots,
                         workload="agent-tools")
    differing = [r["method"] for r in summary if not r["transcript_identical"]]
    if differing and params.greedy:
        console.print(f"[red]BUG: the transcripts of {', '.join(differing)} differ from {methods[0].label}'s[/red]")
    print_warning(console, agent_doubts(summary))
    return 1 if differing and params.greedy else 0


def _print_tool_table(console: Console, summary: list[dict]) -> None:
    from draftwise.report import tool_agent_columns, tool_agent_rows

    print_table(console, "tool calls: alpha / tau on replies with tool_calls vs the other replies",
                tool_agent_columns(summary), tool_agent_rows(summary))


def _agent_sessions(args: argparse.Namespace):
    """The sessions to replay and a description of their source. Raises CliError on bad flags."""

    from draftwise.agent_bench import DEFAULT_SYSTEM_PROMPT, default_sessions_path, load_sessions, sessions_from_prompts

    if args.agent_turns is not None and args.agent_turns < 1:
        raise CliError(f"--agent-turns must be >= 1, got {args.agent_turns}")
    if args.limit is not None and args.limit < 1:
        raise CliError(f"--limit must be >= 1, got {args.limit}")
    if args.sessions == "spec-bench":
        paths = [Path(p.strip()) for p in args.prompts.split(",") if p.strip()] if args.prompts else [default_prompts_path()]
        categories = [c.strip() for c in args.category.split(",")] if args.category else ["coding"]
        prompts = [prompt for path in paths for prompt in load_prompts(path, categories, args.limit)]
        if not prompts:
            raise CliError(f"no prompts in {','.join(map(str, paths))} for categories {categories}")
        sessions = sessions_from_prompts(prompts, num_turns=args.agent_turns or 4,
                                         system=args.system_prompt or DEFAULT_SYSTEM_PROMPT)
        return sessions, f"spec-bench:{','.join(map(str, paths))} categories={categories}"
    path = Path(args.sessions) if args.sessions else default_sessions_path()
    sessions = load_sessions(path, limit=args.limit, max_turns=args.agent_turns)
    if args.system_prompt:
        sessions = [dataclasses.replace(s, system=args.system_prompt) for s in sessions]
    return sessions, str(path)


def _agent_methods(args: argparse.Namespace, params, in_process=None):
    """The methods (baseline first) and the run's configuration dict; ``in_process`` makes an in-process method
    from ``(label, kind, k, spec_config, args, params, chat_template, kv_cache_memory)`` (default
    :func:`_engine_method`). Raises CliError on bad flags."""
    if args.url:
        if args.catch_up != DEFAULT_CATCH_UP:
            raise CliError("--catch-up applies to in-process methods; a --url server's catch-up is its own "
                           "(serve --speculative-config '{\"k_policy\": \"auto\", \"catch_up\": \"eager\", ...}')")
        labelled = _parse_urls(args.url)
        config = {"mode": "http", "urls": dict(labelled), "methods": [label for label, _ in labelled],
                  "model_name": args.model_name}
        return [_http_method(label, url, params, args) for label, url in labelled], config
    methods = _csv(args.methods, AGENT_METHODS, "--methods")
    if "hf" in methods:
        raise CliError("--methods hf (transformers' generate) is not available with --workload agent")
    _head_subset(args)  # a bad size is a CLI error before any model loads
    policies = _csv(args.k_policies, K_POLICIES, "--k-policies")
    catch_ups = _catch_up_modes(args, policies)
    plan = agent_method_plan(methods, parse_ks(args.ks), policies,
                             _tree_widths(args.tree_widths), _heads_dirs(args, methods), args.draft,
                             draft_vocab={"draft_vocab_size": args.draft_vocab_size, "token_map": args.token_map},
                             draft_backend=args.speculative_backend, windows=draft_windows(args.draft_windows),
                             confidences=draft_confidences(args.draft_confidence), catch_ups=catch_ups)
    chat_template = _chat_template(args.chat_template)
    kv_cache = kv_cache_budget(args.kv_cache_memory)  # once: every method gets the same budget
    logger.info("%s", kv_cache.describe())
    make_method = in_process or _engine_method
    specs = [make_method(label, kind, k, spec_config, args, params, chat_template, kv_cache.nbytes)
             for label, kind, k, spec_config in plan]
    config = {"mode": "in-process", "target": args.model, "draft": args.draft if "draft" in methods else None,
              "methods": [label for label, *_ in plan], "quantization": args.quantization, "backend": args.backend,
              "draft_backend": args.speculative_backend, "threads": args.threads, "dtype": args.dtype,
              "chat_template": "given" if chat_template else "model's", "kv_cache_memory": kv_cache.nbytes}
    return specs, config


def agent_method_plan(methods: list[str], ks: list[int], policies: list[str], tree_widths: list[int],
                      heads: dict[str, str | None], draft: str | None, draft_vocab: dict | None = None, *,
                      draft_backend: str | None = None, windows: list[int | None] = (None,),
                      confidences: list[float | str] = (DEFAULT_CONFIDENCE,),
                      catch_ups: list[str] = (DEFAULT_CATCH_UP,)) -> list[tuple]:
    """``(label, kind, k, SpeculativeConfig | None)`` per in-process method, plain first, in the order and with
    the labels of the prompts workload (draft and ngram per policy and K; Medusa / EAGLE per K and tree width).
    ``draft_vocab`` (``draft_vocab_size`` / ``token_map``) and ``draft_backend`` (the draft model's own backend,
    ``--speculative-backend``), ``windows`` (``draft_window`` values, None: the whole context) and ``confidences``
    (``draft_confidence_threshold`` values) go to the methods that run the draft model, and ``catch_ups``
    (``catch_up``) to those with the auto K policy.

    Raises:
        CliError: an invalid configuration (e.g. an unknown ``draft_backend``).
    """
    from draftwise.config import SpeculativeConfig

    plan: list[tuple] = [("plain", "plain", None, None)]
    if "plain-nocache" in methods:
        plan.append(("plain no-reuse", "plain-nocache", None, None))
    for kind, method in (("draft", "draft_model"), ("ngram", "ngram"), ("suffix", "suffix"), ("hybrid", "hybrid")):
        if kind not in methods:
            continue
        with_draft = kind in ("draft", "hybrid")
        for policy in policies:
            for k in (ks if policy == "fixed" else [max(ks)]):
                shapes = itertools.product(sorted(set(tree_widths)) if with_draft else [1],
                                           windows if with_draft else [None])
                modes = catch_ups if with_draft and policy == "auto" else [DEFAULT_CATCH_UP]
                for width, window, confidence, catch_up in [
                        (w, win, c, mode) for w, win in shapes
                        for c in (chain_confidences(confidences, w) if with_draft else [DEFAULT_CONFIDENCE])
                        for mode in modes]:
                    try:
                        config = SpeculativeConfig(method=method, model=draft if with_draft else None,
                                                   num_speculative_tokens=k, k_policy=policy, tree_width=width,
                                                   backend=draft_backend if with_draft else None, catch_up=catch_up,
                                                   **({**(draft_vocab or {}), "draft_window": window,
                                                       "draft_confidence_threshold": confidence}
                                                      if with_draft else {}))
                    except ValueError as exc:
                        raise CliError(str(exc)) from exc
                    plan.append((method_label(kind, k, policy, width, window, catch_up, confidence), kind, k,
                                 config))
    for kind in ("medusa", "eagle"):
        if kind in methods:
            for k in ks:
                for width in tree_widths:
                    config = SpeculativeConfig(method=kind, model=heads[kind], num_speculative_tokens=k, tree_width=width)
                    plan.append((method_label(kind, k, "fixed", width), kind, k, config))
    return plan


def _engine_method(label, kind, k, spec_config, args, params, chat_template, kv_cache_memory: int):
    """An in-process method: its engine is built (models loaded) when the replay opens it and dropped after; its
    prefix cache holds ``kv_cache_memory`` bytes (none for ``plain-nocache``)."""
    from contextlib import contextmanager

    from draftwise.agent_bench import AgentMethod, EngineTurnRunner
    from draftwise.builder import build_engine

    @contextmanager
    def open_runner():
        bundle = build_engine(args.model, spec_config, device=args.device, dtype=args.dtype,
                              quantization=args.quantization, backend=args.backend, threads=args.threads,
                              runtime=args.runtime, kv_cache_memory=0 if kind == "plain-nocache" else kv_cache_memory)
        yield EngineTurnRunner(bundle, params, chat_template)

    return AgentMethod(label, open_runner, kind, k, concurrent=False)


def _served_engine_method(label, kind, k, spec_config, args, params, chat_template, kv_cache_memory: int):
    """An in-process method served over HTTP: its engine is built as ``draftwise serve`` builds it (one request at
    a time), the real server app runs on loopback while the method replays, and is stopped after; the prefix
    cache holds ``kv_cache_memory`` bytes (none for ``plain-nocache``)."""
    from draftwise.builder import build_engine
    from draftwise.server import ServerSettings
    from draftwise.tool_agent_bench import served_method

    settings = ServerSettings(chat_template=chat_template,
                              tool_call_parser=None if args.tool_call_parser == "auto" else args.tool_call_parser)

    def build_bundle():
        return build_engine(args.model, spec_config, device=args.device, dtype=args.dtype,
                            quantization=args.quantization, backend=args.backend, threads=args.threads,
                            runtime=args.runtime, kv_cache_memory=0 if kind == "plain-nocache" else kv_cache_memory)

    return served_method(label, kind, k, build_bundle, settings, params, timeout_s=args.request_timeout)


def _http_method(label: str, url: str, params, args):
    """A method served by an OpenAI-compatible server (thread-safe: sessions may run concurrently)."""
    from contextlib import contextmanager

    from draftwise.agent_bench import AgentMethod, HttpTurnRunner

    @contextmanager
    def open_runner():
        with HttpTurnRunner(url, params, model=args.model_name, api_key=args.api_key, timeout_s=args.request_timeout,
                            max_connections=max(16, args.concurrency)) as runner:
            yield runner

    return AgentMethod(label, open_runner, "server", None, concurrent=True)


def _parse_urls(values: list[str]) -> list[tuple[str, str]]:
    """``[LABEL=]URL`` flags -> ``(label, url)``; the label defaults to the URL's host:port.

    Raises:
        CliError: a value that is not an http(s) URL, or repeated labels.
    """
    from urllib.parse import urlsplit

    labelled = []
    for value in values:
        label, sep, url = value.partition("=")
        if not sep or "://" in label:
            label, url = "", value
        if not url.startswith(("http://", "https://")):
            raise CliError(f"--url: expected [LABEL=]http(s)://host:port, got {value!r}")
        labelled.append((label.strip() or urlsplit(url).netloc, url))
    labels = [label for label, _ in labelled]
    if len(set(labels)) != len(labels):
        raise CliError(f"--url labels repeat ({labels}); name them: --url plain=URL --url ngram=URL")
    return labelled


def _chat_template(value: str | None) -> str | None:
    from draftwise.commands.serve import _chat_template as read_chat_template

    return read_chat_template(value)


def _run_agent_with_progress(console, methods, sessions, concurrency, replay_session=None):
    from draftwise.agent_bench import run_agent_benchmark

    total = len(methods) * sum(len(s.turns) for s in sessions)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        task = progress.add_task("agent sessions", total=total)

        def on_turn(turn) -> None:
            progress.update(task, advance=1, description=f"{turn.method}: session {turn.session_id} turn {turn.turn}")
            logger.info("%s session %s turn %d: %s prompt tokens (%s cached), TTFT %s s, %.2f s", turn.method,
                        turn.session_id, turn.turn, turn.prompt_tokens, turn.cached_tokens, _fmt(turn.ttft_s),
                        turn.wall_s)

        return run_agent_benchmark(methods, sessions, concurrency=concurrency, on_turn=on_turn,
                                   replay_session=replay_session)


def _print_agent_tables(console: Console, summary: list[dict], per_session: list[dict]) -> None:
    from draftwise.report import (
        AGENT_METHOD_COLUMNS,
        AGENT_SESSION_COLUMNS,
        agent_method_rows,
        agent_session_rows,
    )

    print_table(console, "agent loop: multi-turn sessions, each turn carries the conversation so far",
                AGENT_METHOD_COLUMNS, agent_method_rows(summary))
    _print_hybrid_lines(console, summary)
    footnote = measurement.legend(d for row in summary for d in row.get("warnings", []))
    if footnote:
        console.print(footnote, markup=False, highlight=False, soft_wrap=True)
    if len({r["session_id"] for r in per_session}) > 1:
        print_table(console, "per session", AGENT_SESSION_COLUMNS, agent_session_rows(per_session))
    baseline, others = summary[0], summary[1:]
    passes = [row for row in summary
              if row["method"] in (baseline["method"], baseline["method"] + measurement.REPEAT_SUFFIX)]
    if len(passes) > 1:
        walls = ", ".join(f"{row['method']} {_fmt(row['wall_s'])} s" for row in passes)
        console.print(f"baseline: {walls} ({baseline['baseline_spread']:.0%} apart; speed-ups are over their mean)",
                      markup=False, highlight=False, soft_wrap=True)
    combined = measurement.combine(measurement.Measurement.from_dict(r.get("measurement", {})) for r in summary)
    if combined is not None:
        console.print(measurement.describe(combined), markup=False, highlight=False, soft_wrap=True)
    others = [row for row in others if row not in passes]
    if others:
        parts = ", ".join(f"{r['method']} {_fmt(r['speedup'])}x" for r in others)
        identical = all(r["identical"] == r["turns"] for r in others)
        console.print(f"agent-loop speed-up over {baseline['method']} ({baseline['sessions']} session(s), "
                      f"{baseline['turns']} turns, wall time): {parts}; outputs "
                      + ("identical to " + baseline["method"] + " on every turn" if identical else "[red]DIFFER[/red]"),
                      soft_wrap=True)


def _write_agent_reports(console, output: Path, config, turns, summary, per_session, *, plots: bool,
                         workload: str = "agent") -> None:
    from draftwise.agent_bench import write_agent_json
    from draftwise.report import tool_agent_markdown, write_agent_markdown, write_agent_plots

    write_agent_json(output, config, turns, summary, per_session, workload=workload)
    extra = tool_agent_markdown(summary) if workload == "agent-tools" else ()
    markdown = write_agent_markdown(output.with_suffix(".md"), config, summary, per_session, turns, extra)
    console.print(f"wrote {output} and {markdown}", soft_wrap=True)
    if plots:
        for path in write_agent_plots(output.parent / (output.stem + "-plots"), turns, per_session):
            console.print(f"wrote {path}", soft_wrap=True)
