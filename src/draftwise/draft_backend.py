"""``--speculative-backend auto``: the draft model on the runtime that decodes it fastest on this machine, found
by measurement.

The output does not depend on the draft's numerics (verification accepts a draft token only when it is the
target's own choice, and rejection sampling is lossless for any draft distribution), so the draft may run on
whatever is fastest. The candidates (:func:`draft_candidates`): the lean PyTorch runtime, llama.cpp on the GGUF
file as it is, and llama.cpp on copies re-quantized to Q4_0 (:func:`draftwise.backends.llama_cpp_backend.
requantize_gguf`; llama.cpp repacks Q4_0 for its fastest CPU kernels), one with llama.cpp's own choice for the
LM head (Q8_0 for a 896-wide head) and one with a Q4_0 head too (a small draft's head is a large share of the
bytes it reads per token). None is assumed faster. At load, each
candidate decodes one token at a time on the draft's real weights on top of ``context`` tokens (seconds per
token, the best of a few), and the fastest is kept. A re-quantized copy must also agree with the file as it is:
it must predict the same next token at :data:`MIN_AGREEMENT` of the positions of a fixed probe text, or it is
measured and reported but not chosen (a copy that guesses differently would lose in acceptance what it gains in
speed). Each candidate's prefill rate (one pass over ``context`` tokens) is reported beside it: a draft catches
up on the whole prompt once per request (``docs/draft_trees.md``). The choice, and the re-quantized copy, are
cached per draft file and machine (CPU model and flags, torch and llama-cpp-python versions, threads,
quantization, the GGUF kernels' source) under ``draftwise_home()/draft_backends/``, like the kernel self-test, so
later loads measure nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from draftwise import progress
from draftwise.files import draftwise_home, write_json_atomic
from draftwise.machine import cpu_flags, cpu_model_name

__all__ = ["Candidate", "DraftBackendChoice", "choose_draft_backend", "draft_backend_cache_dir", "draft_candidates",
           "prefill_seconds_per_token", "probe_predictions", "seconds_per_token", "MIN_AGREEMENT"]

logger = logging.getLogger(__name__)

CACHE_SCHEMA = 4
#: context (tokens) the candidates decode on top of, and one-token passes timed per candidate
CONTEXT_TOKENS = 256
TIMED_TOKENS = 8
#: share of the probe's positions where a re-quantized copy must predict the as-is draft's next token
MIN_AGREEMENT = 0.9
#: the text whose next-token predictions a re-quantized copy is compared on (code and prose, ~200 tokens)
PROBE_TEXT = '''def moving_average(values, window):
    """Return the averages of every run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    total = sum(values[:window])
    averages = [total / window]
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        averages.append(total / window)
    return averages

The function keeps a running total, so each new average costs one addition and one subtraction instead of a
sum over the whole window. For a list of a million readings and a window of a hundred, that is the difference
between a hundred million additions and two million.
'''
#: GGUF ``general.file_type`` of Q4_0 (a file already in that type gets no plain Q4_0 copy as a candidate)
_Q4_0 = 2


@dataclass(frozen=True)
class Candidate:
    """One way to run the draft.

    Attributes:
        name: how reports call it: ``"torch"``, ``"llama.cpp"``, ``"llama.cpp Q4_0"``, ``"llama.cpp Q4_0, Q4_0 head"``.
        backend: ``"torch"`` or ``"llama.cpp"``.
        file_type: None for the GGUF file as it is; else the type of a re-quantized copy (llama.cpp only).
        head_type: a re-quantized copy's LM head type (None: llama.cpp's choice for ``file_type``).
    """

    name: str
    backend: str
    file_type: str | None = None
    head_type: str | None = None


@dataclass(frozen=True)
class DraftBackendChoice:
    """The draft runtime ``--speculative-backend auto`` picked.

    Attributes:
        backend: ``"torch"`` or ``"llama.cpp"``.
        candidate: the chosen :class:`Candidate`'s name.
        file: the GGUF file the chosen draft loads (the draft itself, or its re-quantized copy).
        seconds_per_token: measured one-token decode time per candidate name (seconds).
        context: tokens the timed passes ran on top of.
        prefill_seconds_per_token: measured prefill time per prompt token per candidate (seconds; one pass over
            ``context`` tokens).
        agreement: per re-quantized candidate, the share of the probe's positions where it predicts the same
            next token as the file as it is on llama.cpp.
        reason: one line saying what was measured and chosen.
        cached: the choice came from the cache (nothing measured now).
    """

    backend: str
    seconds_per_token: dict[str, float]
    context: int
    reason: str
    cached: bool = False
    prefill_seconds_per_token: dict[str, float] = field(default_factory=dict)
    candidate: str = ""
    file: str = ""
    agreement: dict[str, float] = field(default_factory=dict)


def draft_backend_cache_dir() -> Path:
    """``draftwise_home()/draft_backends`` (not created here)."""
    return draftwise_home() / "draft_backends"


def draft_candidates(path: str) -> list[Candidate]:
    """The runtimes to measure for the GGUF draft ``path``: the lean PyTorch runtime, llama.cpp on the file as it
    is, llama.cpp on a Q4_0 copy (unless the file is Q4_0 already) and on a Q4_0 copy with a Q4_0 LM head."""
    found = [Candidate("torch", "torch"), Candidate("llama.cpp", "llama.cpp")]
    from draftwise.backends.llama_cpp_backend import gguf_file_type

    try:
        file_type = gguf_file_type(path)
    except Exception as exc:  # noqa: BLE001 - an unreadable header: the loaders will say what is wrong
        logger.debug("could not read the GGUF file type of %s: %s", path, exc)
        return found
    if file_type != _Q4_0:
        found.append(Candidate("llama.cpp Q4_0", "llama.cpp", "Q4_0"))
    found.append(Candidate("llama.cpp Q4_0, Q4_0 head", "llama.cpp", "Q4_0", "Q4_0"))
    return found


def seconds_per_token(backend, context: int = CONTEXT_TOKENS, tokens: int = TIMED_TOKENS) -> float:
    """Best one-token decode time (seconds) of a :class:`~draftwise.backends.base.CausalLM` on top of
    ``context`` cached tokens (a synthetic prompt of valid ids); leaves its cache empty."""
    context = max(1, min(context, backend.max_context - tokens - 1))
    ids = [(7 * i + 3) % backend.vocab_size for i in range(context)]
    backend.reset()
    try:
        backend.forward(ids, num_logits=1)
        best = float("inf")
        for i in range(tokens):
            t0 = time.perf_counter()
            backend.forward([(11 * i + 5) % backend.vocab_size], num_logits=1)
            best = min(best, time.perf_counter() - t0)
    finally:
        backend.reset()
    return best


def prefill_seconds_per_token(backend, context: int = CONTEXT_TOKENS, passes: int = 2) -> float:
    """Best time (seconds) per token of one prefill pass of ``context`` tokens (a synthetic prompt of valid ids)
    over ``passes`` passes on an empty cache; leaves the cache empty."""
    context = max(1, min(context, backend.max_context - 1))
    ids = [(5 * i + 2) % backend.vocab_size for i in range(context)]
    best = float("inf")
    try:
        for _ in range(passes):
            backend.reset()
            t0 = time.perf_counter()
            backend.forward(ids, num_logits=1)
            best = min(best, time.perf_counter() - t0)
    finally:
        backend.reset()
    return best / context


def probe_predictions(model) -> torch.Tensor:
    """The next token a :class:`~draftwise.models.loading.LoadedModel` predicts at each position of
    :data:`PROBE_TEXT` (one pass): ``[probe tokens]`` int64; leaves its cache empty."""
    ids = model.encode(PROBE_TEXT)[: max(2, model.backend.max_context - 1)]
    backend = model.backend
    backend.reset()
    try:
        return backend.forward(ids).logits.argmax(-1)
    finally:
        backend.reset()


def _llama_cpp_version() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("llama_cpp_python")
    except metadata.PackageNotFoundError:
        return None


def _cache_key(path: str, threads: int | None, quantization: str | None) -> dict:
    stat = Path(path).stat()
    return {"schema": CACHE_SCHEMA, "draft": str(Path(path).resolve()), "size": stat.st_size,
            "mtime_ns": stat.st_mtime_ns, "cpu": cpu_model_name(), "flags": sorted(cpu_flags()),
            "torch": torch.__version__, "llama_cpp": _llama_cpp_version(), "threads": threads,
            "torch_threads": torch.get_num_threads(), "quantization": quantization, "context": CONTEXT_TOKENS,
            "min_agreement": MIN_AGREEMENT, "extension": _extension_key(quantization)}


def _extension_key(quantization: str | None) -> str | None:
    """The GGUF kernels' build key (a hash of their sources; nothing is built) when the lean candidate may run on
    them (``q4k``, ``auto``), so a changed kernel is measured again; None otherwise."""
    if quantization not in ("q4k", "auto"):
        return None
    from draftwise.backends.kernels.q4k import build_key

    return build_key()


def _requantized_copy(path: str, file_type: str, head_type: str | None, folder: Path, threads: int | None,
                      label: str | None = None) -> str:
    """``path`` re-quantized to ``file_type`` (its LM head to ``head_type``, None: llama.cpp's choice) in
    ``folder`` (made once per draft file; reused while it exists); ``label`` names the draft in progress lines."""
    from draftwise.backends.llama_cpp_backend import copy_recipe, requantize_gguf

    stat = Path(path).stat()
    tag = hashlib.sha256(f"{Path(path).resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    recipe = copy_recipe(file_type, head_type)
    copy = folder / f"{Path(path).stem}-{tag}-{recipe}.gguf"
    if not copy.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        progress.report(f"draft backend (auto): re-quantizing the draft to {recipe} ({copy})", model=label or path)
        requantize_gguf(path, copy, file_type, threads=threads, head_type=head_type)
    return str(copy)


def choose_draft_backend(path: str, load: Callable[[str, str], object], *, threads: int | None,
                         quantization: str | None, cache_dir: Path | None = None,
                         candidates: Sequence[Candidate] | None = None,
                         measure: Callable[[object], float] = seconds_per_token,
                         measure_prefill: Callable[[object], float] = prefill_seconds_per_token,
                         predict: Callable[[object], torch.Tensor] = probe_predictions,
                         requantize: Callable[[str, str, str | None], str] | None = None,
                         name: str | None = None) -> tuple[DraftBackendChoice, object]:
    """Load the GGUF draft ``path`` on each candidate runtime, time it, keep the one that decodes fastest among
    those allowed (a re-quantized copy needs :data:`MIN_AGREEMENT` with the file as it is on llama.cpp; prefill
    rates are reported, not weighed: how long the prompts are is not known at load).

    Args:
        path: the draft's ``.gguf`` file.
        load: ``(backend name, GGUF file) -> LoadedModel`` (``"torch"`` or ``"llama.cpp"``).
        threads, quantization: the load options that change the speed (part of the cache key).
        cache_dir: where choices and re-quantized copies are kept (default :func:`draft_backend_cache_dir`).
        candidates: what to measure (default :func:`draft_candidates`).
        measure: ``CausalLM -> seconds per token`` (default :func:`seconds_per_token`).
        measure_prefill: ``CausalLM -> prefill seconds per token`` (default :func:`prefill_seconds_per_token`).
        predict: ``LoadedModel -> [positions]`` next-token ids on the probe (default :func:`probe_predictions`).
        requantize: ``(path, file type, head type or None) -> copy's path`` (default: llama.cpp's quantizer,
            cached in ``cache_dir``).
        name: how progress lines name the draft (the user's spec; default ``path``).

    Returns:
        ``(choice, loaded draft on the chosen runtime)``.

    Raises:
        ValueError: no candidate could load the draft (each one's error is in the message).
    """
    cache_dir = cache_dir or draft_backend_cache_dir()
    label = name or path
    key = _cache_key(path, threads, quantization)
    cache_file = cache_dir / (hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24] + ".json")
    cached = _read(cache_file, key)
    if cached is not None:
        logger.info("draft backend (auto, cached): %s", cached.reason)
        progress.report(f"draft backend (auto, cached): {cached.reason}", model=label)
        return cached, load(cached.backend, cached.file)
    requantize = requantize or (lambda source, file_type, head_type: _requantized_copy(
        source, file_type, head_type, cache_dir / "copies", threads, label))
    measured = _measure_all(path, load, candidates if candidates is not None else draft_candidates(path),
                            measure, measure_prefill, predict, requantize, label)
    choice, model = _decide(measured)
    if len(measured.timings) >= 2:  # a choice between measured candidates is worth keeping
        try:
            write_json_atomic(cache_file, {"key": key, "choice": asdict(choice)})
        except OSError as exc:  # an unwritable cache costs a measurement next time, not this load
            logger.warning("could not cache the draft backend choice in %s: %s", cache_file, exc)
    logger.info("draft backend (auto, measured): %s", choice.reason)
    progress.report(f"draft backend (auto, measured): {choice.reason}", model=label)
    return choice, model


@dataclass
class _Measured:
    """What :func:`choose_draft_backend` measured, by candidate name."""

    timings: dict[str, float] = field(default_factory=dict)
    prefill: dict[str, float] = field(default_factory=dict)
    agreement: dict[str, float] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    kinds: dict[str, str] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    best: tuple[str, object] | None = None  # the fastest allowed candidate so far, still loaded

    def allowed(self, name: str) -> bool:
        return name not in self.agreement or self.agreement[name] >= MIN_AGREEMENT


def _measure_all(path, load, candidates, measure, measure_prefill, predict, requantize, label) -> _Measured:
    """Load, time and (re-quantized ones) probe each candidate; only the fastest allowed one stays loaded."""
    found = _Measured()
    reference: torch.Tensor | None = None  # llama.cpp's predictions on the file as it is
    copies = any(c.file_type is not None for c in candidates)
    for candidate in sorted(candidates, key=lambda c: c.file_type is not None):  # as-is files first
        progress.report(f"draft backend (auto): timing the draft on {candidate.name}", model=label)
        if candidate.file_type is not None and reference is None:
            found.errors[candidate.name] = "nothing to compare it with (llama.cpp could not load the file as it is)"
            continue
        try:
            file = path if candidate.file_type is None else requantize(path, candidate.file_type, candidate.head_type)
            model = load(candidate.backend, file)
        except Exception as exc:  # noqa: BLE001 - a candidate this machine cannot run
            found.errors[candidate.name] = f"{type(exc).__name__}: {exc}"
            continue
        name = candidate.name
        found.timings[name] = measure(model.backend)
        found.prefill[name] = measure_prefill(model.backend)
        found.files[name], found.kinds[name] = file, candidate.backend
        if copies and candidate.backend == "llama.cpp" and candidate.file_type is None:
            reference = predict(model)
        elif candidate.file_type is not None:
            found.agreement[name] = _agreement(predict(model), reference)
        if found.allowed(name) and (found.best is None or found.timings[name] < found.timings[found.best[0]]):
            found.best = (name, model)  # the one loaded before it is let go
    return found


def _agreement(predicted: torch.Tensor, reference: torch.Tensor) -> float:
    """Share of positions where two ``[positions]`` predictions agree (0 when their lengths differ)."""
    if predicted.shape != reference.shape:
        return 0.0
    return int((predicted == reference).sum()) / max(1, reference.numel())


def _decide(found: _Measured) -> tuple[DraftBackendChoice, object]:
    """The choice (and its loaded model) from what was measured, with the line that says why."""
    if found.best is None:
        raise ValueError("no draft backend could load the draft: "
                         + "; ".join(f"{b}: {e}" for b, e in found.errors.items()))
    chosen, model = found.best
    order = sorted(found.timings.items(), key=lambda kv: kv[1])
    measured = ", ".join(f"{b} {s * 1e3:.1f} ms" for b, s in order)
    skipped = "".join(f"; {b} unavailable ({e})" for b, e in found.errors.items())
    rates = ", ".join(f"{b} {1 / s:.0f} tok/s" for b, s in sorted(found.prefill.items(), key=lambda kv: kv[1])
                      if s > 0)
    agreed = "".join(f"; {b} predicts the file's next token at {a:.0%} of probe positions"
                     f"{'' if a >= MIN_AGREEMENT else f' (below {MIN_AGREEMENT:.0%}: not chosen)'}"
                     for b, a in found.agreement.items())
    reason = (f"{chosen}: one draft token on top of {CONTEXT_TOKENS} tokens took {measured}{skipped}; "
              f"prefill of {CONTEXT_TOKENS} tokens {rates}{agreed} (measured on {cpu_model_name()})")
    choice = DraftBackendChoice(found.kinds[chosen], dict(found.timings), CONTEXT_TOKENS, reason,
                                prefill_seconds_per_token=dict(found.prefill), candidate=chosen,
                                file=found.files[chosen], agreement=dict(found.agreement))
    return choice, model


def _read(path: Path, key: dict) -> DraftBackendChoice | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if data.get("key") != key:
        return None
    try:
        choice = DraftBackendChoice(**{**data["choice"], "cached": True})
    except (KeyError, TypeError):
        return None
    return choice if Path(choice.file).is_file() else None  # a removed copy is made (and measured) again
