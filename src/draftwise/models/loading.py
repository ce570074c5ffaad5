"""Loading target and draft models: local Hugging Face directories, hub ids, ``.gguf`` files and the names
of the models ``draftwise pull`` installs.

GGUF files are dequantized by ``transformers`` (``gguf_file=``), which takes minutes for a 1.5B model; the
result is cached once as safetensors under ``$DRAFTWISE_HOME/dequantized/`` so the next load takes seconds.
With ``backend="llama.cpp"`` (or ``"auto"``, see :func:`select_backend`) GGUF files run as they are in llama.cpp
(:mod:`draftwise.backends.llama_cpp_backend`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from draftwise import progress
from draftwise.backends.base import CausalLM
from draftwise.backends.devices import check_device, check_dtype, parse_dtype
from draftwise.backends.torch_backend import TorchCausalLM, default_attention
from draftwise.config import BACKENDS  # values of ``load_model(backend=...)`` and ``--backend``
from draftwise.models.gguf_tokenizer import gguf_metadata, tokenizer_from_gguf_vocab
from draftwise.files import draftwise_home
from draftwise.models.pull import MODEL_REGISTRY, is_pulled, model_path
from draftwise.backends.quantization import int8_usable, parse_quantization, quantize_model

if TYPE_CHECKING:
    from draftwise.frspec import HeadSubset

__all__ = ["RANDOM_PREFIX", "check_model_source", "randomize_weights", "LoadedModel", "ModelLoadError", "load_model",
           "load_tokenizer", "resolve_model", "select_backend", "select_runtime", "dequantized_cache_dir", "BACKENDS",
           "RUNTIMES"]

#: ``load_model("random:SPEC")``: SPEC's architecture and tokenizer with random weights.
RANDOM_PREFIX = "random:"

#: Values of ``load_model(runtime=...)`` and ``--runtime``: how the PyTorch backend runs a model.
RUNTIMES = ("lean", "transformers", "cuda-graphs", "auto")

logger = logging.getLogger(__name__)


class ModelLoadError(RuntimeError):
    """A model could not be found or loaded; the message says what to do."""


@dataclass
class LoadedModel:
    """A backend plus its tokenizer.

    Attributes:
        backend: the :class:`CausalLM` the engine drives.
        tokenizer: a ``transformers`` tokenizer (ids match the model's embedding rows).
        name: what the user asked for (registry name, path or hub id).
        eos_token_ids: ids that end generation (tokenizer EOS plus generation-config EOS ids).
        quantization: the mode the weights run in (``"none"``, ``"int8"``, ``"q4k"``; ``"gguf"`` on llama.cpp),
            after ``"auto"`` was resolved.
        runtime_choice: for a draft whose runtime was measured (``--speculative-backend auto``), the line that
            says what was measured and chosen (:class:`draftwise.draft_backend.DraftBackendChoice`); else None.
    """

    backend: CausalLM
    tokenizer: object
    name: str
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    quantization: str = "none"
    runtime_choice: str | None = None

    @property
    def has_chat_template(self) -> bool:
        """True when the tokenizer carries a chat template (instruct models)."""
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        """Tokenize plain text (with the tokenizer's usual BOS handling)."""
        return list(self.tokenizer.encode(text))

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Apply the model's chat template to ``[{"role", "content"}, ...]`` (and ``tools``, OpenAI's function
        tools, which the template writes into the prompt) with the generation prompt.

        Raises:
            ValueError: if the model has no chat template.
        """
        if not self.has_chat_template:
            raise ValueError(f"{self.name} has no chat template; send a plain prompt instead")
        ids = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def decode(self, token_ids: list[int]) -> str:
        """Detokenize, dropping special tokens."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)


def resolve_model(spec: str) -> str:
    """Map a registry name (``qwen2.5-coder-1.5b`` ...) to its pulled file; return paths/hub ids unchanged.

    Raises:
        ModelLoadError: a registry name whose file has not been pulled yet.
    """
    if spec in MODEL_REGISTRY:
        if not is_pulled(spec):
            raise ModelLoadError(f"model {spec!r} is not installed; run: draftwise pull {spec}")
        return str(model_path(spec))
    return spec


def load_model(
    spec: str,
    *,
    device: str | None = None,
    dtype: str | torch.dtype | None = None,
    max_context: int | None = None,
    attn_implementation: str | None = None,
    quantization: str | None = None,
    backend: str = "torch",
    threads: int | None = None,
    runtime: str = "auto",
    head_subset: HeadSubset | None = None,
    num_slots: int = 1,
    drafting: bool = False,
    rows_per_pass: int = 1,
) -> LoadedModel:
    """Load a causal LM and its tokenizer, for the PyTorch backend or (GGUF files) the llama.cpp backend.

    Args:
        spec: a registry name (see ``draftwise pull``), a ``.gguf`` file, a local Hugging Face directory or
            a hub id (needs a reachable hub). ``random:SPEC`` loads SPEC's architecture and tokenizer with
            random weights (PyTorch backend only): a deliberately mismatched draft for benchmarks and tests; for
            a directory, ``config.json`` and the tokenizer files are enough (no weight files needed).
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``...; default: CUDA when present.
        dtype: ``"fp32"``, ``"bf16"``, ``"fp16"``; default: fp32, and bf16 for a draft (``drafting``) on a GPU
            (a target in bf16/fp16 on transformers' kernels is not row-invariant: a warning says so).
        max_context: context length in tokens (default: the model config's).
        attn_implementation: transformers attention kernel (default: see ``default_attention``).
        quantization: ``"none"`` (default), ``"int8"``: batch-invariant int8 linear layers and row-wise
            attention on the CPU (see :mod:`draftwise.backends.quantization`), applied after loading; the backend's
            name then ends in ``+int8`` (so calibration caches keep the two apart); ``"q4k"``: a GGUF file's own
            blocks on draftwise's row-invariant C++ kernels (docs/kernels.md); or ``"auto"``: the exact mode measured
            fastest here for ``rows_per_pass``-row passes (:func:`resolve_quantization`).
        backend: ``"torch"`` (default), ``"llama.cpp"`` or ``"auto"``; see :func:`select_backend` for the rule.
        threads: llama.cpp only: CPU threads (default: every CPU this process may use).
        runtime: PyTorch backend only: ``"lean"`` (draftwise's own Llama-family decoder,
            :mod:`draftwise.backends.lean`: preallocated KV cache, batch-invariant by construction),
            ``"transformers"`` (the model as transformers runs it), ``"auto"`` (default; see
            :func:`select_runtime`), ``"cuda-graphs"`` (transformers' model on a static KV cache whose short
            passes replay CUDA graphs, :mod:`draftwise.backends.cuda_graphs`; CUDA only; ``"auto"`` picks it for a
            draft on a GPU). The lean backend's name ends in ``+lean``, the graphed one's in ``+graphs``.
        head_subset: PyTorch backend only: compute the LM head over a frequency-ranked subset of the
            vocabulary (FR-Spec, for draft models; :mod:`draftwise.frspec`), applied before quantization;
            the backend's name then ends in ``+fr<kept ids>``. With ``backend="auto"`` it selects PyTorch.
        num_slots: sequences the KV cache holds (the batched engine, :mod:`draftwise.engine.core`, runs one
            request per slot): on the lean runtime, and on llama.cpp for a draft (``drafting``); other backends
            hold one sequence.
        drafting: the model is a draft, whose numerics need not be batch-invariant (only the target's decide
            the output): on llama.cpp it then runs llama.cpp's native kernels (repacked weights, one-token
            passes, prefill passes of up to 512 tokens; see :mod:`draftwise.backends.llama_cpp_backend`). The
            PyTorch backends differ only in the default dtype (bf16 for a draft on a GPU).
        rows_per_pass: rows the model's passes will mostly hold (1, the default: plain decoding, and a draft;
            K + 1 for a speculative target verifying K draft tokens:
            :func:`draftwise.models.auto_quantization.target_rows_per_pass`); ``quantization="auto"`` picks the
            mode measured fastest for passes of that size (:func:`resolve_quantization`).

    Raises:
        ModelLoadError: missing file, unreadable model, a registry model that is not pulled, or the llama.cpp
            backend asked for a non-GGUF model or without llama-cpp-python installed.
        DeviceError: (a ValueError) a device this machine lacks, or a dtype it cannot compute in (checked
            before the model is read; see :mod:`draftwise.backends.devices`).
        ValueError: an unknown dtype, quantization mode or backend, int8 off the CPU / without fbgemm kernels, a
            PyTorch-only option (CUDA device, dtype, int8, a head subset) given to the llama.cpp backend, or a
            token map that does not fit the model.
        FileNotFoundError: a head subset's token map file is missing.
    """
    quantization = parse_quantization(quantization)
    if max_context is not None and max_context < 1:
        raise ValueError(f"max_context (--max-model-len) must be >= 1, got {max_context}")
    if device is not None or dtype is not None:  # before anything is read: a missing device is no traceback
        check_dtype(dtype, check_device(device))
    if head_subset is not None and backend == "llama.cpp":
        raise ValueError(f"{spec!r}: a draft vocabulary subset (draft_vocab_size / token_map) needs the PyTorch "
                         "backend (--speculative-backend torch, or auto); llama.cpp computes its LM head itself")
    if head_subset is not None and backend == "auto":
        backend = "torch"  # the subset head is a PyTorch module
    randomize = spec.startswith(RANDOM_PREFIX)
    path = resolve_model(spec[len(RANDOM_PREFIX):] if randomize else spec)
    if randomize and backend == "llama.cpp":
        raise ValueError(f"{spec!r}: random weights need the PyTorch backend")
    if not randomize and select_backend(backend, path, device=device, dtype=dtype, quantization=quantization) == "llama.cpp":
        return _load_llama_cpp(spec, path, max_context=max_context, threads=threads, exact=not drafting,
                               num_slots=num_slots if drafting else 1)
    device = check_device(device)
    if runtime == "cuda-graphs" and not device.startswith("cuda"):
        raise ValueError(f"{spec!r}: the cuda-graphs runtime needs a CUDA device (got {device!r})")
    torch_dtype = parse_dtype(dtype, device, drafting=drafting)
    attention = attn_implementation or default_attention(device)
    try:
        if path.endswith(".gguf"):
            model_dir = _dequantized_dir(Path(path), label=spec)
            progress.report("loading the weights", model=spec)
            model, tokenizer = _load_hf_dir(model_dir, torch_dtype, attention)
        elif Path(path).is_dir() and randomize and not _has_weight_files(Path(path)):
            progress.report("building the architecture (random weights)", model=spec)
            model, tokenizer = _load_hf_architecture(Path(path), torch_dtype, attention)
        elif Path(path).is_dir():
            progress.report("loading the weights", model=spec)
            model, tokenizer = _load_hf_dir(Path(path), torch_dtype, attention)
        elif _looks_local(path):
            raise _not_found(path)
        else:
            progress.report("loading the weights", model=spec)
            model, tokenizer = _load_hf_dir(path, torch_dtype, attention)  # hub id
    except ModelLoadError:
        raise
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"could not load model {spec!r}: {exc}") from exc
    model.to(device)
    if randomize:
        randomize_weights(model)
    eos_ids = _eos_ids(model, tokenizer)
    _warn_past_trained_context(max_context, model.config, spec)
    quantization = resolve_quantization(quantization, device=device, dtype=torch_dtype, config=model.config, name=spec,
                                        source=None if randomize else path, rows_per_pass=rows_per_pass)
    name = spec if quantization == "none" else f"{spec}+{quantization}"
    head_ids = None
    if head_subset is not None:
        head_ids = _head_subset_ids(model, head_subset, tokenizer, eos_ids, name)
        if head_ids is not None:
            name = f"{name}+fr{len(head_ids)}"
    if select_runtime(runtime, model, device=device, dtype=torch_dtype, quantization=quantization) == "lean":
        from draftwise.backends.lean import NotExactError, build_lean

        try:
            lean = build_lean(model, quantization=quantization, name=f"{name}+lean", max_context=max_context,
                              head_ids=head_ids, select_kernels=True, num_slots=num_slots,
                              q4k_source=_q4k_source(path, quantization, label=spec))
        except NotExactError:
            if runtime == "lean":
                raise
            logger.warning("the lean runtime is not exact on this machine; running %s with transformers", spec)
        else:
            del model  # the lean decoder holds its own copies of the weights
            return LoadedModel(backend=lean, tokenizer=tokenizer, name=spec, eos_token_ids=eos_ids,
                               quantization=quantization)
    if head_ids is not None:
        _restrict_head(model, head_ids, quantization, name)
    if quantization != "none":
        progress.report(f"quantizing the linear layers ({quantization})", model=spec)
    if quantization == "q4k":
        from draftwise.backends.kernels.gguf_source import Q4KKernel

        quantize_model(model, quantization, kernel=Q4KKernel(_q4k_source(path, quantization, label=spec)))
    else:
        quantize_model(model, quantization)
    if not drafting:
        _warn_inexact_dtype(torch_dtype, spec)
    backend = _transformers_backend(model, name, max_context, runtime=runtime, device=device, drafting=drafting)
    return LoadedModel(backend=backend, tokenizer=tokenizer, name=spec, eos_token_ids=eos_ids,
                       quantization=quantization)


def _transformers_backend(model, name: str, max_context: int | None, *, runtime: str, device: str,
                          drafting: bool) -> TorchCausalLM:
    """The backend a transformers model runs on: :class:`~draftwise.backends.cuda_graphs.GraphedCausalLM` (a
    static KV cache, short passes replayed from CUDA graphs) for ``runtime="cuda-graphs"``, and for a draft on a
    GPU with ``"auto"`` when the model allows it (its numerics never change the output, and eager passes cost a
    0.5B draft as much as a 1.5B target there: docs/gpu.md); else :class:`TorchCausalLM`.

    ``"cuda-graphs"`` off CUDA is refused by :func:`load_model` before the weights are read.

    Raises:
        ValueError: ``"cuda-graphs"`` for a model with a sliding window or no static cache.
    """
    from draftwise.backends.cuda_graphs import GraphedCausalLM, graph_obstacles

    if runtime == "cuda-graphs":
        if not drafting:
            logger.warning("%s: a target on the cuda-graphs runtime (a mask over a static cache) is not checked to "
                           "round its logits like plain decoding's passes; scripts/bench/gpu_check.py measures it", name)
        return GraphedCausalLM(model, name=f"{name}+graphs", max_context=max_context)
    if runtime == "auto" and drafting and str(device).startswith("cuda"):
        reasons = graph_obstacles(model)
        if not reasons:
            logger.info("%s: draft on the cuda-graphs runtime (static KV cache, CUDA graphs)", name)
            return GraphedCausalLM(model, name=f"{name}+graphs", max_context=max_context)
        logger.info("%s: draft runs eagerly (no CUDA graphs: %s)", name, "; ".join(reasons))
    return TorchCausalLM(model, name=name, max_context=max_context)


def _warn_inexact_dtype(dtype: torch.dtype, name: str) -> None:
    """Log a warning for a target on transformers' kernels in bf16/fp16: they are not row-invariant, so a
    speculative verify pass may round a token's logits differently from plain decoding's one-token pass
    (measured on an H200: see :func:`draftwise.backends.torch_backend.default_dtype`)."""
    if dtype in (torch.bfloat16, torch.float16):
        logger.warning("%s runs in %s on kernels that are not row-invariant: as the target of speculative decoding "
                       "its output can differ from its own plain decoding where the top logits nearly tie (fp32 "
                       "matched plain decoding in every measurement; docs/gpu.md)", name,
                       str(dtype).removeprefix("torch."))


def _warn_past_trained_context(max_context: int | None, config, name: str) -> None:
    """Log a warning for a requested context length past the model's trained positions (positions it never
    saw: the text may degrade)."""
    if max_context is None:
        return
    trained = getattr(config, "max_position_embeddings", None)
    if trained and max_context > trained:
        logger.warning("%s: --max-model-len %d exceeds the %d positions the model was trained on; text past them "
                       "may degrade", name, max_context, trained)


def lean_obstacles(config, *, device: str, dtype: torch.dtype) -> list[str]:
    """Why the lean runtime cannot run a model with this transformers ``config`` (None: the architecture is not
    checked) on ``device`` in ``dtype``; empty when it can."""
    from draftwise.backends.lean.model import UnsupportedArchitecture, lean_config_from_hf

    reasons = []
    if not str(device).startswith("cpu"):
        reasons.append(f"device {device!r} (the lean runtime runs on the CPU)")
    if dtype != torch.float32:
        reasons.append(f"dtype {dtype} (the lean runtime computes in fp32)")
    if config is not None:
        try:
            lean_config_from_hf(config)
        except UnsupportedArchitecture as exc:
            reasons.append(str(exc))
    return reasons


def resolve_quantization(quantization: str, *, device: str, dtype: torch.dtype, config=None, name: str = "model",
                         source: str | None = None, rows_per_pass: int = 1) -> str:
    """The quantization mode a model runs with: ``"none"``, ``"int8"`` and ``"q4k"`` as given; ``"auto"`` (the
    CLI's default) the fastest exact mode for this model and machine.

    ``"auto"`` gives ``"none"`` where the lean runtime cannot run the model on the CPU or int8 cannot run (a
    GPU, bf16/fp16, an architecture only transformers runs, a CPU without fbgemm). Elsewhere the candidates are
    ``"int8"`` (the exact configuration where verifying k tokens costs about one: docs/lean_runtime.md) and, for a
    ``.gguf`` ``source`` whose layer widths Q4_K serves and whose kernels build here
    (:func:`draftwise.models.auto_quantization.q4k_obstacle`), ``"q4k"`` (the file's own blocks); a float
    checkpoint stays on int8 without measuring (q4k would re-quantize it to 4 bits). With both, the kernel
    self-test's linear-layer time of one ``rows_per_pass``-row pass decides (cached per machine; the first load
    runs the self-test, seconds to a minute: :mod:`draftwise.models.auto_quantization`). A candidate that cannot
    be measured is dropped, with the reason in the log; when none can be, int8. The choice, the measured per-pass
    milliseconds and the rows per pass are logged at INFO as one line, ``NAME: quantization auto -> MODE (...)``.

    Args:
        quantization: ``"auto"``, or a mode, returned as it is.
        device, dtype: where and in what the model computes.
        config: the transformers config (None: the architecture is not checked, nothing is measured: int8).
        name: the model's name in the log line.
        source: the model's file or directory (a ``.gguf`` file makes q4k a candidate); None: not a GGUF.
        rows_per_pass: rows of the passes to size the choice for (>= 1): 1 for plain decoding and drafts, K + 1
            for a speculative target (:func:`draftwise.models.auto_quantization.target_rows_per_pass`).

    Raises:
        ValueError: ``rows_per_pass`` < 1 with ``"auto"``. Measuring never raises: a failure drops the candidate.
    """
    if quantization != "auto":
        return quantization
    if rows_per_pass < 1:
        raise ValueError(f"rows_per_pass must be >= 1, got {rows_per_pass}")
    reasons = lean_obstacles(config, device=device, dtype=dtype)
    if not int8_usable():
        reasons.append("no fbgemm int8 kernels in this torch build")
    if reasons:
        logger.info("%s: quantization auto -> none (%s)", name, "; ".join(reasons))
        return "none"
    from draftwise.backends.lean.model import lean_config_from_hf
    from draftwise.models.auto_quantization import q4k_obstacle

    lean_config = None if config is None else lean_config_from_hf(config)  # lean_obstacles checked that it reads
    missing = q4k_obstacle(source, lean_config)
    if missing is not None:
        logger.info("%s: quantization auto -> int8 (the fastest exact mode on this CPU; q4k not a candidate: %s; "
                    "--quantization none for fp32)", name, missing)
        return "int8"
    return _measured_choice(name, lean_config, rows_per_pass)


def _measured_choice(name: str, lean_config, rows_per_pass: int) -> str:
    """``auto`` between int8 and q4k by the kernel self-test at ``rows_per_pass`` rows, logged."""
    from draftwise.models.auto_quantization import choose_quantization, measure_mode

    progress.report("choosing the quantization mode (kernel self-test: measured once per machine, then cached)",
                    model=name)
    choice = choose_quantization([measure_mode(mode, lean_config) for mode in ("int8", "q4k")], rows_per_pass)
    logger.info("%s: quantization auto -> %s (%s)", name, choice.mode, choice.describe())
    return choice.mode


def select_runtime(runtime: str, model, *, device: str, dtype: torch.dtype, quantization: str) -> str:
    """``"lean"`` or ``"transformers"``: which runtime runs a loaded PyTorch model (``"cuda-graphs"`` is
    transformers' model on a static cache: :func:`_transformers_backend`).

    ``"auto"`` picks the lean decoder for the exact CPU path (int8, a supported Llama-family architecture,
    fp32 activations on the CPU), and transformers otherwise; ``"lean"`` insists on it.

    Raises:
        ValueError: an unknown runtime, or ``"lean"`` for a model or setting it does not cover.
    """
    if runtime not in RUNTIMES:
        raise ValueError(f"unknown runtime {runtime!r}; choose one of {', '.join(RUNTIMES)}")
    if runtime in ("transformers", "cuda-graphs"):  # cuda-graphs: transformers' model on a static cache
        return "transformers"
    reasons = lean_obstacles(model.config, device=device, dtype=dtype)
    if runtime == "lean":
        if reasons:
            raise ValueError(f"the lean runtime cannot run this model: {'; '.join(reasons)}")
        return "lean"
    return "lean" if not reasons and quantization in ("int8", "q4k") else "transformers"


def _q4k_source(path: str, quantization: str, *, label: str):
    """The quantized rows of a ``.gguf`` file for the ``q4k`` mode (Q4_K, Q6_K, Q8_0, Q5_0: the file's weights,
    regrouped for the kernels), else None."""
    if quantization != "q4k" or not str(path).endswith(".gguf"):
        return None
    from draftwise.backends.kernels.gguf_source import GGUFSource

    progress.report("reading the GGUF's quantized blocks", model=label)
    return GGUFSource(path)


def _head_subset_ids(model, head_subset: HeadSubset, tokenizer, eos_ids, name: str) -> list[int] | None:
    """FR-Spec: the LM head rows a head subset keeps, or None when it covers the whole vocabulary."""
    ids = head_subset.resolve(tokenizer, eos_ids, int(model.get_output_embeddings().weight.shape[0]))
    if ids is None:
        logger.info("FR-Spec: the requested subset covers %s's whole vocabulary; the LM head is left full", name)
    return ids


def _restrict_head(model, ids: list[int], quantization: str, name: str) -> None:
    """FR-Spec on a transformers model: restrict the float LM head to ``ids`` (quantized afterwards like any
    linear layer)."""
    from draftwise.frspec import head_nbytes, log_restriction, restrict_lm_head

    full_head = model.get_output_embeddings()
    rows, hidden = (int(d) for d in full_head.weight.shape)
    # the full head's bytes as it would be stored: int8 weights plus a float32 scale per row, or float
    before = rows * (hidden + 4) if quantization == "int8" else head_nbytes(full_head)
    subset = restrict_lm_head(model, ids)
    log_restriction(name, subset, before)


def select_backend(backend: str, path: str, *, device: str | None = None, dtype=None,
                   quantization: str | None = None) -> str:
    """The backend that loads ``path`` (a resolved spec): ``"torch"`` or ``"llama.cpp"``.

    The rule: llama.cpp runs a model only when asked. ``"llama.cpp"`` selects it (and needs a ``.gguf`` file,
    which registry names are); ``"auto"`` selects it for a ``.gguf`` file (path or registry name) when
    llama-cpp-python is importable and no PyTorch-only option is set (a CUDA device, a dtype, int8
    quantization), and PyTorch otherwise; ``"torch"`` (the default) always selects PyTorch, which dequantizes
    GGUF files to float.

    Raises:
        ValueError: an unknown backend, or a PyTorch-only option with ``"llama.cpp"``.
        ModelLoadError: ``"llama.cpp"`` for a non-GGUF model, or without llama-cpp-python.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "torch":
        return "torch"
    from draftwise.backends.llama_cpp_backend import INSTALL_HINT, llama_cpp_available

    is_gguf = str(path).endswith(".gguf")
    torch_only = _torch_only_options(device, dtype, quantization)
    if backend == "auto":
        return "llama.cpp" if is_gguf and not torch_only and llama_cpp_available() else "torch"
    if torch_only:
        raise ValueError(f"the llama.cpp backend runs GGUF files on the CPU as they are; {', '.join(torch_only)} "
                         "only apply to --backend torch")
    if not is_gguf:
        raise ModelLoadError(f"the llama.cpp backend needs a .gguf file or a registry name, got {path!r}")
    if not llama_cpp_available():
        raise ModelLoadError(f"the llama.cpp backend needs llama-cpp-python; {INSTALL_HINT}")
    return "llama.cpp"


def _torch_only_options(device: str | None, dtype, quantization: str | None) -> list[str]:
    found = []
    if device and device != "cpu":
        found.append(f"device {device!r}")
    if dtype not in (None, "auto"):
        found.append(f"dtype {dtype!r}")
    if quantization not in (None, "none", "auto"):
        found.append(f"quantization {quantization!r}")
    return found


def _load_llama_cpp(spec: str, path: str, *, max_context: int | None, threads: int | None,
                    exact: bool = True, num_slots: int = 1) -> LoadedModel:
    from draftwise.backends.llama_cpp_backend import load_llama_cpp

    if not Path(path).is_file():
        raise ModelLoadError(f"GGUF file not found: {path}")
    progress.report("loading with llama.cpp", model=spec)
    try:
        backend, tokenizer, eos_ids = load_llama_cpp(path, name=spec, max_context=max_context, n_threads=threads,
                                                     batch_invariant=exact, num_slots=num_slots)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"could not load model {spec!r} with llama.cpp: {exc}") from exc
    return LoadedModel(backend=backend, tokenizer=tokenizer, name=spec, eos_token_ids=eos_ids, quantization="gguf")


def check_model_source(spec: str) -> None:
    """Refuse, before anything is read, a model that cannot be loaded: a registry name not pulled, or a local
    path (``.gguf`` file, model directory) that does not exist. Hub ids and ``random:`` specs pass (their
    checks need the hub or the architecture). Cheap: it only looks at the file system.

    Raises:
        ModelLoadError: the registry model is not pulled, or the file or directory is missing.
    """
    path = resolve_model(spec[len(RANDOM_PREFIX):] if spec.startswith(RANDOM_PREFIX) else spec)
    if path.endswith(".gguf") and not Path(path).is_file():
        raise ModelLoadError(f"GGUF file not found: {path}")
    if _looks_local(path) and not Path(path).exists():
        raise _not_found(path)


def _not_found(path: str) -> ModelLoadError:
    """The error for a local path that is no model: missing, or a file of another kind."""
    if Path(path).is_file():
        return ModelLoadError(f"not a model: {path} (expected a .gguf file, a model directory or a hub id)")
    return ModelLoadError(f"model not found: {path}")


def _looks_local(spec: str) -> bool:
    """A path the user meant as a local file (absolute, relative or home-based); hub ids look like
    ``org/name`` and may contain dots (``Qwen/Qwen2.5-0.5B``)."""
    return spec.startswith(("/", "./", "../", "~")) or spec.endswith((".gguf", ".safetensors", ".bin"))


def _load_hf_dir(source: Path | str, torch_dtype: torch.dtype, attention: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch_dtype, attn_implementation=attention)
    tokenizer = AutoTokenizer.from_pretrained(str(source))
    return model.eval(), tokenizer


def _has_weight_files(directory: Path) -> bool:
    """Whether a Hugging Face directory holds weights (safetensors or PyTorch ``.bin`` files)."""
    return any(directory.glob("*.safetensors")) or any(directory.glob("*.bin"))


def _load_hf_architecture(directory: Path, torch_dtype: torch.dtype, attention: str):
    """A model built from ``directory``'s ``config.json`` alone (no weight files: ``random:DIR``, whose weights
    are drawn anyway), with the directory's tokenizer: a model of a real architecture's shapes from a few MB of
    files, e.g. carried to a machine that cannot hold the checkpoint."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(str(directory))
    model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype, attn_implementation=attention)
    return model.eval(), AutoTokenizer.from_pretrained(str(directory))


def _eos_ids(model, tokenizer) -> tuple[int, ...]:
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if gen_eos is not None:
        ids.update(int(t) for t in (gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos]))
    return tuple(sorted(ids))


def _cache_key(path: Path) -> str:
    stat = path.stat()
    digest = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return f"{path.stem}-{digest}"


def dequantized_cache_dir() -> Path:
    """``draftwise_home()/dequantized``: safetensors copies of GGUF models (not created here)."""
    return draftwise_home() / "dequantized"


def _dequantized_dir(path: Path, label: str | None = None) -> Path:
    """Return a safetensors copy of a GGUF model, creating it (atomically) on first use (progress reported
    under ``label``, default the path)."""
    if not path.is_file():
        raise ModelLoadError(f"GGUF file not found: {path}")
    target = dequantized_cache_dir() / _cache_key(path)
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("dequantizing %s once into %s (this takes a while for large models)", path, target)
    label = label or str(path)
    size = path.stat().st_size
    amount = f"{size / 1e9:.2f} GB" if size >= 1e9 else f"{size / 1e6:.1f} MB"
    progress.report(f"dequantizing GGUF ({amount}, once: cached afterwards; transformers shows the tensors)",
                    model=label)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=target.parent))
    try:
        model, tokenizer = _load_gguf(path)
        _forget_gguf_quantization(model)
        progress.report("saving the dequantized copy", model=label)
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def _forget_gguf_quantization(model) -> None:
    """The GGUF loader dequantizes to float but tags the model as GGUF-quantized, which blocks
    ``save_pretrained``; the weights are plain tensors, so drop the tag."""
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    for attr in ("hf_quantizer", "quantization_method"):
        if getattr(model, attr, None) is not None:
            setattr(model, attr, None)
    if getattr(model, "is_quantized", False):
        model.is_quantized = False


def _load_gguf(path: Path):
    """Dequantize a GGUF file with transformers (fp32) and build its tokenizer with its chat template."""
    from transformers import AutoModelForCausalLM

    meta = gguf_metadata(
        path, ("tokenizer.ggml.padding_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.chat_template",
               "tokenizer.ggml.tokens")
    )
    vocab = len(meta.get("tokenizer.ggml.tokens") or [])
    overrides = {}
    pad = meta.get("tokenizer.ggml.padding_token_id")
    if pad is not None and vocab and not (0 <= int(pad) < vocab):
        overrides["pad_token_id"] = int(meta.get("tokenizer.ggml.eos_token_id", 0))
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, **overrides
    )
    return model.eval(), _gguf_tokenizer(path, meta.get("tokenizer.chat_template"))


def _gguf_tokenizer(path: Path, template: str | None):
    """A GGUF file's tokenizer (transformers' conversion, else built from the token table) with its chat
    template."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:  # transformers' GGUF tokenizer conversion fails on some vocabularies
        logger.info("transformers could not convert the GGUF tokenizer (%s); building it from the token table", exc)
        tokenizer = tokenizer_from_gguf_vocab(path)
    if template and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = str(template)
    if tokenizer.pad_token_id is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_tokenizer(spec: str):
    """The tokenizer :func:`load_model` would load for ``spec`` (registry name, ``.gguf`` file, Hugging Face
    directory or hub id), without loading the weights: a GGUF file's dequantized copy when it exists, else
    the tokenizer converted from the file.

    Raises:
        ModelLoadError: a missing file, a registry model not pulled, or an unreadable tokenizer.
    """
    from transformers import AutoTokenizer

    path = resolve_model(spec)
    try:
        if path.endswith(".gguf"):
            gguf = Path(path)
            if not gguf.is_file():
                raise ModelLoadError(f"GGUF file not found: {gguf}")
            copy = dequantized_cache_dir() / _cache_key(gguf)
            if (copy / "config.json").is_file():
                return AutoTokenizer.from_pretrained(str(copy))
            return _gguf_tokenizer(gguf, gguf_metadata(gguf, ("tokenizer.chat_template",)).get("tokenizer.chat_template"))
        if _looks_local(path) and not Path(path).is_dir():
            raise _not_found(path)
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"could not load the tokenizer of {spec!r}: {exc}") from exc


@torch.no_grad()
def randomize_weights(model: torch.nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Overwrite every weight matrix and embedding with N(0, std^2) draws from a seeded generator (norm
    weights stay 1, biases 0): the same architecture and vocabulary with no knowledge, i.e. a draft that
    disagrees with its target. Deterministic for a given ``seed``.
    """
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if param.dim() >= 2:
            param.copy_(torch.randn(param.shape, generator=generator, dtype=torch.float32).mul_(std).to(param.dtype))
        elif "norm" in name:
            param.fill_(1.0)
        else:
            param.zero_()


def derive_layer_draft(loaded: LoadedModel, num_layers: int) -> LoadedModel:
    """A self-draft made of a model's first ``num_layers`` decoder layers (a copy; embedding, final norm and
    LM head shared in value), in the spirit of layer-skipping self-speculation (Zhang et al. 2024, "Draft &
    Verify"). Same tokenizer, so it is a valid draft for the original.

    Raises:
        ValueError: if the backend is not a PyTorch model or ``num_layers`` is not in [1, total layers).
    """
    import copy

    from draftwise.backends.lean import LeanCausalLM

    backend = loaded.backend
    if isinstance(backend, LeanCausalLM):
        draft = LeanCausalLM(backend.model.truncated(num_layers), name=f"{loaded.name}[:{num_layers} layers]")
        return LoadedModel(backend=draft, tokenizer=loaded.tokenizer, name=draft.name, eos_token_ids=loaded.eos_token_ids,
                           quantization=loaded.quantization)
    if not isinstance(backend, TorchCausalLM):
        raise ValueError("derive_layer_draft needs a PyTorch backend")
    layers = backend.model.model.layers
    if not (1 <= num_layers < len(layers)):
        raise ValueError(f"num_layers must be in [1, {len(layers)}), got {num_layers}")
    model = copy.deepcopy(backend.model)
    model.model.layers = model.model.layers[:num_layers]
    model.config.num_hidden_layers = num_layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:num_layers]
    draft = TorchCausalLM(model, name=f"{loaded.name}[:{num_layers} layers]", max_context=backend.max_context)
    return LoadedModel(backend=draft, tokenizer=loaded.tokenizer, name=draft.name, eos_token_ids=loaded.eos_token_ids,
                       quantization=loaded.quantization)
