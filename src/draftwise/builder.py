"""Assemble a ready engine from user-facing names: target, speculative config, device, dtype.

Used by the CLI, the server and the benchmarks, so every entry point builds engines the same way.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from draftwise.check.memory import available_ram
from draftwise.check.tokenizer import (
    TokenizerInfo,
    TokenizerMismatchError,
    compare_tokenizers,
    require_compatible,
    tokenizer_info_from_hf,
)
from draftwise.backends.base import CausalLM
from draftwise.backends.lean.backend import LeanCausalLM
from draftwise.backends.llama_cpp_backend import LlamaCppCausalLM
from draftwise.config import SpeculativeConfig
from draftwise.speculation.controller import KController
from draftwise.engine import BATCHED_METHODS, EngineCore, SpeculativeEngine, one_slot_core
from draftwise.methods import DEFAULT_CATCH_UP, FIXED_DRAFT_CONFIDENCE, METHODS, get_method
from draftwise.models.auto_quantization import target_rows_per_pass
from draftwise.models.loading import LoadedModel, check_model_source, load_model
from draftwise.prefix_cache import PrefixCache
from draftwise.proposers.base import PerSequenceProposers, Proposer, SequenceProposer
from draftwise.units import format_bytes

if TYPE_CHECKING:
    from draftwise.cpu_share import ThreadGovernor
    from draftwise.proposers.draft_model import DraftModelProposer
    from draftwise.proposers.suffix import SuffixProposer

__all__ = ["assemble_engine", "per_request_k", "BuildOptions", "BuiltProposer", "EngineBundle", "PROPOSER_BUILDERS",
           "TokenizerMismatchError", "backend_kind", "build_batched_engine", "build_engine", "build_proposer",
           "build_head_proposer", "check_same_tokenizer", "draft_confidence", "draft_load_options", "load_draft_model",
           "load_target_heads", "require_target_ids_across_backends", "DEFAULT_KV_CACHE_MEMORY", "KvCacheBudget",
           "default_kv_cache_memory", "kv_cache_budget"]

logger = logging.getLogger(__name__)

DEMO_TARGET = "qwen2.5-coder-1.5b"
DEMO_DRAFT = "qwen2.5-coder-0.5b"
#: Default prefix-cache budget of the library (bytes), and the cap of the commands' default
#: (:func:`default_kv_cache_memory`): about 75k tokens of Qwen2.5-Coder-1.5B fp32 KV state.
DEFAULT_KV_CACHE_MEMORY = 4 * 1024**3
#: The commands' default prefix-cache budget is at most 1/KV_CACHE_MEMORY_DIVISOR of the memory available at start.
KV_CACHE_MEMORY_DIVISOR = 4
#: How ``--help`` states the commands' default (``serve``, ``bench --workload agent``).
KV_CACHE_MEMORY_DEFAULT_HELP = (f"min({DEFAULT_KV_CACHE_MEMORY // 1024**3} GiB, 1/{KV_CACHE_MEMORY_DIVISOR} of "
                                "available memory at start)")


def default_kv_cache_memory(available_bytes: int | None = None) -> int:
    """The commands' default prefix-cache budget (bytes): ``min(DEFAULT_KV_CACHE_MEMORY, available_bytes // 4)``.

    ``available_bytes``: the memory available (bytes); None reads it now
    (:func:`draftwise.check.memory.available_ram`), and
    when that is unknown too the budget is the cap, :data:`DEFAULT_KV_CACHE_MEMORY`. Never raises.

    Why a quarter (:data:`KV_CACHE_MEMORY_DIVISOR`): the figure is read once at start, before the models load,
    and the cache fills only later, over many requests; the other three quarters must hold the target's and the
    draft's weights (dequantized: several GiB for the demo pair), the working KV cache, the activations and the
    rest of the machine. A fixed 4 GiB got a server killed by the kernel (OOM) on a 24 GiB machine running four
    servers. The cap applies from 16 GiB available up. Servers started together each see the same available
    memory and each take their quarter: give each an explicit ``--kv-cache-memory`` then.
    """
    if available_bytes is None:
        available_bytes = available_ram()
    if available_bytes is None:
        return DEFAULT_KV_CACHE_MEMORY
    return max(0, min(DEFAULT_KV_CACHE_MEMORY, available_bytes // KV_CACHE_MEMORY_DIVISOR))


@dataclass(frozen=True)
class KvCacheBudget:
    """The prefix-cache budget a command runs with: ``nbytes`` (bytes; 0: no prefix reuse) and ``reason``, where
    it came from, for the log (e.g. ``"1/4 of 10.0 GiB available; cap 4.00 GiB"``)."""

    nbytes: int
    reason: str

    def describe(self) -> str:
        """``"prefix cache: 2.50 GiB (1/4 of 10.0 GiB available; cap 4.00 GiB)"``, ``"prefix cache: 4.00 GiB (the cap;
        1/4 of 22.8 GiB available is more)"``; ``"prefix cache: off (...)"``."""
        return f"prefix cache: {format_bytes(self.nbytes) if self.nbytes else 'off'} ({self.reason})"


def kv_cache_budget(requested: int | None, available_bytes: int | None = None) -> KvCacheBudget:
    """Resolve ``--kv-cache-memory`` (bytes; None: not given): a value given is used as is, else
    :func:`default_kv_cache_memory` of ``available_bytes`` (None: read now, once)."""
    if available_bytes is None:
        available_bytes = available_ram()
    if requested is not None:
        if available_bytes is not None and requested > available_bytes:
            logger.warning("--kv-cache-memory %s is more than the %s of memory available now: a long-running server "
                           "may be killed for memory before its prefix cache is full", format_bytes(requested),
                           format_bytes(available_bytes))
        return KvCacheBudget(requested, "--kv-cache-memory")
    cap = format_bytes(DEFAULT_KV_CACHE_MEMORY)
    if available_bytes is None:
        return KvCacheBudget(DEFAULT_KV_CACHE_MEMORY, f"available memory unknown; cap {cap}")
    budget = default_kv_cache_memory(available_bytes)
    share = f"1/{KV_CACHE_MEMORY_DIVISOR} of {format_bytes(available_bytes)} available"
    if available_bytes // KV_CACHE_MEMORY_DIVISOR > DEFAULT_KV_CACHE_MEMORY:
        return KvCacheBudget(budget, f"the cap; {share} is more")
    return KvCacheBudget(budget, f"{share}; cap {cap}")


@dataclass(frozen=True)
class BuildOptions:
    """How the target was loaded (see :func:`draftwise.models.loading.load_model`): a draft model is loaded the
    same way, unless its config names a backend of its own (:attr:`draftwise.config.SpeculativeConfig.backend`;
    see :func:`load_draft_model`)."""

    device: str | None = None
    dtype: str | None = None
    quantization: str | None = None
    backend: str = "torch"
    threads: int | None = None
    runtime: str = "auto"


@dataclass
class BuiltProposer:
    """A proposer ready for the engine, and the draft model it runs (None for model-free methods and heads)."""

    proposer: Proposer | SequenceProposer
    draft: LoadedModel | None = None


@dataclass
class EngineBundle:
    """A target model, its optional draft model, and the engine core driving them.

    Attributes:
        core: the :class:`~draftwise.engine.core.EngineCore` (one slot, or many with continuous batching).
        engine: the library facade over it (:class:`~draftwise.engine.SpeculativeEngine`: ``generate`` /
            ``stream``, one request at a time), made on first use.
    """

    target: LoadedModel
    core: EngineCore
    speculative_config: SpeculativeConfig | None = None
    draft: LoadedModel | None = None

    @property
    def method(self) -> str:
        """``"plain"`` or the speculative method name."""
        return self.speculative_config.method if self.speculative_config else "plain"

    @functools.cached_property
    def engine(self) -> SpeculativeEngine:
        """The one-request facade over :attr:`core`."""
        return SpeculativeEngine.over(self.core, self.target.backend)


def assemble_engine(target: LoadedModel, proposer: Proposer | SequenceProposer | None = None,
                    num_speculative_tokens: int = 5, *,
                    controller_factory: Callable[[], KController] | None = None,
                    prefix_cache: PrefixCache | None = None) -> SpeculativeEngine:
    """The one-request facade over :func:`~draftwise.engine.one_slot_core` for a loaded target, a proposer built
    by the caller (None: plain decoding) and K, with the target's EOS ids (bench, check, heads data).

    Raises:
        ValueError: see :class:`~draftwise.engine.SpeculativeEngine`.
    """
    return SpeculativeEngine(target.backend, proposer, num_speculative_tokens, eos_token_ids=target.eos_token_ids,
                             controller_factory=controller_factory, prefix_cache=prefix_cache)


def check_same_tokenizer(target: LoadedModel, draft: LoadedModel) -> None:
    """Require the draft's id -> token table to agree with the target's (see :mod:`draftwise.check.tokenizer`
    for the rules).

    On one backend, the tables must be identical over the ids both have; extra tokens on either side are
    logged. A draft on another backend than the target (a llama.cpp draft for a PyTorch target) must moreover
    hold every id of the target's table (:func:`require_target_ids_across_backends`). A padded vocabulary
    (embeddings of different widths over the same real tokens) passes; the proposer cuts or pads the draft's
    logits to the target's width. Differing special tokens or chat templates are logged.

    Raises:
        TokenizerMismatchError: naming the first differing ids and tokens, the first target ids a draft on
            another backend lacks, or a draft embedding too narrow to read the target's tokens.
    """
    target_info, draft_info = tokenizer_info_from_hf(target.tokenizer), tokenizer_info_from_hf(draft.tokenizer)
    report = compare_tokenizers(
        target_info, draft_info,
        target_vocab_width=target.backend.vocab_size, draft_vocab_width=draft.backend.vocab_size,
        target_name=target.name, draft_name=draft.name,
    )
    require_compatible(report)
    require_target_ids_across_backends(target, draft, target_info, draft_info)


def backend_kind(model: LoadedModel) -> str:
    """``"llama.cpp"`` or ``"torch"``: which backend runs a loaded model."""
    from draftwise.backends.lean import LeanCausalLM
    from draftwise.backends.torch_backend import TorchCausalLM

    return "torch" if isinstance(model.backend, (TorchCausalLM, LeanCausalLM)) else "llama.cpp"


def require_target_ids_across_backends(target: LoadedModel, draft: LoadedModel, target_info: TokenizerInfo,
                                       draft_info: TokenizerInfo) -> None:
    """A draft on another backend than the target must give every id of the target's table the target's token.

    Each backend brings its own tokenizer (llama.cpp's :class:`~draftwise.backends.llama_cpp_backend.
    LlamaCppTokenizer`, or a ``transformers`` one), but only the target's ever runs: it encodes prompts and
    decodes output, and the draft reads and proposes ids. So the draft's table must agree with the target's over
    the target's ids (the shared ids were checked by :func:`compare_tokenizers`) and may hold more tokens (the
    proposer cuts its logits to the target's width, so ids the target cannot produce are never proposed). On one
    backend a shorter draft table stays a warning, as before.

    Args:
        target, draft: the loaded pair.
        target_info, draft_info: their token tables (:func:`tokenizer_info_from_hf`).

    Raises:
        TokenizerMismatchError: the draft's table lacks target ids (the message names the first of them).
    """
    target_kind, draft_kind = backend_kind(target), backend_kind(draft)
    if target_kind == draft_kind:
        return
    first_missing, target_size = len(draft_info.tokens), len(target_info.tokens)
    if first_missing < target_size:
        raise TokenizerMismatchError(
            f"draft {draft.name!r} ({draft_kind}) lacks {target_size - first_missing} of the {target_size} token ids "
            f"of target {target.name!r} ({target_kind}): ids {first_missing}..{target_size - 1} (first "
            f"{target_info.tokens[first_missing]!r}); a draft on another backend must hold every target id with the "
            "target's token. Load both on the same backend, or pick a draft with the target's full vocabulary")
    logger.info("draft %s (%s) and target %s (%s): token tables agree on all %d target ids", draft.name, draft_kind,
                target.name, target_kind, target_size)


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
) -> tuple[Proposer | SequenceProposer, LoadedModel | None]:
    """Create the proposer a speculative config names (through :data:`PROPOSER_BUILDERS`); returns
    it and its draft model (if any).

    ``device``, ``dtype``, ``quantization``, ``backend``, ``threads`` and ``runtime`` describe how the target was loaded;
    a draft model is loaded the same way unless ``config.backend`` names its own backend (see
    :func:`draft_load_options`). A draft may so land on another backend than the target (a llama.cpp draft
    for a PyTorch target, or a ``.gguf`` draft for a Hugging Face target with ``backend="auto"``); its token
    table must then agree with the target's over every target id (:func:`check_same_tokenizer`).

    Raises:
        ModelLoadError, TokenizerMismatchError, HeadsMismatchError, ValueError: bad draft model, heads or method.
    """
    options = BuildOptions(device=device, dtype=dtype, quantization=quantization, backend=backend, threads=threads,
                           runtime=runtime)
    built = PROPOSER_BUILDERS[get_method(config.method).name](config, target, options)
    return built.proposer, built.draft


def load_draft_model(config: SpeculativeConfig, target: LoadedModel, options: BuildOptions,
                     num_slots: int = 1) -> LoadedModel:
    """Load the draft model ``config.model`` for ``target`` (same context length, checked tokenizer, drafting
    settings) for the methods that run one, on the backend :func:`draft_load_options` picks. With
    ``draft_vocab_size`` / ``token_map`` set, the draft's LM head covers that frequency-ranked subset only
    (FR-Spec, :mod:`draftwise.frspec`). ``num_slots``: sequences the draft's cache holds (the batched engine:
    lean slots, or a llama.cpp context of that many sequences).

    Raises:
        ModelLoadError, ValueError, TokenizerMismatchError: see :func:`load_model`, :func:`draft_load_options`
            and :func:`check_same_tokenizer`.
        FileNotFoundError, ValueError: a missing or unfitting token map; a vocabulary subset for a llama.cpp
            draft.
    """
    assert config.model is not None
    head_subset = None
    if config.draft_vocab_size is not None or config.token_map is not None:
        from draftwise.frspec import HeadSubset

        head_subset = HeadSubset(size=config.draft_vocab_size, token_map=config.token_map)
    where = getattr(target.backend, "device", None)
    target_device = where.type if isinstance(where, torch.device) else "cpu"
    measured = _measured_draft(config, options, target, target_device, num_slots)
    draft = measured or load_model(config.model, max_context=target.backend.max_context, head_subset=head_subset,
                                   num_slots=num_slots,
                                   **draft_load_options(config, options, target_device=target_device))
    check_same_tokenizer(target, draft)
    return draft


def load_named_draft(model: str, target: LoadedModel, options: BuildOptions, backend: str | None = None) -> LoadedModel:
    """The draft model ``model`` for ``target`` as the engine loads it (:func:`load_draft_model` with a plain
    ``draft_model`` config): like the target (``options``), or on ``backend`` (``"torch"``, ``"llama.cpp"``,
    ``"auto"``: measured; None: the target's). For commands that measure a draft without building an engine
    (``costs``, ``check``).

    Raises:
        ModelLoadError, ValueError, TokenizerMismatchError: see :func:`load_draft_model`.
    """
    config = SpeculativeConfig(method="draft_model", model=model, backend=backend)
    return load_draft_model(config, target, options)


def _needs_pytorch_draft(config: SpeculativeConfig) -> bool:
    """Whether only the PyTorch draft can serve ``config``: draft trees (``tree_width`` > 1) or an FR-Spec head
    (``draft_vocab_size`` / ``token_map``); ``--speculative-backend auto`` then loads it there."""
    return config.tree_width > 1 or config.draft_vocab_size is not None or config.token_map is not None


def _measured_draft(config: SpeculativeConfig, options: BuildOptions, target: LoadedModel, target_device: str,
                    num_slots: int) -> LoadedModel | None:
    """``--speculative-backend auto`` for a GGUF draft that both backends can run (a CPU target, a chain draft
    without an FR-Spec head: not :func:`_needs_pytorch_draft`; llama-cpp-python installed): the draft loaded
    on the runtime that decodes it fastest here (the lean runtime, llama.cpp on the file, llama.cpp on two Q4_0
    copies), measured once per machine (:func:`draftwise.draft_backend.choose_draft_backend`), with ``num_slots``
    sequences; None otherwise (the rule of :func:`draft_load_options` applies)."""
    import dataclasses
    import os

    from draftwise.backends.llama_cpp_backend import llama_cpp_available
    from draftwise.models.loading import resolve_model

    if config.backend != "auto" or target_device != "cpu" or _needs_pytorch_draft(config):
        return None
    path = resolve_model(config.model or "")
    if not str(path).endswith(".gguf") or not os.path.isfile(path) or not llama_cpp_available():
        return None  # (a missing file: the usual loader says so)
    from draftwise.draft_backend import choose_draft_backend

    def load(kind: str, file: str) -> LoadedModel:
        forced = dataclasses.replace(config, backend=kind, model=file)
        return load_model(file, max_context=target.backend.max_context, num_slots=num_slots,
                          **draft_load_options(forced, options, target_device=target_device))

    # the cache key takes the quantization the target resolved to ("auto" and "int8" load the same draft here)
    choice, draft = choose_draft_backend(str(path), load, threads=options.threads, quantization=target.quantization,
                                         name=config.model)
    return dataclasses.replace(draft, name=config.model, runtime_choice=choice.reason)


def draft_load_options(config: SpeculativeConfig, options: BuildOptions, *, target_device: str = "cpu") -> dict:
    """The :func:`load_model` keyword arguments (besides ``max_context``) of ``config``'s draft model.

    Without ``config.backend`` the draft is loaded like the target (``options``). With it, the draft's backend
    is chosen for the draft alone (:func:`draftwise.models.loading.select_backend` on ``config.model`` and
    ``target_device``, the device type the loaded target runs on: ``"cpu"`` or ``"cuda"``). On llama.cpp the
    draft gets the target's ``threads`` and none of the PyTorch-only options (dtype, int8 quantization), which
    are the target's; on PyTorch it gets the target's device, dtype and quantization. So ``--quantization int8
    --speculative-backend llama.cpp`` runs an exact int8 target with a Q4_K_M draft. ``"auto"`` gives PyTorch where
    only it serves (draft trees, an FR-Spec head: :func:`_needs_pytorch_draft`).

    Raises:
        ValueError: ``config.backend`` is ``"llama.cpp"`` while the target runs on a device other than the CPU
            (``"auto"`` then picks PyTorch).
        ModelLoadError: see :func:`draftwise.models.loading.select_backend` (``"llama.cpp"`` for a model that
            is not a GGUF file, llama-cpp-python missing, a registry draft not pulled).
    """
    from draftwise.models.loading import RANDOM_PREFIX, resolve_model, select_backend

    torch_options = dict(device=options.device, dtype=options.dtype, quantization=options.quantization,
                         threads=options.threads, runtime=options.runtime, drafting=True)
    if config.backend is None:
        return dict(torch_options, backend=options.backend)
    spec = config.model or ""
    if spec.startswith(RANDOM_PREFIX):  # random weights: PyTorch only (load_model says so for "llama.cpp")
        return dict(torch_options, backend=config.backend)
    if config.backend == "llama.cpp" and target_device != "cpu":
        raise ValueError(f"a llama.cpp draft runs on the CPU; the target runs on {target_device!r}: use "
                         "--speculative-backend torch (or auto) with a GPU target")
    if config.backend == "auto" and _needs_pytorch_draft(config):
        return dict(torch_options, backend="torch")
    kind = select_backend(config.backend, resolve_model(spec), device=target_device)
    if kind == "llama.cpp":
        return dict(backend="llama.cpp", threads=options.threads, drafting=True)
    return dict(torch_options, backend="torch")


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


def build_head_proposer(config: SpeculativeConfig, target: LoadedModel) -> SequenceProposer:
    """A Medusa or EAGLE proposer from the heads directory ``config.model``, on the target's device and dtype.

    Raises:
        HeadsMismatchError: see :func:`load_target_heads`.
        ValueError: the target is not a PyTorch model, or ``config.method`` is not a heads method.
    """
    if get_method(config.method).model != "heads":
        raise ValueError(f"method {config.method!r} does not run heads")
    return PROPOSER_BUILDERS[config.method](config, target, BuildOptions()).proposer


# ---------------------------------------------------------------------------------------------- proposers
def _build_draft_model(config: SpeculativeConfig, target: LoadedModel, options: BuildOptions) -> BuiltProposer:
    """``draft_model``: load the draft model ``config.model`` like the target (``options``) and check its
    tokenizer against the target's (:func:`load_draft_model`)."""
    draft = load_draft_model(config, target, options)
    _check_tree_verifier(config, target)
    return BuiltProposer(_draft_model(config, target.backend, draft), draft)


def _draft_model(config: SpeculativeConfig, target: CausalLM, draft: LoadedModel, *,
                 slot_per_sequence: bool = False) -> DraftModelProposer:
    """The draft-model proposer over a loaded draft: the config's tree shape (sized by the target's verify cost,
    :func:`tree_verify_seconds`), window and confidence stop (:func:`draft_confidence`)."""
    from draftwise.proposers.draft_model import DraftModelProposer

    verify = tree_verify_seconds(target, config.num_speculative_tokens, config.tree_width, config.tree_budget)
    stop = draft_confidence(config.draft_confidence_threshold, target, draft.backend, config.num_speculative_tokens,
                            config.tree_width)
    return DraftModelProposer(draft.backend, target.vocab_size, config.tree_width, config.tree_budget, verify,
                              window=config.draft_window, confidence_threshold=stop,
                              slot_per_sequence=slot_per_sequence)


def draft_confidence(value: float | str, target: CausalLM, draft: CausalLM, k: int, tree_width: int = 1
                     ) -> float | tuple[float, ...]:
    """A ``draft_confidence_threshold`` as the draft-model proposers take it: a number as it is; ``"auto"`` as one
    path-probability threshold per chain depth from the calibrated costs of ``target`` and ``draft``
    (:func:`draftwise.speculation.cost_model.draft_stop_thresholds`; :func:`draftwise.speculation.calibration.calibrate_cost_model`
    measures them once per model and machine and caches them). Where no thresholds apply (a tree, K = 1) or the
    costs cannot be measured (a context too short for the timing passes), ``"auto"`` is
    :data:`~draftwise.methods.FIXED_DRAFT_CONFIDENCE`.

    Args:
        value: the config's ``draft_confidence_threshold``.
        target, draft: the two backends; k: the longest chain (``num_speculative_tokens``); tree_width: the
            config's (trees are sized by the verify cost instead).
    """
    if value != "auto":
        return value
    if tree_width > 1 or k <= 1:
        return FIXED_DRAFT_CONFIDENCE
    from draftwise.speculation.calibration import calibrate_cost_model
    from draftwise.speculation.cost_model import draft_stop_thresholds

    try:
        costs = calibrate_cost_model(target, k, draft=draft)
    except ValueError as error:
        logger.warning("draft confidence: the costs could not be measured (%s); stopping chains at path "
                       "probability %g", error, FIXED_DRAFT_CONFIDENCE)
        return FIXED_DRAFT_CONFIDENCE
    thresholds = draft_stop_thresholds(costs, k)
    logger.info("draft confidence 'auto' (c = %.3f): a chain of j = 1..%d tokens grows while its path probability "
                "is at least %s", costs.cost_ratio, len(thresholds), ", ".join(f"{t:.2f}" for t in thresholds))
    longest = next((j for j, t in enumerate(thresholds, 1) if t >= 1.0), k)
    if longest < k:
        logger.warning("draft confidence 'auto': with these costs (a draft token %.3f of a target pass) no draft "
                       "token past the first %d can pay, so chains stop there although K = %d; set "
                       "draft_confidence_threshold 0 to draft K deep anyway", costs.cost_ratio, longest, k)
    return thresholds


def tree_verify_seconds(target: CausalLM, k: int, tree_width: int, tree_budget: int | None
                        ) -> Callable[[int], float] | None:
    """The target's ``rows -> seconds`` verification cost for sizing draft trees (None for a chain): the
    calibrated verify curve over up to the tree's budget + 1 rows (:func:`draftwise.speculation.calibration.calibrate_cost_model`,
    cached per model and machine)."""
    if tree_width <= 1:
        return None
    from draftwise.speculation.calibration import calibrate_cost_model

    budget = tree_budget if tree_budget is not None else k * tree_width
    costs = calibrate_cost_model(target, budget)
    return costs.verify_cost


def _check_tree_verifier(config: SpeculativeConfig, target: LoadedModel) -> None:
    """A draft tree (``tree_width`` > 1) needs a target that verifies trees.

    Raises:
        ValueError: it does not.
    """
    if config.tree_width > 1 and not getattr(target.backend, "supports_tree", False):
        raise ValueError(f"tree_width {config.tree_width}: the target {target.name} verifies chains only (draft "
                         "trees need a PyTorch target: --backend torch); use tree_width 1")


def _build_ngram(config: SpeculativeConfig, target: LoadedModel, options: BuildOptions) -> BuiltProposer:
    """``ngram``: ``config.prompt_lookup_min`` / ``prompt_lookup_max``; no model."""
    from draftwise.proposers.ngram import NgramProposer

    return BuiltProposer(NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max))


def _build_suffix(config: SpeculativeConfig, target: LoadedModel, options: BuildOptions) -> BuiltProposer:
    """``suffix``: from the ``suffix_decoding_*`` fields; the target only tells whether trees can be verified."""
    from draftwise.proposers.suffix import suffix_proposer_from_config

    supports_tree = bool(getattr(getattr(target, "backend", None), "supports_tree", False))
    return BuiltProposer(suffix_proposer_from_config(config, supports_tree=supports_tree))


def _build_hybrid(config: SpeculativeConfig, target: LoadedModel, options: BuildOptions) -> BuiltProposer:
    """``hybrid`` on one slot: the draft model (as ``draft_model``) and one suffix proposer shared by the
    consecutive requests (:func:`_hybrid`)."""
    from draftwise.proposers.suffix import suffix_proposer_from_config

    built = _build_draft_model(config, target, options)
    suffix = suffix_proposer_from_config(config, supports_tree=bool(getattr(target.backend, "supports_tree", False)))
    built.proposer = _hybrid(config, target.backend, built.draft, built.proposer, suffix)
    return built


def _hybrid(config: SpeculativeConfig, target: CausalLM, draft: LoadedModel, model: DraftModelProposer,
            suffix: SuffixProposer | Callable[[], SuffixProposer]) -> Proposer:
    """The hybrid proposer over a draft-model proposer and ``suffix`` (one shared proposer, or a factory of one per
    sequence), priced by the target's and draft's costs from :func:`draftwise.speculation.calibration.calibrate_cost_model`
    (cached per model and machine)."""
    from draftwise.speculation.calibration import calibrate_cost_model
    from draftwise.proposers.hybrid import HybridProposer

    k = config.num_speculative_tokens
    costs = calibrate_cost_model(target, k, draft=draft.backend)
    return HybridProposer(suffix, model, costs, max_k=k)


def _build_medusa(config: SpeculativeConfig, target: LoadedModel, options: BuildOptions) -> BuiltProposer:
    """``medusa``: heads from ``config.model`` on the target; the tree is ``config.tree``, else a full tree of
    ``config.tree_width`` (and ``tree_budget``), else a chain."""
    from draftwise.proposers.medusa import MedusaProposer
    from draftwise.tree import TreeTemplate

    heads, heads_config, model = load_target_heads(config, target)
    depth = min(config.num_speculative_tokens, heads_config.num_heads)
    if config.tree is not None:
        template = TreeTemplate(config.tree)
    elif config.tree_width > 1:
        template = TreeTemplate.full(depth, config.tree_width, config.tree_budget)
    else:
        template = None
    return BuiltProposer(MedusaProposer(heads, model.get_output_embeddings(), template))


def _build_eagle(config: SpeculativeConfig, target: LoadedModel, options: BuildOptions) -> BuiltProposer:
    """``eagle``: the EAGLE head from ``config.model`` on the target, ``config.tree_width`` / ``tree_budget``."""
    from draftwise.proposers.eagle import EagleProposer

    head, _, model = load_target_heads(config, target)
    return BuiltProposer(EagleProposer(head, model.get_input_embeddings(), model.get_output_embeddings(),
                                       config.tree_width, config.tree_budget))


#: method name -> ``build(config, target, options) -> BuiltProposer`` (one per entry of
#: :data:`draftwise.methods.METHODS`).
PROPOSER_BUILDERS = {"draft_model": _build_draft_model, "ngram": _build_ngram, "suffix": _build_suffix,
                     "hybrid": _build_hybrid, "medusa": _build_medusa, "eagle": _build_eagle}
assert set(PROPOSER_BUILDERS) == set(METHODS), "every registered method needs a build function"


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
    kv_cache_memory: int | None = None,
    runtime: str = "auto",
    max_num_seqs: int = 1,
    max_num_batched_tokens: int = 256,
    follow_free_cpus: bool = True,
) -> EngineBundle:
    """Load the target (and draft) and build the engine core (:attr:`EngineBundle.core`, with its one-request
    facade :attr:`EngineBundle.engine`). Without a speculative config: plain decoding.

    Args:
        target: registry name, ``.gguf`` path, HF directory or hub id.
        speculative_config: proposer choice, K and the K policy (``"auto"`` calibrates the forward costs
            once per model and machine; see :func:`draftwise.speculation.calibration.calibrate_cost_model`).
        device, dtype: see :func:`draftwise.models.loading.load_model`.
        max_context: context length in tokens (default: the target config's).
        quantization: ``"none"``, ``"int8"``, ``"q4k"`` or ``"auto"`` for the target and a draft model (see
            :mod:`draftwise.backends.quantization`); ``"auto"`` sizes the target's mode for the rows of one
            request's verify pass (1 for plain decoding, K + 1 with speculation:
            :func:`draftwise.models.auto_quantization.target_rows_per_pass`) and a draft's for one-row passes.
        backend: ``"torch"``, ``"llama.cpp"`` or ``"auto"`` for the target, and for a draft model unless
            ``speculative_config.backend`` names the draft's own (see
            :func:`draftwise.models.loading.select_backend` and :func:`draft_load_options`).
        threads: llama.cpp CPU threads of the target and a llama.cpp draft (default: all available).
        runtime: ``"lean"``, ``"transformers"`` or ``"auto"`` for PyTorch models (see
            :func:`draftwise.models.loading.select_runtime`); the heads methods (Medusa, EAGLE) run their heads on
            the transformers model, so ``"auto"`` gives their target the transformers runtime.
        kv_cache_memory: memory budget (bytes) of the prefix cache that keeps finished sequences' KV states for
            reuse by later requests sharing a prefix (:mod:`draftwise.prefix_cache`); 0 turns reuse off; None: the
            commands' default, :func:`default_kv_cache_memory` (read when the engine is built).
        max_num_seqs: requests decoded together. Above 1, a target on the lean runtime with plain decoding or a
            batchable method (:data:`draftwise.engine.BATCHED_METHODS`) gets a core of that many slots
            (continuous batching, one KV-cache slot per request, with ``k_policy="auto"`` the load-aware K for the
            batch: :func:`build_batched_engine`); any other target or method a core of one slot serving one
            request at a time (logged), with each request's own K policy (:func:`per_request_k`).
        max_num_batched_tokens: the batched engine's rows per target pass (prompt chunks included).
        follow_free_cpus: unless ``threads`` is given, the compute threads follow the CPUs other processes leave
            free, between steps (:func:`thread_governor`); False: they stay at every available CPU.

    Raises:
        ModelLoadError: a draft model is missing (a local path, or a registry name not pulled), checked before
            the target's weights are read (:func:`draftwise.models.loading.check_model_source`), and whatever
            :func:`draftwise.models.loading.load_model` raises (a missing target, first thing).
    """
    if speculative_config is not None and get_method(speculative_config.method).model == "draft":
        check_model_source(speculative_config.model or "")  # a missing draft fails now, not after the target loads
    target_runtime = runtime
    if runtime == "auto" and speculative_config is not None and get_method(speculative_config.method).model == "heads":
        target_runtime = "transformers"
    batch = max_num_seqs > 1
    if batch and speculative_config is not None and speculative_config.method not in BATCHED_METHODS:
        logger.warning("method %r does not run in the batched engine (batched: %s); serving one request at a time",
                       speculative_config.method, ", ".join(BATCHED_METHODS))
        batch = False
    if kv_cache_memory is None:
        kv_cache_memory = default_kv_cache_memory()
    target_model = load_model(target, device=device, dtype=dtype, max_context=max_context,
                              quantization=quantization, backend=backend, threads=threads, runtime=target_runtime,
                              num_slots=max_num_seqs if batch else 1,
                              rows_per_pass=target_rows_per_pass(speculative_config))
    options = BuildOptions(device=device, dtype=dtype, quantization=quantization, backend=backend, threads=threads,
                           runtime=runtime)
    if batch and not isinstance(target_model.backend, LeanCausalLM):
        logger.warning("continuous batching needs the lean runtime (int8 on the CPU, a Llama-family model); "
                       "%s runs one request at a time", target_model.name)
        batch = False
    if batch:
        if speculative_config is not None and speculative_config.catch_up != DEFAULT_CATCH_UP:
            logger.warning("catch_up %r is AutoK's, which runs one request at a time; the batched engine's "
                           "load-aware K ignores it", speculative_config.catch_up)
        core, draft = build_batched_engine(target_model, speculative_config, options, max_num_seqs=max_num_seqs,
                                           max_num_batched_tokens=max_num_batched_tokens,
                                           prefix_cache=PrefixCache(kv_cache_memory))
    else:
        core, draft = _one_slot_engine(target_model, speculative_config, options, PrefixCache(kv_cache_memory))
    if threads is None and follow_free_cpus:
        core.threads = thread_governor(target_model, draft)
    return EngineBundle(target=target_model, core=core, speculative_config=speculative_config, draft=draft)


def thread_governor(target: LoadedModel, draft: LoadedModel | None) -> ThreadGovernor | None:
    """The compute threads that follow the CPUs other processes leave free (:mod:`draftwise.cpu_share`), or None
    when nothing may follow them (one CPU, or a target whose threads must stay fixed).

    Torch's threads follow the load when the target's logits were checked not to depend on the thread count
    (:meth:`~draftwise.backends.lean.model.LeanLlama.check_thread_invariance` on its real weights, run here), or
    when the target does not compute with torch (llama.cpp); a draft model's llama.cpp threads always may (a
    proposer never decides the output). A llama.cpp or transformers target keeps its threads.
    """
    from draftwise.backends.llama_cpp_backend import default_threads
    from draftwise.cpu_share import ThreadGovernor

    cpus = default_threads()
    if cpus < 2:
        return None
    setters: list[Callable[[int], object]] = []
    names: list[str] = []
    backend = target.backend
    if isinstance(backend, LeanCausalLM) and backend.device.type == "cpu":
        if backend.model.check_thread_invariance():
            setters.append(torch.set_num_threads)
            names.append("torch: the target's logits checked equal on 1 and all threads")
        else:
            logger.info("%s: the logits depend on the torch thread count on this machine; its %d threads stay fixed",
                        target.name, torch.get_num_threads())
    elif isinstance(backend, LlamaCppCausalLM) and draft is not None and draft.backend.device.type == "cpu" \
            and not isinstance(draft.backend, LlamaCppCausalLM):
        setters.append(torch.set_num_threads)
        names.append("torch: the draft's")
    if draft is not None and isinstance(draft.backend, LlamaCppCausalLM):
        setters.append(draft.backend.set_threads)
        names.append("llama.cpp: the draft's")
    if not setters:
        return None
    return ThreadGovernor(cpus, setters, names=names)


def _one_slot_engine(target: LoadedModel, config: SpeculativeConfig | None, options: BuildOptions,
                     prefix_cache: PrefixCache) -> tuple[EngineCore, LoadedModel | None]:
    """An engine core of one slot (:func:`~draftwise.engine.one_slot_core`) for a loaded target and a speculative
    config (None: plain decoding), with each request's own K policy (:func:`per_request_k`); returns it and the
    draft model it loaded (if any)."""
    if config is None:
        return one_slot_core(target.backend, eos_token_ids=target.eos_token_ids, prefix_cache=prefix_cache), None
    proposer, draft = build_proposer(config, target, device=options.device, dtype=options.dtype,
                                     quantization=options.quantization, backend=options.backend,
                                     threads=options.threads, runtime=options.runtime)
    controller_factory = per_request_k(config, target, proposer, draft)
    core = one_slot_core(target.backend, proposer, config.num_speculative_tokens, target.eos_token_ids,
                         controller_factory=controller_factory, prefix_cache=prefix_cache)
    return core, draft


def per_request_k(config: SpeculativeConfig, target: LoadedModel, proposer: Proposer | SequenceProposer,
                  draft: LoadedModel | None) -> Callable[[], KController]:
    """``k_policy`` on an engine of one slot: each request's own :class:`~draftwise.speculation.controller.KController`.

    ``"fixed"``: always K. ``"auto"``: :class:`~draftwise.speculation.controller.AutoK` on the cost model of the target and
    the draft (:func:`draftwise.speculation.calibration.calibrate_cost_model`, cached per model and machine), with what the
    engine's requests learn carried to the next. On an engine of many slots ``"auto"`` is instead the load-aware
    plan for the batch (:func:`draftwise.speculation.cost_model.plan_batch_k`, :class:`~draftwise.engine.core.EngineCore`'s
    ``k_policy``): the two answer the same question, the K with the most committed tokens per second, but AutoK
    also defers a draft model's catch-up after plain steps (``catch_up``, a ski-rental rule) and learns one
    request's costs, which the batch plan does not (see ``docs/batching.md``).
    """
    from draftwise.speculation.calibration import calibrate_cost_model
    from draftwise.speculation.controller import k_controller_factory

    max_k = config.num_speculative_tokens
    cost_model = None
    if config.k_policy == "auto":
        cost_model = calibrate_cost_model(  # cached per model and machine after the first run
            target.backend, max_k, draft=draft.backend if draft else None, proposer=proposer
        )
    return k_controller_factory(config.k_policy, max_k, cost_model, prior_strength=_prior_strength(config),
                                catch_up=config.catch_up)


def _prior_strength(config: SpeculativeConfig) -> float:
    """AutoK's acceptance-prior weight: :data:`~draftwise.speculation.controller.MODEL_PRIOR_STRENGTH` for the methods that
    run a draft model, 1 otherwise."""
    from draftwise.speculation.controller import MODEL_PRIOR_STRENGTH

    return MODEL_PRIOR_STRENGTH if get_method(config.method).model == "draft" else 1.0


# ---------------------------------------------------------------------------------------------- batched engine
def build_batched_engine(
    target: LoadedModel,
    config: SpeculativeConfig | None,
    options: BuildOptions,
    *,
    max_num_seqs: int,
    max_num_batched_tokens: int = 256,
    prefix_cache: PrefixCache | None = None,
) -> tuple[EngineCore, LoadedModel | None]:
    """A :class:`EngineCore` for a loaded lean target (with ``max_num_seqs`` slots) and a speculative config
    (None: plain decoding); returns it and the draft model it loaded (if any). ``config.k_policy == "auto"``
    gives the load-aware K (the pass costs are measured here, a few passes).

    Raises:
        ValueError: a method outside :data:`BATCHED_METHODS`, a target not on the lean runtime, a draft model
            neither on the lean runtime nor on llama.cpp.
        ModelLoadError, TokenizerMismatchError: see :func:`draftwise.builder.load_draft_model`.
    """
    backend = target.backend
    if not isinstance(backend, LeanCausalLM):
        raise ValueError(f"{target.name}: the batched engine needs a target on the lean runtime")
    common = dict(eos_token_ids=target.eos_token_ids, max_num_seqs=max_num_seqs,
                  max_num_batched_tokens=max_num_batched_tokens, prefix_cache=prefix_cache)
    if config is None:
        return EngineCore(backend, **common), None
    if config.method not in BATCHED_METHODS:
        raise ValueError(f"method {config.method!r} does not run in the batched engine (batched: "
                         f"{', '.join(BATCHED_METHODS)})")
    draft = None
    if config.method == "ngram":
        from draftwise.proposers.ngram import NgramProposer

        low, high = config.prompt_lookup_min, config.prompt_lookup_max
        proposer: Proposer = PerSequenceProposers(lambda: NgramProposer(low, high), "ngram")
    elif config.method == "suffix":
        proposer = _suffix_proposers(config)
    else:
        draft = load_draft_model(config, target, options, num_slots=max_num_seqs)
        llama_slots = isinstance(draft.backend, LlamaCppCausalLM) and draft.backend.num_slots >= max_num_seqs
        if not (isinstance(draft.backend, LeanCausalLM) or llama_slots):
            raise ValueError(f"{draft.name}: a draft model in the batched engine needs the lean runtime or "
                             "llama.cpp (--quantization int8 on the CPU and a Llama-family model, or a .gguf draft "
                             "with --speculative-backend llama.cpp or auto)")
        proposer = _draft_model(config, backend, draft, slot_per_sequence=True)
        if config.method == "hybrid":
            proposer = _hybrid(config, backend, draft, proposer, _suffix_factory(config))
    engine = EngineCore(backend, proposer, config.num_speculative_tokens, k_policy=config.k_policy, **common)
    return engine, draft


def _suffix_proposers(config: SpeculativeConfig) -> PerSequenceProposers:
    """One suffix proposer per sequence (:func:`_suffix_factory`)."""
    return PerSequenceProposers(_suffix_factory(config), "suffix")


def _suffix_factory(config: SpeculativeConfig) -> Callable[[], SuffixProposer]:
    """Makes one suffix proposer per sequence (chains, or trees with ``suffix_decoding_tree_width`` > 1: the lean
    multi-slot backend verifies several sequences' trees in one pass), all sharing one cross-request index (per
    scope)."""
    from draftwise.proposers.suffix import SuffixCache, suffix_proposer_from_config

    shared = SuffixCache(config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_cached_requests,
                         config.suffix_decoding_max_cached_tokens)

    def make() -> SuffixProposer:
        proposer = suffix_proposer_from_config(config, supports_tree=True)
        proposer.cache = shared
        return proposer

    return make
