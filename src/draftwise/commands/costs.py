"""``draftwise costs``: the verify-cost curve of a model on this machine.

For k new tokens on top of a ``--context``-token cache it prints the median forward time, ``v_k`` (that time
over one token's) and the time per token. Speculation with K draft tokens pays only where ``v_(K+1)`` stays
well below K + 1; with ``--draft`` it also prints the draft/target cost ratio c of one-token passes.

It also prints the machine (CPU model and flags, :func:`draftwise.backends.kernels.cpu_description`), its
measured DRAM read bandwidth, the bytes of the model's linear-layer weights and the weight-streaming lower
bound of one token (bytes / bandwidth) next to the measured one-token time; ``--kernels`` runs (or reads
from its cache) the linear-kernel self-test for the model's layer shapes and prints its table
(:func:`draftwise.backends.kernels.select_linear_kernel`).

The timings record the process's CPU time and the load average (:mod:`draftwise.speculation.measurement`): a k whose
repeated timings spread too far is marked ``!N`` in the table, every row ``!C`` when the machine was busy, the
JSON carries ``measurement``, ``spread`` (per k) and ``warnings``, and the command ends with a WARNING line.
"""

from __future__ import annotations

import argparse
import json
import logging

import torch
from rich.console import Console
from rich.table import Table

from draftwise.speculation import measurement
from draftwise.backends.kernels import (
    KERNEL_MODES,
    TIMED_ROWS,
    KernelChoice,
    KernelError,
    cpu_description,
    linear_weight_bytes,
    measure_dram_bandwidth,
    model_linear_shapes,
    select_linear_kernel,
)
from draftwise.builder import DEMO_TARGET
from draftwise.speculation.calibration import ForwardCosts, forward_pass_samples
from draftwise.commands.common import (
    CliError,
    add_quantization_arg,
    add_speculative_backend_arg,
    check_device_args,
    default_speculative_backend,
)
from draftwise.speculation.cost_model import CostModel, draft_stop_thresholds
from draftwise.models.loading import load_model

__all__ = ["register", "run", "parse_token_counts"]

logger = logging.getLogger(__name__)


def register(subparsers) -> None:
    parser = subparsers.add_parser("costs", help="measure the verify-cost curve (k-token forward / 1-token forward)")
    parser.add_argument("model", nargs="?", default=DEMO_TARGET, help=f"model to time (default {DEMO_TARGET})")
    add_quantization_arg(parser)
    parser.add_argument("--max-k", type=int, default=16, help="time k = 1..MAX_K new tokens (default 16)")
    parser.add_argument("--ks", default=None, help="comma-separated token counts instead of 1..MAX_K")
    parser.add_argument("--context", type=int, default=200, help="tokens in the cache under each pass (default 200)")
    parser.add_argument("--repeats", type=int, default=5, help="timed passes per k; the median is kept (default 5)")
    parser.add_argument("--draft", "--speculative-model", dest="draft", default=None,
                        help="also time this draft model's one-token pass and print the cost ratio c")
    add_speculative_backend_arg(parser)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    parser.add_argument("--dtype", default=None, help="fp32, bf16 or fp16 (default fp32; a draft model on a GPU bf16)")
    parser.add_argument("--kernels", nargs="?", const="", default=None, metavar="MODES",
                        help="also run the linear-kernel self-test for the model's layer shapes (cached per machine) "
                        "and print its table; MODES: comma-separated of " + ", ".join(KERNEL_MODES)
                        + " (default: the --quantization mode)")
    parser.add_argument("--bandwidth-mib", type=int, default=512,
                        help="buffer size of the DRAM bandwidth measurement, MiB (default 512; keep it far above "
                        "the last-level cache)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.set_defaults(func=run)


def parse_kernel_modes(value: str | None, quantization: str) -> list[str]:
    """``--kernels`` -> the modes to self-test ([] when absent; the quantization mode when given bare).

    Raises:
        CliError: an unknown mode.
    """
    if value is None:
        return []
    if quantization == "auto":
        from draftwise.backends.quantization import int8_usable

        quantization = "int8" if int8_usable() else "none"
    modes = [m.strip() for m in value.split(",") if m.strip()] or [quantization]
    unknown = [m for m in modes if m not in KERNEL_MODES]
    if unknown:
        raise CliError(f"--kernels: unknown mode {unknown[0]!r}; choose from {', '.join(KERNEL_MODES)}")
    return list(dict.fromkeys(modes))


def parse_token_counts(ks: str | None, max_k: int) -> list[int]:
    """``--ks`` (comma-separated) or 1..max_k, sorted, with 1 always included.

    Raises:
        CliError: non-integers or a count below 1.
    """
    if ks is None:
        if max_k < 1:
            raise CliError(f"--max-k must be >= 1, got {max_k}")
        return list(range(1, max_k + 1))
    try:
        counts = {int(part) for part in ks.split(",") if part.strip()}
    except ValueError as exc:
        raise CliError(f"--ks must be comma-separated integers, got {ks!r}") from exc
    if not counts or min(counts) < 1:
        raise CliError("--ks needs token counts >= 1")
    return sorted(counts | {1})


def run(args: argparse.Namespace) -> int:
    check_device_args(args)
    if args.repeats < 1 or args.context < 1:
        raise CliError("--repeats and --context must be >= 1")
    ks = parse_token_counts(args.ks, args.max_k)
    kernel_modes = parse_kernel_modes(args.kernels, args.quantization)
    if args.bandwidth_mib < 1:
        raise CliError("--bandwidth-mib must be >= 1")
    console = Console(stderr=args.json)
    options = dict(device=args.device, dtype=args.dtype, quantization=args.quantization, runtime=args.runtime)
    console.print(f"loading {args.model} (quantization {args.quantization}) ...")
    target = load_model(args.model, **options)
    args.quantization = target.quantization  # "auto" resolved: the table and JSON name the mode measured
    context = _fit_context(args.context, target.backend.max_context, ks[-1])
    timed_ks = f"{ks[0]}..{ks[-1]}" if ks == list(range(ks[0], ks[-1] + 1)) else ", ".join(map(str, ks))
    console.print(f"timing k = {timed_ks} new tokens on a {context}-token context, {args.repeats} repeats ...")
    timed = _timed(target.backend, ks, context, args.repeats)
    costs = ForwardCosts.from_samples(timed["samples"], context)
    draft_s = None
    draft_timed = None
    if args.draft:
        console.print(f"loading draft {args.draft} ...")
        draft = _load_draft(args, target, options)
        if draft.runtime_choice:
            console.print(f"draft runtime (auto): {draft.runtime_choice}", markup=False, highlight=False,
                          soft_wrap=True)
        draft_timed = _timed(draft.backend, [1], context, args.repeats)
        draft_s = ForwardCosts.from_samples(draft_timed["samples"], context).seconds[1]
    doubts = _doubts(timed, draft_timed)
    machine = _machine_figures(target.backend, costs, args.bandwidth_mib)
    choices = _kernel_choices(console, target.backend, kernel_modes)
    if args.json:
        result = _result_dict(args, costs, draft_s)
        result.update(machine=machine, measurement=timed["measurement"].to_dict(),
                      spread={str(k): measurement.relative_spread(t) for k, t in timed["samples"].items()},
                      warnings=[{"row": what, **d.to_dict()} for what, d in doubts])
        if draft_timed is not None:
            result["draft_measurement"] = draft_timed["measurement"].to_dict()
            result["draft_runtime_choice"] = draft.runtime_choice
        if kernel_modes:
            result["kernels"] = {mode: c.to_dict() if isinstance(c, KernelChoice) else {"error": c}
                                 for mode, c in choices.items()}
        print(json.dumps(result, indent=2))
    else:
        _print_curve(console, args, costs, draft_s, doubts)
        _print_machine(console, machine)
        console.print(measurement.describe(timed["measurement"]), markup=False, highlight=False, soft_wrap=True)
        for mode, choice in choices.items():
            _print_kernels(console, mode, choice)
    line = measurement.warning_line(doubts)
    if line:
        console.print(line, style="bold yellow", markup=False, highlight=False, soft_wrap=True)
    return 0


def _load_draft(args: argparse.Namespace, target, options: dict):
    """``--draft`` loaded as the engine loads a draft (:func:`draftwise.builder.load_draft_model`): like the
    target, or on ``--speculative-backend`` (``auto`` measures the candidate runtimes, cached per machine).

    Raises:
        CliError: an invalid draft backend choice, or a draft whose tokenizer the target cannot verify.
    """
    from draftwise.builder import BuildOptions, TokenizerMismatchError, load_named_draft

    try:
        return load_named_draft(args.draft, target, BuildOptions(**options), default_speculative_backend(args))
    except (ValueError, TokenizerMismatchError) as exc:
        raise CliError(f"--draft {args.draft}: {exc}") from exc


def _timed(backend, ks: list[int], context: int, repeats: int) -> dict:
    """``{"samples": {k: [seconds]}, "measurement": Measurement}`` of the timed forward passes."""
    with measurement.measure(measurement.backend_threads(backend)) as measured:
        samples = forward_pass_samples(backend, ks, context_len=context, repeats=repeats)
    return {"samples": samples, "measurement": measured.result}


def _doubts(timed: dict, draft_timed: dict | None) -> list[tuple[str, measurement.Doubt]]:
    """``(row, doubt)``: machine busy during the target's (row ``target``: every k) or the draft's timings, and
    each k (row ``k=K``) whose repeated timings spread too far."""
    doubts = [("target", measurement.machine_busy(timed["measurement"]))]
    doubts += [(f"k={k}", measurement.noisy_timings(t, f"{k}-token pass")) for k, t in sorted(timed["samples"].items())]
    if draft_timed is not None:
        doubts.append(("draft", measurement.machine_busy(draft_timed["measurement"])))
        doubts.append(("draft", measurement.noisy_timings(draft_timed["samples"][1], "draft 1-token pass")))
    return [(what, d) for what, d in doubts if d is not None]


def _machine_figures(backend, costs: ForwardCosts, bandwidth_mib: int) -> dict:
    """CPU, threads, the read bandwidth of the memory the weights sit in (the GPU's for a model on a GPU, else
    DRAM), linear weight bytes and the weight-streaming bound per token (bytes / bandwidth) against the measured
    one-token time. Weight bytes are None for a backend without a PyTorch module (llama.cpp)."""
    model = getattr(backend, "model", None)
    device = _weights_device(model)
    bandwidth = measure_dram_bandwidth(bandwidth_mib << 20, device=device)
    weight_bytes = linear_weight_bytes(model) if isinstance(model, torch.nn.Module) else None
    bound = None if weight_bytes is None else weight_bytes / bandwidth
    one = costs.seconds[1]
    return {"cpu": cpu_description(), "torch_threads": torch.get_num_threads(), "memory_device": device.type,
            "memory_read_bytes_per_s": bandwidth,
            "linear_weight_bytes": weight_bytes, "weight_bound_s": bound, "one_token_s": one,
            "one_token_over_bound": None if bound is None else one / bound}


def _weights_device(model) -> torch.device:
    """The device of ``model``'s first parameter (the CPU for a backend without a PyTorch module)."""
    if isinstance(model, torch.nn.Module):
        for parameter in model.parameters():
            return parameter.device
    return torch.device("cpu")


def _kernel_choices(console: Console, backend, modes: list[str]) -> dict[str, KernelChoice | str]:
    """The kernel self-test per mode for the model's linear shapes (an error message for a mode where no
    kernel is usable).

    Raises:
        CliError: modes requested for a backend without a PyTorch module.
    """
    if not modes:
        return {}
    model = getattr(backend, "model", None)
    if not isinstance(model, torch.nn.Module):
        raise CliError("--kernels needs the PyTorch backend (the model's linear layer shapes)")
    shapes = model_linear_shapes(model)
    choices: dict[str, KernelChoice | str] = {}
    for mode in modes:
        console.print(f"kernel self-test, mode {mode}, {len(shapes)} layer shapes (cached after the first run) ...")
        try:
            choices[mode] = select_linear_kernel(mode, shapes)
        except KernelError as exc:
            choices[mode] = str(exc)
    return choices


def _fit_context(context: int, max_context: int, max_k: int) -> int:
    """The context length actually used: ``context`` lowered so that context + max_k fits the model."""
    fitted = min(context, max_context - max_k)
    if fitted < 1:
        raise CliError(f"the model's context of {max_context} tokens cannot hold {max_k} new tokens")
    return fitted


def _result_dict(args: argparse.Namespace, costs: ForwardCosts, draft_s: float | None) -> dict:
    result = {"model": args.model, "quantization": args.quantization, "repeats": args.repeats, **costs.to_dict()}
    if draft_s is not None:
        result.update(draft=args.draft, draft_1_token_s=draft_s, cost_ratio_c=draft_s / costs.seconds[1])
        thresholds = _stop_thresholds(costs, draft_s)
        if thresholds is not None:
            result["draft_stop_thresholds"] = list(thresholds)
    return result


def _stop_thresholds(costs: ForwardCosts, draft_s: float) -> tuple[float, ...] | None:
    """The per-depth path-probability thresholds ``draft_confidence_threshold: "auto"`` derives from these costs
    (:func:`draftwise.speculation.cost_model.draft_stop_thresholds`) for chains up to the longest measured pass - 1 tokens;
    None unless k = 1..n were all measured (n >= 3)."""
    n = max(costs.seconds)
    if n < 3 or sorted(costs.seconds) != list(range(1, n + 1)):
        return None
    return draft_stop_thresholds(CostModel.from_forward_costs(costs, draft_s), n - 1)


def _print_curve(console: Console, args: argparse.Namespace, costs: ForwardCosts, draft_s: float | None,
                 doubts: list[tuple[str, measurement.Doubt]] = ()) -> None:
    """The verify-cost table (a row per k, marked ``!`` with the codes of its doubts and of those of every
    row), the one-token line and the doubts' legend."""
    table = Table(title=f"{args.model} ({args.quantization}), context {costs.context_len} tokens, "
                        f"median of {args.repeats}")
    for column in ("!", "k", "forward ms", "v_k = t_k / t_1", "ms / token"):
        table.add_column(column, justify="right")
    everywhere = [d for what, d in doubts if what == "target"]
    for k, seconds in sorted(costs.seconds.items()):
        mark = measurement.marker(everywhere + [d for what, d in doubts if what == f"k={k}"])
        table.add_row(mark, str(k), f"{seconds * 1e3:.1f}", f"{costs.relative(k):.2f}", f"{seconds * 1e3 / k:.1f}")
    console.print(table)
    footnote = measurement.legend(d for _, d in doubts)
    if footnote:
        console.print(footnote, markup=False, highlight=False, soft_wrap=True)
    one = costs.seconds[1]
    line = f"one token: {one * 1e3:.1f} ms ({1 / one:.2f} tokens/s)"
    if draft_s is not None:
        line += f"; draft {args.draft}: {draft_s * 1e3:.1f} ms per token, c = {draft_s / one:.3f}"
    console.print(line)
    thresholds = None if draft_s is None else _stop_thresholds(costs, draft_s)
    if draft_s is not None and thresholds is None:
        console.print("draft confidence 'auto': its per-depth thresholds need every k = 1..n timed (n >= 3; "
                      "--ks 1,2,...,K+1 for chains of up to K tokens)", markup=False, highlight=False, soft_wrap=True)
    if thresholds:
        console.print(f"draft confidence 'auto' (the default), chains of up to K = {len(thresholds) + 1} tokens: "
                      "a chain of j tokens grows while its path probability is at least "
                      + ", ".join(f"{t:.2f}" for t in thresholds) + f" (j = 1..{len(thresholds)})"
                      + ("; 1 or more: chains stop there (a deeper draft token would cost more than it can save)"
                         if max(thresholds) >= 1 else ""), markup=False, highlight=False, soft_wrap=True)


def _print_machine(console: Console, machine: dict) -> None:
    console.print(f"CPU: {machine['cpu']}; torch threads {machine['torch_threads']}")
    memory = "DRAM" if machine["memory_device"] == "cpu" else f"{machine['memory_device'].upper()} memory"
    line = f"{memory} read bandwidth: {machine['memory_read_bytes_per_s'] / 1e9:.1f} GB/s"
    if machine["linear_weight_bytes"] is not None:
        line += (f"; linear weights {machine['linear_weight_bytes'] / 1e9:.3f} GB -> weight-streaming bound "
                 f"{machine['weight_bound_s'] * 1e3:.1f} ms per token; measured one token "
                 f"{machine['one_token_s'] * 1e3:.1f} ms ({machine['one_token_over_bound']:.2f}x the bound)")
    console.print(line)


def _print_kernels(console: Console, mode: str, choice: KernelChoice | str) -> None:
    if isinstance(choice, str):
        console.print(f"kernels, mode {mode}: {choice}")
        return
    source = "cached" if choice.cached else f"self-test {choice.selftest_seconds:.1f} s"
    table = Table(title=f"linear kernels, mode {mode}: ms of one forward pass's linear layers by rows m "
                        f"({choice.threads} threads, {source})")
    table.add_column("kernel (* chosen)", no_wrap=True)
    for column in ("invariant", *(f"m={m}" for m in TIMED_ROWS), "weighted", "GB"):
        table.add_column(column, justify="right")
    for row in choice.table_rows():
        invariant = {True: "yes", False: "NO", None: "?"}[row["invariant"]] if row["available"] else "n/a"
        ms = [("-" if row["ms"][m] is None else f"{row['ms'][m]:.1f}") for m in TIMED_ROWS]
        cost = "-" if row["cost_ms"] is None else f"{row['cost_ms']:.1f}"
        name = row["kernel"] + (" *" if row["chosen"] else "")
        table.add_row(name, invariant, *ms, cost, f"{row['weight_bytes'] / 1e9:.3f}")
    console.print(table, width=max(console.width, 110))
    console.print("invariant: ? = not checked (slower than a row-invariant kernel), n/a = cannot run here; "
                  "GB: stored weight bytes of one forward pass")
    console.print(f"chosen: {choice.reason}")
    for row in choice.table_rows():
        if row["invariant"] is not True:
            console.print(f"  {row['kernel']}: {row['detail']}")
