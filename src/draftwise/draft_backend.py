"""``--speculative-backend auto``: the draft model on the backend that decodes it fastest on this machine,
found by measurement.

The output does not depend on the draft's numerics (verification accepts a draft token only when it is the
target's own choice, and rejection sampling is lossless for any draft distribution), so the draft may run on
whatever is fastest: the lean PyTorch runtime or llama.cpp on the GGUF file as it is. Neither is assumed. At
load, each candidate decodes one token at a time on the draft's real weights on top of ``context`` tokens
(seconds per token, the best of a few), and the faster one is kept. Each candidate's prefill rate (one pass
over ``context`` tokens) is measured and reported beside it: a draft catches up on the whole prompt once per
request, and a backend that decodes fast may prefill slowly (``docs/draft_trees.md``: llama.cpp's 0.5B draft
decodes in half the lean runtime's time and prefills at half its rate here). The choice is cached per draft file and
machine (CPU model and flags, torch and llama-cpp-python versions, threads, quantization) under
``draftwise_home()/draft_backends/``, like the kernel self-test, so later loads measure nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from draftwise import progress
from draftwise.files import draftwise_home, write_json_atomic
from draftwise.machine import cpu_flags, cpu_model_name

__all__ = ["DraftBackendChoice", "choose_draft_backend", "draft_backend_cache_dir", "prefill_seconds_per_token",
           "seconds_per_token"]

logger = logging.getLogger(__name__)

CACHE_SCHEMA = 2
#: context (tokens) the candidates decode on top of, and one-token passes timed per candidate
CONTEXT_TOKENS = 256
TIMED_TOKENS = 8


@dataclass(frozen=True)
class DraftBackendChoice:
    """The draft backend ``--speculative-backend auto`` picked.

    Attributes:
        backend: ``"torch"`` or ``"llama.cpp"``.
        seconds_per_token: measured one-token decode time per candidate (seconds).
        context: tokens the timed passes ran on top of.
        prefill_seconds_per_token: measured prefill time per prompt token per candidate (seconds; one pass over
            ``context`` tokens; empty when not measured).
        reason: one line saying what was measured and chosen.
        cached: the choice came from the cache (nothing measured now).
    """

    backend: str
    seconds_per_token: dict[str, float]
    context: int
    reason: str
    cached: bool = False
    prefill_seconds_per_token: dict[str, float] = field(default_factory=dict)


def draft_backend_cache_dir() -> Path:
    """``draftwise_home()/draft_backends`` (not created here)."""
    return draftwise_home() / "draft_backends"


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
            "torch_threads": torch.get_num_threads(), "quantization": quantization, "context": CONTEXT_TOKENS}


def choose_draft_backend(path: str, load: Callable[[str], object], *, threads: int | None,
                         quantization: str | None, cache_dir: Path | None = None,
                         measure: Callable[[object], float] = seconds_per_token,
                         measure_prefill: Callable[[object], float] = prefill_seconds_per_token,
                         ) -> tuple[DraftBackendChoice, object]:
    """Load the GGUF draft ``path`` on each candidate backend, time it, keep the one that decodes fastest (its
    prefill rate is reported, not weighed: how long the prompts are is not known at load).

    Args:
        path: the draft's ``.gguf`` file.
        load: ``backend name -> LoadedModel`` (``"torch"`` or ``"llama.cpp"``).
        threads, quantization: the load options that change the speed (part of the cache key).
        cache_dir: where choices are cached (default :func:`draft_backend_cache_dir`).
        measure: ``CausalLM -> seconds per token`` (default :func:`seconds_per_token`).
        measure_prefill: ``CausalLM -> prefill seconds per token`` (default :func:`prefill_seconds_per_token`).

    Returns:
        ``(choice, loaded draft on the chosen backend)``.

    Raises:
        ModelLoadError, ValueError: a candidate fails to load (both did).
    """
    cache_dir = cache_dir or draft_backend_cache_dir()
    key = _cache_key(path, threads, quantization)
    cache_file = cache_dir / (hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24] + ".json")
    cached = _read(cache_file, key)
    if cached is not None:
        logger.info("draft backend (auto, cached): %s", cached.reason)
        progress.report(f"draft backend (auto, cached): {cached.reason}")
        return cached, load(cached.backend)
    timings: dict[str, float] = {}
    prefill: dict[str, float] = {}
    models: dict[str, object] = {}
    errors: dict[str, str] = {}
    for backend in ("torch", "llama.cpp"):
        progress.report(f"draft backend (auto): timing the draft on {backend}")
        try:
            model = load(backend)
        except Exception as exc:  # noqa: BLE001 - a candidate this machine cannot run
            errors[backend] = f"{type(exc).__name__}: {exc}"
            continue
        timings[backend] = measure(model.backend)
        prefill[backend] = measure_prefill(model.backend)
        models[backend] = model
        if len(models) == 2:  # keep only the faster one loaded
            slower = max(timings, key=timings.get)
            models.pop(slower)
    if not timings:
        raise ValueError("no draft backend could load the draft: " + "; ".join(f"{b}: {e}" for b, e in errors.items()))
    chosen = min(timings, key=timings.get)
    measured = ", ".join(f"{b} {s * 1e3:.1f} ms" for b, s in sorted(timings.items(), key=lambda kv: kv[1]))
    skipped = "".join(f"; {b} unavailable ({e})" for b, e in errors.items())
    rates = ", ".join(f"{b} {1 / s:.0f} tok/s" for b, s in sorted(prefill.items(), key=lambda kv: kv[1]) if s > 0)
    reason = (f"{chosen}: one draft token on top of {CONTEXT_TOKENS} tokens took {measured}{skipped}; "
              f"prefill of {CONTEXT_TOKENS} tokens {rates} (measured on {cpu_model_name()})")
    choice = DraftBackendChoice(chosen, timings, CONTEXT_TOKENS, reason, prefill_seconds_per_token=prefill)
    if len(timings) == 2:  # a choice between two measured candidates is worth keeping
        try:
            write_json_atomic(cache_file, {"key": key, "choice": asdict(choice)})
        except OSError as exc:  # an unwritable cache costs a measurement next time, not this load
            logger.warning("could not cache the draft backend choice in %s: %s", cache_file, exc)
    logger.info("draft backend (auto, measured): %s", reason)
    progress.report(f"draft backend (auto, measured): {reason}")
    return choice, models[chosen]


def _read(path: Path, key: dict) -> DraftBackendChoice | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if data.get("key") != key:
        return None
    try:
        return DraftBackendChoice(**{**data["choice"], "cached": True})
    except (KeyError, TypeError):
        return None
