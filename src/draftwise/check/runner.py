"""``check_pair``: will this draft help this target, and what will it cost?

Order matters: the cheap checks that can rule a pair out run before any weights are loaded.

1. describe both models from their headers/configs (:mod:`draftwise.check.describe`);
2. tokenizer compatibility (:mod:`draftwise.check.tokenizer`): a mismatch stops here;
3. memory at the configured dtype, context length and concurrency (:mod:`draftwise.check.memory`): a pair
   that does not fit stops here;
4. load both models, time forward passes, run the acceptance probe, predict the speed-up per K and give
   the verdict (:mod:`draftwise.check.probe`, :mod:`draftwise.check.verdict`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from draftwise.backends.torch_backend import default_device
from draftwise.benchmark import BenchPrompt
from draftwise.check.describe import ModelDescription, describe_model
from draftwise.check.memory import available_memory, dtype_bytes, estimate_memory
from draftwise.check.probe import measure_costs, predict_speedups, run_acceptance_probe
from draftwise.check.report import CheckReport
from draftwise.check.tokenizer import compare_tokenizers
from draftwise.check.verdict import speculation_verdict, static_verdict
from draftwise.models.loading import LoadedModel, load_model, parse_dtype

__all__ = ["CheckSettings", "check_models", "check_pair", "load_and_measure", "measure_pair", "static_check"]

logger = logging.getLogger(__name__)

#: Context length (tokens) when neither the user nor the target's config gives one (the backend's default).
FALLBACK_CONTEXT = 2048


@dataclass(frozen=True)
class CheckSettings:
    """How to check a pair.

    Attributes:
        device: ``"cpu"``, ``"cuda"``... (default: CUDA when present). dtype: ``"fp32"``/``"bf16"``/``"fp16"``
            (default: fp32; a draft model on a GPU: bf16).
        memory_budget: bytes available for both models (None: what is free on the device now).
        max_model_len: context length in tokens (None: the target config's).
        max_num_seqs: sequences whose KV caches are held at once.
        measure: load the models and measure (False: tokenizer and memory checks only).
        num_prompts, max_tokens, probe_k: the acceptance probe: prompts, new tokens per prompt, K.
        max_k: predict the speed-up for K = 1..max_k. repeats: timed passes per token count (median).
        chat: apply the target's chat template to the probe prompts when it has one.
        quantization: the weights' mode for both models (:func:`draftwise.models.loading.load_model`'s
            ``quantization``: ``"none"``, ``"int8"``, ``"q4k"`` or ``"auto"``; None: unquantized, as before).
        speculative_backend: the draft's own runtime (``"torch"``, ``"llama.cpp"``, or ``"auto"``: measured,
            see :mod:`draftwise.draft_backend`); None: the target's. The draft is loaded as the engine loads it
            (:func:`draftwise.builder.load_draft_model`), so the costs measured are those a run would see.

    Raises:
        ValueError: out-of-range values.
    """

    device: str | None = None
    dtype: str | None = None
    memory_budget: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 1
    measure: bool = True
    num_prompts: int = 5
    max_tokens: int = 32
    probe_k: int = 4
    max_k: int = 8
    repeats: int = 5
    chat: bool = True
    quantization: str | None = None
    speculative_backend: str | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "num_prompts", "max_tokens", "probe_k", "max_k", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2 tokens, got {self.max_model_len}")
        if self.memory_budget is not None and self.memory_budget < 0:
            raise ValueError(f"memory_budget must be >= 0 bytes, got {self.memory_budget}")


def _resolved_settings(settings: CheckSettings, target: ModelDescription, device: str, dtype: torch.dtype,
                       draft_dtype: torch.dtype) -> dict:
    """The settings with defaults filled in: device, the target's and the draft's dtype (and their bytes per
    element), context length."""
    return {**asdict(settings), "device": device, "dtype": str(dtype).removeprefix("torch."),
            "bytes_per_param": dtype_bytes(dtype), "draft_dtype": str(draft_dtype).removeprefix("torch."),
            "draft_bytes_per_param": dtype_bytes(draft_dtype),
            "context_len": settings.max_model_len or target.context_length or FALLBACK_CONTEXT}


def static_check(target: ModelDescription, draft: ModelDescription, settings: CheckSettings) -> CheckReport:
    """Tokenizer and memory checks, from descriptions only. The verdict is ``incompatible``,
    ``does_not_fit`` or ``not_measured``.

    Raises:
        ValueError: a CUDA device without CUDA (when the budget has to be read from the device).
    """
    device = settings.device or default_device()
    dtype = parse_dtype(settings.dtype, device)
    draft_dtype = parse_dtype(settings.dtype, device, drafting=True)  # bf16 for a draft on a GPU by default
    resolved = _resolved_settings(settings, target, device, dtype, draft_dtype)
    tokenizer = compare_tokenizers(target.tokenizer, draft.tokenizer, target_vocab_width=target.vocab_width,
                                   draft_vocab_width=draft.vocab_width, target_name=target.name,
                                   draft_name=draft.name)
    report = CheckReport(target=target, draft=draft, settings=resolved, tokenizer=tokenizer,
                         verdict=static_verdict("not_measured", "tokenizer and memory checks passed"))
    if not tokenizer.ok:
        report.verdict = static_verdict("incompatible", "; ".join(tokenizer.errors))
        return report
    budget, source = settings.memory_budget, "--memory-budget"
    if budget is None:
        budget, source = available_memory(device) or (None, "")
    report.memory = estimate_memory(target, draft, dtype=dtype, draft_dtype=draft_dtype,
                                    context_len=resolved["context_len"],
                                    num_seqs=settings.max_num_seqs, budget=budget, budget_source=source)
    report.settings["memory_budget"] = budget
    if report.memory.fits is False:
        report.verdict = static_verdict("does_not_fit", report.memory.summary())
    return report


def measure_pair(
    report: CheckReport, target: LoadedModel, draft: LoadedModel, prompts: Sequence[BenchPrompt],
    settings: CheckSettings,
) -> CheckReport:
    """Fill in costs, the acceptance probe, the predictions and the verdict (``report`` is updated)."""
    report.costs = measure_costs(target, draft, settings.max_k, repeats=settings.repeats)
    report.probe = run_acceptance_probe(target, draft, prompts, k=settings.probe_k,
                                        max_tokens=settings.max_tokens, chat=settings.chat)
    alpha = report.probe.token_acceptance  # per-token acceptance, the alpha of Leviathan's formula
    report.predictions = [] if alpha is None else predict_speedups(alpha, report.costs, settings.max_k)
    report.verdict = speculation_verdict(alpha, report.predictions)
    return report


def check_models(
    target: str, draft: str, settings: CheckSettings, on_stage: Callable[[str], None] | None = None
) -> CheckReport:
    """The static half: describe both models (no weights) and run :func:`static_check`.

    Raises:
        ModelLoadError: a model that is missing, not pulled or unreadable.
        ValueError: a CUDA device without CUDA (when the budget has to be read from the device).
    """
    _stage(on_stage, f"reading {target} and {draft} (no weights yet)")
    return static_check(describe_model(target), describe_model(draft), settings)


def load_and_measure(
    report: CheckReport,
    prompts: Sequence[BenchPrompt],
    settings: CheckSettings,
    on_stage: Callable[[str], None] | None = None,
) -> CheckReport:
    """The measured half: load both models as the report's settings say, then :func:`measure_pair`.

    Raises:
        ModelLoadError: a model that cannot be loaded. ValueError: no prompts.
    """
    from draftwise.builder import BuildOptions, load_named_draft

    if not prompts:
        raise ValueError("measuring needs at least one probe prompt")
    target, draft = report.target.name, report.draft.name
    device, dtype = report.settings["device"], report.settings["dtype"]
    quantization = settings.quantization
    how = f"{dtype} on {device}" if quantization in (None, "none") else f"quantization {quantization} on {device}"
    _stage(on_stage, f"loading {target} and {draft} ({how})")
    target_model = load_model(target, device=device, dtype=dtype, quantization=quantization,
                              max_context=report.settings["context_len"])
    if settings.speculative_backend == "auto":
        _stage(on_stage, "measuring the draft's candidate runtimes (cached per machine)")
    # the draft gets the user's --dtype, else its own default (bf16 on a GPU), as serve loads it
    draft_model = load_named_draft(draft, target_model, BuildOptions(device=device, dtype=settings.dtype,
                                                                     quantization=quantization),
                                   settings.speculative_backend)
    report.settings["quantization"] = target_model.quantization
    report.draft_runtime = _draft_runtime(draft_model, settings.speculative_backend)
    _stage(on_stage, f"timing forward passes and probing acceptance on {len(prompts)} prompts")
    return measure_pair(report, target_model, draft_model, prompts, settings)


def _draft_runtime(draft: LoadedModel, requested: str | None) -> str:
    """One line on the runtime the draft was measured on: the measured choice and why (``auto``), else the
    backend it was loaded on and who chose it."""
    if draft.runtime_choice:
        return f"{draft.runtime_choice} (--speculative-backend auto)"
    chosen_by = f"--speculative-backend {requested}" if requested else "the target's runtime"
    return f"{type(draft.backend).__name__}, quantization {draft.quantization} ({chosen_by})"


def check_pair(
    target: str,
    draft: str,
    settings: CheckSettings,
    prompts: Sequence[BenchPrompt] = (),
    on_stage: Callable[[str], None] | None = None,
) -> CheckReport:
    """Check a target + draft pair (names as :func:`draftwise.models.loading.load_model` takes them):
    :func:`check_models`, then, when those checks pass and ``settings.measure`` is set,
    :func:`load_and_measure`.

    Args:
        prompts: the probe prompts (see :func:`draftwise.check.probe.select_probe_prompts`); required
            when measuring.
        on_stage: called with a short description before each slow stage (progress output).

    Raises:
        ModelLoadError: a model that is missing, not pulled or unreadable.
        ValueError: measuring without prompts; a CUDA device without CUDA.
    """
    report = check_models(target, draft, settings, on_stage)
    if report.ok and settings.measure:
        load_and_measure(report, prompts, settings, on_stage)
    return report


def _stage(on_stage: Callable[[str], None] | None, text: str) -> None:
    if on_stage is None:
        logger.info("%s", text)
    else:
        on_stage(text)
