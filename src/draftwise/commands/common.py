"""Arguments shared by the subcommands that load models (vLLM's flag names where vLLM has them)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence

from draftwise.builder import DEMO_DRAFT, DEMO_TARGET
from draftwise.config import BACKENDS, SAMPLING_RULES, SamplingParams, SpeculativeConfig
from draftwise.methods import method_names

__all__ = ["add_model_args", "add_sampling_args", "speculative_config_from_args", "sampling_params_from_args",
           "CliError", "add_quantization_arg", "add_backend_arg", "add_speculative_backend_arg", "memory_size",
           "print_table", "check_device_args", "positive_int"]


class CliError(Exception):
    """A user error the CLI reports as one line (exit code 2), without a traceback."""


def memory_size(text: str) -> int:
    """argparse type for memory sizes: ``4GiB`` / ``512MB`` / ``0`` -> bytes."""
    from draftwise.units import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_model_args(parser: argparse.ArgumentParser, *, demo_default: bool = False) -> None:
    """--speculative-model, --speculative-backend, --num-speculative-tokens, --speculative-config, --device,
    --dtype, --max-model-len."""
    parser.add_argument("--speculative-model", "--draft", dest="speculative_model",
                        default=DEMO_DRAFT if demo_default else None,
                        help="draft model: registry name, .gguf file, HF directory or hub id"
                        + (f" (default: {DEMO_DRAFT}; 'none' for plain decoding)" if demo_default else ""))
    add_speculative_backend_arg(parser)
    parser.add_argument("--num-speculative-tokens", type=int, default=None,
                        help="K, the maximum number of draft tokens per verification (default 5)")
    parser.add_argument("--speculative-config", default=None,
                        help='JSON, as in vLLM: \'{"method": "draft_model", "model": "...", '
                        '"num_speculative_tokens": 4}\'; methods: ' + ", ".join(method_names()))
    parser.add_argument("--device", default=None,
                        help="cpu, cuda, cuda:N, mps or xpu (default: cuda when present); one this machine lacks is "
                        "an error before anything is loaded")
    parser.add_argument("--dtype", default=None,
                        help="fp32, bf16 or fp16 (default fp32; a draft model on a GPU bf16); one the device "
                        "cannot compute in is an error before anything is loaded")
    parser.add_argument("--max-model-len", type=positive_int, default=None,
                        help="context length in tokens (>= 1; at most the model's own, default: the model's own)")


def add_quantization_arg(parser: argparse.ArgumentParser) -> None:
    """--quantization {auto,none,int8,q4k}: pass ``args.quantization`` to ``load_model`` / ``build_engine`` (it applies
    to the target and a draft model alike; ``auto``, the default, resolves per model at load)."""
    from draftwise.backends.quantization import QUANTIZATION_CHOICES

    parser.add_argument("--quantization", choices=QUANTIZATION_CHOICES, default="auto",
                        help="int8: batch-invariant int8 linear layers on the CPU, so a k-token verify pass gives "
                        "the same logits as one-token decoding and costs about one token; none: float weights "
                        "(fp32 on the CPU: exact but slower, and verification costs grow with k); q4k: a GGUF's own "
                        "blocks (Q4_K, Q6_K, Q8_0, Q5_0) on draftwise's row-invariant kernels (compiled once per "
                        "machine; a float checkpoint is quantized to Q4_K), exact like int8 with fewer bytes "
                        "per token (docs/kernels.md); auto (default): on the CPU for architectures the lean runtime "
                        "implements (Llama, Qwen2, Mistral without sliding window) int8, or for a .gguf model q4k "
                        "where the kernel self-test measured it faster for the rows each target pass verifies (1 "
                        "plain, K+1 speculative; logged); none elsewhere (GPU, bf16/fp16, other architectures)")
    from draftwise.models.loading import RUNTIMES

    parser.add_argument("--runtime", choices=RUNTIMES, default="auto",
                        help="how PyTorch runs the models: lean (draftwise's own Llama-family decoder: preallocated KV "
                        "cache, batch-invariant by construction), transformers, cuda-graphs (transformers on a static "
                        "KV cache, short passes replayed from CUDA graphs; CUDA only), or auto (default: lean for int8 "
                        "and q4k on the CPU when the architecture is supported, cuda-graphs for a draft model on a GPU, "
                        "else transformers)")


def add_backend_arg(parser: argparse.ArgumentParser) -> None:
    """--backend {torch,llama.cpp,auto} and --threads: pass ``args.backend`` / ``args.threads`` to ``load_model`` /
    ``build_engine`` (for the target and a draft model alike; see ``draftwise.models.loading.select_backend``)."""
    from draftwise.models.loading import BACKENDS

    parser.add_argument("--backend", choices=BACKENDS, default="torch",
                        help="torch (default; GGUF files are dequantized to float), llama.cpp (GGUF files as they are, "
                        "on the CPU; needs llama-cpp-python) or auto (llama.cpp for .gguf files and registry names "
                        "when llama-cpp-python is installed and no PyTorch-only option is set)")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="llama.cpp CPU threads (default: every CPU this process may use)")


def add_speculative_backend_arg(parser: argparse.ArgumentParser) -> None:
    """--speculative-backend {torch,llama.cpp,auto}: the draft model's own backend (``args.speculative_backend``,
    the ``backend`` field of :class:`~draftwise.config.SpeculativeConfig`); default: the target's."""
    parser.add_argument("--speculative-backend", choices=BACKENDS, default=None,
                        help="backend of the draft model alone (methods draft_model and hybrid): llama.cpp runs a "
                        ".gguf draft with llama.cpp's quantized kernels beside a PyTorch target (e.g. --quantization "
                        "int8), with the same --threads; auto times one draft token on each runtime that can run the "
                        "draft here (a .gguf draft, a CPU target, llama-cpp-python installed; one sequence, also "
                        "for serve's batched engine, whose llama.cpp draft then holds --max-num-seqs sequences): "
                        "the lean PyTorch runtime, llama.cpp on the file, llama.cpp on two Q4_0 copies (the "
                        "layers only, and the layers and LM head; a copy is used only if it predicts the file's "
                        "next token at >= 90%% of a probe text's positions), and keeps the "
                        "fastest, cached per machine ($DRAFTWISE_HOME/draft_backends; the log says what was "
                        "measured). Draft trees (tree_width > 1) and an FR-Spec head keep the draft on the lean "
                        "runtime. The draft's token table must agree with the target's. Default: auto, or llama.cpp "
                        "for a --backend llama.cpp target")


def add_sampling_args(parser: argparse.ArgumentParser, *, max_tokens: int = 128) -> None:
    """--temperature, --top-p, --top-k, --seed, --sampling, --max-tokens, --ignore-eos."""
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0 disables top-k")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--sampling", choices=SAMPLING_RULES, default=None,
                        help="rule at temperature > 0: coupled (Gumbel-max keyed by seed and position: the same seed "
                        "gives the same text with or without speculation) or rejection (Leviathan et al.; can accept "
                        "more draft tokens). Default: coupled with --seed, else rejection")
    parser.add_argument("--max-tokens", type=int, default=max_tokens, help=f"new tokens (default {max_tokens})")
    parser.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS")


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    """Raises CliError on out-of-range values."""
    try:
        return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                              max_tokens=args.max_tokens, ignore_eos=args.ignore_eos,
                              sampling=getattr(args, "sampling", None))
    except ValueError as exc:
        raise CliError(str(exc)) from exc


def default_speculative_backend(args: argparse.Namespace) -> str | None:
    """``--speculative-backend`` as given, else the command line's default for a draft model: ``"auto"`` (the
    runtime that decodes the draft fastest on this machine, measured once and cached; see
    :func:`draftwise.builder.load_draft_model`), or None (like the target) for a target on llama.cpp
    (``--backend llama.cpp``), whose draft runs there too. The library's own default stays "like the target"."""
    given = getattr(args, "speculative_backend", None)
    if given is not None:
        return given
    return None if getattr(args, "backend", None) == "llama.cpp" else "auto"


def speculative_config_from_args(args: argparse.Namespace) -> SpeculativeConfig | None:
    """Merge --speculative-config JSON with --speculative-model / --speculative-backend /
    --num-speculative-tokens (flags win).

    Returns None for plain decoding. Raises CliError on invalid JSON, an invalid configuration, or
    --speculative-backend without a draft model.
    """
    fields: dict = {}
    if args.speculative_config:
        try:
            fields = json.loads(args.speculative_config)
        except json.JSONDecodeError as exc:
            raise CliError(f"--speculative-config is not valid JSON: {exc}") from exc
        if not isinstance(fields, dict):
            raise CliError("--speculative-config must be a JSON object")
        unknown = sorted(set(fields) - {spec.name for spec in dataclasses.fields(SpeculativeConfig)})
        if unknown:
            raise CliError(f"unknown field(s) in --speculative-config: {', '.join(unknown)}")
    model = args.speculative_model
    if model and model.lower() != "none":
        fields["model"] = model
        fields.setdefault("method", "draft_model")
    if args.num_speculative_tokens is not None:
        fields["num_speculative_tokens"] = args.num_speculative_tokens
    draft_backend = getattr(args, "speculative_backend", None)
    if draft_backend is not None:
        fields["backend"] = draft_backend
    method_given = "method" in fields
    if not fields.get("model") and fields.get("method", "draft_model") in ("draft_model", None) and \
            (not method_given or (model and model.lower() == "none")):
        if fields.get("backend") is not None:
            raise CliError("--speculative-backend (speculative config 'backend') sets the draft model's backend: "
                           "name a draft with --speculative-model")
        return None  # no draft named: plain decoding (an explicit draft_model without a model is an error below)
    if fields.get("method") in ("draft", "draft_model", None):
        fields["method"] = "draft_model"
    if "backend" not in fields and fields["method"] in ("draft_model", "hybrid"):
        fields["backend"] = default_speculative_backend(args)
    try:
        return SpeculativeConfig(**fields)
    except ValueError as exc:
        raise CliError(str(exc)) from exc


def check_device_args(args: argparse.Namespace, *, dtype: bool = True) -> None:
    """Refuse a ``--device`` this machine lacks (no CUDA, ``cuda:3`` with two GPUs, ``mps`` off Apple
    silicon, an unknown name) and, with ``dtype``, a ``--dtype`` that is unknown or that the device cannot compute
    in. Call it first in a command that loads models: nothing has been read yet when it fails.

    Raises:
        CliError: the flag and what is wrong with its value.
    """
    from draftwise.backends.devices import check_device, check_dtype

    try:
        device = check_device(args.device)
    except ValueError as exc:
        raise CliError(f"--device: {exc}") from None
    if not dtype:
        return
    try:
        check_dtype(args.dtype, device)
    except ValueError as exc:
        raise CliError(f"--dtype: {exc}") from None


def default_target(value: str | None) -> str:
    """The demo target when no model is named."""
    return value or DEMO_TARGET


def print_table(console, title: str, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Print a result table readable at any width.

    On a terminal wide enough for every cell: a rich table. Anywhere else (a pipe, a file, CI logs, where
    rich assumes 80 columns and would cut every column to a few letters, or a narrow terminal): the title and a
    plain Markdown table, one line per row, never cut (a terminal may wrap its lines).

    Args:
        console: a ``rich.console.Console``.
        columns: column names; rows: one sequence of cell strings per row (same length as ``columns``).
    """
    from rich.markup import escape
    from rich.measure import Measurement
    from rich.table import Table

    from draftwise.report import markdown_table

    lines = markdown_table(columns, rows)  # validates the row lengths
    if console.is_terminal:
        table = Table(title=title)
        for column in columns:
            table.add_column(escape(column), no_wrap=True)
        for row in rows:
            table.add_row(*[escape(str(cell)) for cell in row])
        unbounded = console.options.update(max_width=1_000_000)
        if Measurement.get(console, unbounded, table).maximum <= console.width:
            console.print(table)
            return
    console.print("\n".join([title, ""] + lines + [""]), markup=False, highlight=False, soft_wrap=True)
