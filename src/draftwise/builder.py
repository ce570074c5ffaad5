"""Assemble a ready engine from user-facing names: target, speculative config, device, dtype.

Used by the CLI, the server and the benchmarks, so every entry point builds engines the same way.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from draftwise.backends.llama_cpp_backend import relax_for_drafting
from draftwise.check.tokenizer import (
    TokenizerMismatchError,
    compare_tokenizers,
    require_compatible,
    tokenizer_info_from_hf,
)
from draftwise.batching import BATCHED_METHODS, BatchedEngine
from draftwise.config import SpeculativeConfig
from draftwise.engine import SpeculativeEngine
from draftwise.models.loading import LoadedModel, load_model
from draftwise.prefix_cache import PrefixCache
from draftwise.proposers.base import Proposer
from draftwise.proposers.registry import BuildOptions, get_method

__all__ = ["EngineBundle", "TokenizerMismatchError", "backend_kind", "build_engine", "build_proposer",
           "build_head_proposer", "check_same_tokenizer", "load_draft_model", "load_target_heads"]

logger = logging.getLogger(__name__)

DEMO_TARGET = "qwen2.5-coder-1.5b"
DEMO_DRAFT = "qwen2.5-coder-0.5b"
#: Default prefix-cache budget (bytes): about 75k tokens of Qwen2.5-Coder-1.5B fp32 KV state.
DEFAULT_KV_CACHE_MEMORY = 4 * 1024**3


@dataclass
class EngineBundle:
    """A target model, its optional draft model, and the engine driving them."""

    target: LoadedModel
    engine: SpeculativeEngine | BatchedEngine
    speculative_config: SpeculativeConfig | None = None
    draft: LoadedModel | None = None

    @property
    def method(self) -> str:
        """``"plain"`` or the speculative method name."""
        return self.speculative_config.method if self.speculative_config else "plain"


def check_same_tokenizer(target: LoadedModel, draft: LoadedModel) -> None:
    """Require identical id -> token tables over the ids both tokenizers have (see
    :mod:`draftwise.check.tokenizer` for the rules).

    A padded vocabulary (embeddings of different widths over the same real tokens) passes; the proposer cuts
    or pads the draft's logits to the target's width. Differing special tokens or chat templates are logged.
    A draft on another backend than the target needs an identical table (no extra tokens on either side).

    Raises:
        TokenizerMismatchError: naming the first differing ids and tokens, or a draft embedding too narrow to
            read the target's tokens.
    """
    report = compare_tokenizers(
        tokenizer_info_from_hf(target.tokenizer), tokenizer_info_from_hf(draft.tokenizer),
        target_vocab_width=target.backend.vocab_size, draft_vocab_width=draft.backend.vocab_size,
        target_name=target.name, draft_name=draft.name,
    )
    require_compatible(report)
    _require_identical_tables_across_backends(target, draft, report)


def backend_kind(model: LoadedModel) -> str:
    """``"llama.cpp"`` or ``"torch"``: which backend runs a loaded model."""
    from draftwise.backends.lean import LeanCausalLM
    from draftwise.backends.torch_backend import TorchCausalLM

    return "torch" if isinstance(model.backend, (TorchCausalLM, LeanCausalLM)) else "llama.cpp"


def _require_identical_tables_across_backends(target: LoadedModel, draft: LoadedModel, report) -> None:
    """A draft on another backend than the target (PyTorch and llama.cpp) must have exactly the target's token
    table: each side has its own tokenizer implementation, so only an identical id -> token table guarantees
    that the ids handed across mean the same text.

    Raises:
        TokenizerMismatchError: the tables differ in size (the shared ids were already checked).
    """
    target_kind, draft_kind = backend_kind(target), backend_kind(draft)
    if target_kind == draft_kind or report.target_tokens == report.draft_tokens:
        return
    raise TokenizerMismatchError(
        f"target {target.name!r} ({target_kind}) and draft {draft.name!r} ({draft_kind}) run on different backends, "
        f"which needs identical token tables; they have {report.target_tokens} and {report.draft_tokens} tokens. "
        "Load both with the same --backend")


def build_proposer(
    config: SpeculativeConfig,
    target: LoadedModel,
    *,
    device: str | None,
    dtype: str | None,
    quantization: str | None = None,
    backend: str = "torch",
    threads: int | None = None,
    runtime: str = "auto",
) -> tuple[Proposer, LoadedModel | None]:
    """Create the proposer a speculative config names (through :mod:`draftwise.proposers.registry`); returns
    it and its draft model (if any).

    ``quantization``, ``backend``, ``threads`` and ``runtime`` apply to a draft model as to the target (see
    :func:`load_model`). With ``backend="auto"`` the draft may land on another backend than the target (a
    ``.gguf`` draft for a Hugging Face target); that is allowed only with identical token tables.

    Raises:
        ModelLoadError, TokenizerMismatchError, HeadsMismatchError, ValueError: bad draft model, heads or method.
    """
    options = BuildOptions(device=device, dtype=dtype, quantization=quantization, backend=backend, threads=threads,
                           runtime=runtime)
    built = get_method(config.method).builder()(config, target, options)
    return built.proposer, built.draft


def load_draft_model(config: SpeculativeConfig, target: LoadedModel, options: BuildOptions,
                     num_slots: int = 1) -> LoadedModel:
    """Load the draft model ``config.model`` for ``target`` (same context length, checked tokenizer, drafting
    settings) for the methods that run one; ``num_slots``: sequences a lean draft's cache holds (batching).

    Raises:
        ModelLoadError, TokenizerMismatchError: see :func:`load_model` and :func:`check_same_tokenizer`.
    """
    assert config.model is not None
    draft = load_model(config.model, device=options.device, dtype=options.dtype,
                       max_context=target.backend.max_context, quantization=options.quantization,
                       backend=options.backend, threads=options.threads, runtime=options.runtime,
                       num_slots=num_slots)
    check_same_tokenizer(target, draft)
    relax_for_drafting(draft)  # only the target needs batch-invariant (slower) one-token passes
    return draft


def load_target_heads(config: SpeculativeConfig, target: LoadedModel):
    """Load the heads directory ``config.model`` onto the target's device and dtype, for the heads methods.

    Returns:
        ``(heads, heads_config, model)``: the heads module, its :class:`~draftwise.heads.HeadsConfig`, and the
        target's PyTorch model (whose embeddings and LM head the proposers share).

    Raises:
        HeadsMismatchError: not a heads directory, heads of another method, or heads trained on another base
            model (fingerprint check).
        ValueError: the target is not a PyTorch model.
    """
    from draftwise.backends.torch_backend import TorchCausalLM
    from draftwise.heads import HeadsMismatchError, base_model_identity, load_heads

    backend = target.backend
    if not isinstance(backend, TorchCausalLM):
        raise ValueError(f"method {config.method!r} runs heads on the target's hidden states and needs the PyTorch "
                         "backend with the transformers runtime (--backend torch --runtime transformers)")
    model = backend.model
    dtype = model.get_input_embeddings().weight.dtype
    heads, heads_config = load_heads(config.model, fingerprint=base_model_identity(model), base_name=target.name,
                                     device=backend.device, dtype=dtype)
    if heads_config.method != config.method:
        raise HeadsMismatchError(f"{config.model} holds {heads_config.method} heads, not {config.method}")
    return heads, heads_config, model


def build_head_proposer(config: SpeculativeConfig, target: LoadedModel) -> Proposer:
    """A Medusa or EAGLE proposer from the heads directory ``config.model``, on the target's device and dtype.

    Raises:
        HeadsMismatchError: see :func:`load_target_heads`.
        ValueError: the target is not a PyTorch model, or ``config.method`` is not a heads method.
    """
    if get_method(config.method).model != "heads":
        raise ValueError(f"method {config.method!r} does not run heads")
    return get_method(config.method).builder()(config, target, BuildOptions()).proposer


def build_engine(
    target: str,
    speculative_config: SpeculativeConfig | None = None,
    *,
    device: str | None = None,
    dtype: str | None = None,
    max_context: int | None = None,
    quantization: str | None = None,
    backend: str = "torch",
    threads: int | None = None,
    kv_cache_memory: int = DEFAULT_KV_CACHE_MEMORY,
    runtime: str = "auto",
    max_num_seqs: int = 1,
    max_num_batched_tokens: int = 256,
) -> EngineBundle:
    """Load the target (and draft) and build the engine. Without a speculative config: plain decoding.

    Args:
        target: registry name, ``.gguf`` path, HF directory or hub id.
        speculative_config: proposer choice, K and the K policy (``"auto"`` calibrates the forward costs
            once per model and machine; see :func:`draftwise.calibration.calibrate_cost_model`).
        device, dtype: see :func:`draftwise.models.loading.load_model`.
        max_context: context length in tokens (default: the target config's).
        quantization: ``"none"`` or ``"int8"`` for the target and a draft model (see
            :mod:`draftwise.backends.quantization`).
        backend: ``"torch"``, ``"llama.cpp"`` or ``"auto"`` for the target and a draft model (see
            :func:`draftwise.models.loading.select_backend`).
        threads: llama.cpp CPU threads (default: all available).
        runtime: ``"lean"``, ``"transformers"`` or ``"auto"`` for PyTorch models (see
            :func:`draftwise.models.loading.select_runtime`); the heads methods (Medusa, EAGLE) run their heads on
            the transformers model, so ``"auto"`` gives their target the transformers runtime.
        kv_cache_memory: memory budget (bytes) of the prefix cache that keeps finished sequences' KV states for
            reuse by later requests sharing a prefix (:mod:`draftwise.prefix_cache`); 0 turns reuse off.
        max_num_seqs: requests decoded together. Above 1, a target on the lean runtime with plain decoding or a
            batchable method (:data:`draftwise.batching.BATCHED_METHODS`) gets a
            :class:`~draftwise.batching.BatchedEngine` (continuous batching, one KV-cache slot per request, with
            ``k_policy="auto"`` the load-aware K); any other target or method the one-request-at-a-time
            :class:`SpeculativeEngine` (logged).
        max_num_batched_tokens: the batched engine's rows per target pass (prompt chunks included).
    """
    target_runtime = runtime
    if runtime == "auto" and speculative_config is not None and get_method(speculative_config.method).model == "heads":
        target_runtime = "transformers"
    batch = max_num_seqs > 1
    if batch and speculative_config is not None and speculative_config.method not in BATCHED_METHODS:
        logger.warning("method %r does not run in the batched engine (batched: %s); serving one request at a time",
                       speculative_config.method, ", ".join(BATCHED_METHODS))
        batch = False
    target_model = load_model(target, device=device, dtype=dtype, max_context=max_context,
                              quantization=quantization, backend=backend, threads=threads, runtime=target_runtime,
                              num_slots=max_num_seqs if batch else 1)
    if batch:
        from draftwise.backends.lean import LeanCausalLM

        if isinstance(target_model.backend, LeanCausalLM):
            from draftwise.batching import build_batched_engine

            options = BuildOptions(device=device, dtype=dtype, quantization=quantization, backend=backend,
                                   threads=threads, runtime=runtime)
            engine, draft = build_batched_engine(
                target_model, speculative_config, options, max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens, prefix_cache=PrefixCache(kv_cache_memory))
            return EngineBundle(target=target_model, engine=engine, speculative_config=speculative_config, draft=draft)
        logger.warning("continuous batching needs the lean runtime (int8 on the CPU, a Llama-family model); "
                       "%s runs one request at a time", target_model.name)
    if speculative_config is None:
        engine = SpeculativeEngine(target_model.backend, eos_token_ids=target_model.eos_token_ids,
                                   prefix_cache=PrefixCache(kv_cache_memory))
        return EngineBundle(target=target_model, engine=engine)
    proposer, draft = build_proposer(speculative_config, target_model, device=device, dtype=dtype,
                                     quantization=quantization, backend=backend, threads=threads, runtime=runtime)
    from draftwise.calibration import calibrate_cost_model
    from draftwise.controller import k_controller_factory

    max_k = speculative_config.num_speculative_tokens
    cost_model = None
    if speculative_config.k_policy == "auto":
        cost_model = calibrate_cost_model(  # cached per model and machine after the first run
            target_model.backend, max_k, draft=draft.backend if draft else None, proposer=proposer
        )
    engine = SpeculativeEngine(
        target_model.backend,
        proposer,
        max_k,
        eos_token_ids=target_model.eos_token_ids,
        controller_factory=k_controller_factory(speculative_config.k_policy, max_k, cost_model),
        prefix_cache=PrefixCache(kv_cache_memory),
    )
    return EngineBundle(target=target_model, engine=engine, speculative_config=speculative_config, draft=draft)
