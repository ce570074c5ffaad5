"""Measuring what a forward pass costs on this machine.

The speed-up of speculative decoding depends on two measured quantities (Leviathan et al. 2023, Sec. 3.4):
- the verify-cost curve ``v_k``: target forward time over k new tokens divided by one token's (k = 1..);
- the cost ratio ``c``: the proposer's time per drafted token divided by one target token's time.
With per-token acceptance alpha (:func:`draftwise.speculation.cost_model.token_acceptance`), the expected speed-up
of K draft tokens per step is
``(1 - alpha^(K+1)) / ((1 - alpha) * (K * c + v_(K+1)))``.

:class:`draftwise.speculation.cost_model.CostModel` holds the same quantities in seconds (plus a draft model's
catch-up prefill time and how pass times grow with the context) for the adaptive K controller
(:class:`draftwise.speculation.controller.AutoK`). :func:`calibrate_cost_model` measures it once and caches each timing
as JSON under ``draftwise_home()/calibration/``, keyed by model identity, dtype, device, the backend's timing
settings (llama.cpp threads, flash attention, batch invariance) and machine (platform, CPU count, torch
version and threads), so start-up stays quick after the first run.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import re
import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from draftwise import progress
from draftwise.backends.base import CausalLM
from draftwise.config import SamplingParams
from draftwise.speculation.cost_model import CostModel, predicted_speedup  # re-exported: defined in cost_model
from draftwise.files import draftwise_home, write_json_atomic
from draftwise.proposers.base import SequenceProposer
from draftwise.sampling import Sampler

__all__ = [
    "ForwardCosts",
    "measure_forward_costs",
    "forward_pass_samples",
    "predicted_speedup",
    "CostModel",
    "calibrate_cost_model",
    "cached_forward_costs",
    "calibration_dir",
    "backend_identity",
    "machine_identity",
    "measure_proposer_seconds_per_token",
    "monotone_fit",
    "draft_passes",
    "draft_seconds",
    "prefill_chunk",
]

logger = logging.getLogger(__name__)

CACHE_SCHEMA = 2  # bump when the cached JSON layout or the measuring method changes


@dataclass(frozen=True)
class ForwardCosts:
    """Median forward times (seconds) by number of new tokens, at a fixed context length (tokens)."""

    seconds: dict[int, float]
    context_len: int

    def relative(self, k: int) -> float:
        """``v_k``: time of a k-token pass / time of a 1-token pass."""
        return self.seconds[k] / self.seconds[1]

    def to_dict(self) -> dict:
        return {"context_len": self.context_len, "seconds": {str(k): v for k, v in self.seconds.items()},
                "relative": {str(k): self.relative(k) for k in self.seconds}}

    @classmethod
    def from_samples(cls, samples: dict[int, list[float]], context_len: int) -> ForwardCosts:
        """The medians of :func:`forward_pass_samples`' timings (seconds by k)."""
        return cls(seconds={k: statistics.median(t) for k, t in samples.items()}, context_len=context_len)

    @classmethod
    def from_dict(cls, data: dict) -> ForwardCosts:
        """Inverse of :meth:`to_dict` (``relative`` is recomputed). Raises KeyError/ValueError on bad data."""
        seconds = {int(k): float(v) for k, v in data["seconds"].items()}
        if 1 not in seconds or any(v <= 0 for v in seconds.values()):
            raise ValueError("forward costs need a positive 1-token time")
        return cls(seconds=seconds, context_len=int(data["context_len"]))


def measure_forward_costs(
    backend: CausalLM, ks: Iterable[int], *, context_len: int = 200, repeats: int = 5, warmup: int = 1,
    num_logits: int | None = None,
) -> ForwardCosts:
    """Time forward passes of k new tokens on top of a ``context_len``-token cache, median of ``repeats``.

    Token ids are arbitrary but valid; the cache is rolled back between passes and reset at the end. The ks
    are timed round-robin (k = 1, 2, ..., 1, 2, ...), so a burst of load on the machine affects all of them
    alike rather than one k. ``num_logits``: the rows each pass returns logits for (None: all k, as a
    verification needs; 1: the last, as a draft's catch-up prefill asks, whose LM head over every row and the
    copy of k x vocab logits would otherwise double its measured time).

    Raises:
        ContextOverflowError: if ``context_len + max(ks)`` exceeds the model's context.
    """
    samples = forward_pass_samples(backend, ks, context_len=context_len, repeats=repeats, warmup=warmup,
                                   num_logits=num_logits)
    return ForwardCosts.from_samples(samples, context_len)


def forward_pass_samples(
    backend: CausalLM, ks: Iterable[int], *, context_len: int = 200, repeats: int = 5, warmup: int = 1,
    num_logits: int | None = None,
) -> dict[int, list[float]]:
    """``{k: [seconds of each timed pass]}``, the timings :func:`measure_forward_costs` takes the medians of
    (1 always included): for callers that judge their spread (:func:`draftwise.speculation.measurement.noisy_timings`).

    Raises:
        ContextOverflowError: if ``context_len + max(ks)`` exceeds the model's context.
    """
    return _time_forward_passes(backend, ks, context_len=context_len, repeats=repeats, warmup=warmup,
                                num_logits=num_logits)


def _time_forward_passes(
    backend: CausalLM, ks: Iterable[int], *, context_len: int, repeats: int, warmup: int,
    num_logits: int | None = None,
) -> dict[int, list[float]]:
    """``{k: [seconds of each timed pass]}`` (see :func:`measure_forward_costs`)."""
    ks = sorted(set(ks) | {1})
    vocab = backend.vocab_size
    context = [(7 + 31 * i) % vocab for i in range(context_len)]
    if num_logits is None:  # verification passes: every row's logits
        stage = f"calibrating verify cost k={ks[0]}" + (f"..{ks[-1]}" if len(ks) > 1 else "")
    else:  # e.g. a draft's one-token pass and its catch-up prefill
        stage = f"calibrating forward passes of k={','.join(map(str, ks))} (logits of the last {num_logits} row(s))"
    stage += f" ({context_len} cached)"
    progress.report(stage, model=backend.name, done=0, total=warmup + repeats, unit="rounds")
    backend.reset()
    backend.forward(context, num_logits=1)
    samples: dict[int, list[float]] = {k: [] for k in ks}
    for rep in range(warmup + repeats):
        for k in ks:
            new = [(11 + 17 * i) % vocab for i in range(k)]
            t0 = time.perf_counter()
            backend.forward(new, num_logits=num_logits)
            elapsed = time.perf_counter() - t0
            backend.rollback(context_len)
            if rep >= warmup:
                samples[k].append(elapsed)
        progress.report(stage, model=backend.name, done=rep + 1, total=warmup + repeats, unit="rounds")
    backend.reset()
    return samples


# ---------------------------------------------------------------------------------------------- identities
def machine_identity(device: str = "cpu") -> dict:
    """What makes timings on this machine comparable: OS, CPU, CPU count, torch version and threads, and the
    accelerator's name for a CUDA device."""
    identity = {
        "system": platform.system(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        identity["accelerator"] = torch.cuda.get_device_name(torch.device(device))
    return identity


#: Backend attributes that change its speed, so belong in the cache key when a backend has them
#: (llama.cpp: :class:`draftwise.backends.llama_cpp_backend.LlamaCppCausalLM`).
TIMING_SETTINGS = ("n_threads", "flash_attention", "batch_invariant")


def backend_identity(backend: CausalLM, *, dtype: str | None = None, device: str | None = None) -> dict:
    """Model identity for the cache key: name, class, vocabulary width, dtype, device and the backend's
    timing settings (:data:`TIMING_SETTINGS`: llama.cpp threads, flash attention, batch invariance).

    ``dtype`` and ``device`` default to the backend's own (``backend.device``, ``backend.model.dtype``) when
    it has them, else ``"unknown"`` / ``"cpu"``.
    """
    model = getattr(backend, "model", None)
    device = device or str(getattr(backend, "device", "cpu"))
    dtype = dtype or str(getattr(model, "dtype", "unknown")).replace("torch.", "")
    identity = {"name": backend.name, "class": type(backend).__name__, "vocab_size": backend.vocab_size,
                "dtype": dtype, "device": device}
    settings = {name: getattr(backend, name) for name in TIMING_SETTINGS if hasattr(backend, name)}
    return {**identity, "settings": settings} if settings else identity


def calibration_dir() -> Path:
    """``draftwise_home()/calibration`` (not created here)."""
    return draftwise_home() / "calibration"


def _cache_path(key: dict, cache_dir: Path) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(str(key["model"]["name"])).name)[-48:] or "model"
    return cache_dir / f"{slug}-{digest}.json"


def _read_cached(path: Path, key: dict, ks: Sequence[int]) -> ForwardCosts | None:
    try:
        data = json.loads(path.read_text())
        if data.get("key") != key:
            return None
        costs = ForwardCosts.from_dict(data["forward_costs"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        if path.exists():
            logger.warning("ignoring unreadable calibration cache %s: %s", path, exc)
        return None
    return costs if all(k in costs.seconds for k in ks) else None


# ---------------------------------------------------------------------------------------------- measuring
def cached_forward_costs(
    backend: CausalLM,
    ks: Iterable[int],
    *,
    dtype: str | None = None,
    device: str | None = None,
    context_len: int = 200,
    repeats: int = 5,
    cache_dir: Path | None = None,
    refresh: bool = False,
    max_spread: float = 1.0,
    num_logits: int | None = None,
) -> ForwardCosts:
    """:func:`measure_forward_costs`, cached as JSON per (model, dtype, device, machine, context length).

    A cached entry is used when it holds every requested k; otherwise the backend is measured and the
    entry replaced (atomically). ``context_len`` is lowered to fit the model's context. Delete the JSON file
    under :func:`calibration_dir` (or pass ``refresh``) to measure again, e.g. after the machine changed load.

    Args:
        backend: the model to time (its KV cache is reset).
        ks: token counts to time (1 is always added).
        dtype, device: identity overrides (see :func:`backend_identity`).
        context_len: tokens in the cache under the timed passes.
        repeats: timed passes per k (median).
        cache_dir: default :func:`calibration_dir`.
        refresh: measure even when a cached entry fits.
        max_spread: a measurement whose repeated timings of one k differ by more than this fraction of
            their median ((max - min) / median) is returned but not cached (a busy machine).
        num_logits: logit rows per pass (see :func:`measure_forward_costs`); part of the cache key when set.

    Raises:
        ValueError: if the model's context cannot hold one token plus the largest k.
    """
    ks = sorted(set(ks) | {1})
    context_len = min(context_len, backend.max_context - ks[-1])
    if context_len < 1:
        raise ValueError(f"{backend.name}: context of {backend.max_context} tokens is too short to time {ks[-1]}-token passes")
    model_id = backend_identity(backend, dtype=dtype, device=device)
    key = {"schema": CACHE_SCHEMA, "model": model_id, "machine": machine_identity(model_id["device"]),
           "context_len": context_len}
    if num_logits is not None:
        key["num_logits"] = num_logits
    path = _cache_path(key, cache_dir or calibration_dir())
    cached = None if refresh else _read_cached(path, key, ks)
    if cached is not None:
        logger.debug("calibration of %s read from %s", backend.name, path)
        return cached
    logger.info("calibrating %s: forward passes of k = %s tokens (once per model and machine)", backend.name, ks)
    samples = _time_forward_passes(backend, ks, context_len=context_len, repeats=repeats, warmup=1,
                                   num_logits=num_logits)
    costs = ForwardCosts.from_samples(samples, context_len)
    spread = _max_relative_spread(samples)
    if spread > max_spread:
        logger.warning("calibration of %s is noisy (timings of one pass differ by %.0f%%; is the machine busy?): "
                       "using it for this run without caching it", backend.name, 100 * spread)
        return costs
    try:
        write_json_atomic(path, {"key": key, "forward_costs": costs.to_dict()}, sort_keys=True)
    except OSError as exc:
        logger.warning("could not cache calibration at %s: %s", path, exc)
    return costs


def _max_relative_spread(samples: dict[int, list[float]]) -> float:
    """Largest (max - min) / median over the ks' repeated timings (0 with fewer than 2 repeats)."""
    spreads = [(max(t) - min(t)) / statistics.median(t) for t in samples.values() if len(t) >= 2 and min(t) > 0]
    return max(spreads, default=0.0)


def measure_proposer_seconds_per_token(
    proposer: SequenceProposer, vocab_size: int, *, k: int = 4, context_len: int = 200, repeats: int = 20
) -> float:
    """Median seconds per drafted token of ``proposer.propose`` on a synthetic, periodic context that grows
    by one token per call (a model-free proposer such as n-gram lookup; microseconds, so never cached).

    The proposer's state is left on the synthetic context; stateful proposers re-sync at their next call.
    """
    period = [(13 + 29 * i) % vocab_size for i in range(17)]
    context = [period[i % len(period)] for i in range(context_len)]
    params = SamplingParams()
    sampler = Sampler(params)
    times = []
    for rep in range(repeats + 1):
        context.append(period[len(context) % len(period)])
        t0 = time.perf_counter()
        proposal = proposer.propose(context, k, params, sampler)
        elapsed = time.perf_counter() - t0
        if rep:
            times.append(elapsed / max(1, len(proposal)))
    return statistics.median(times)


def monotone_fit(values: Sequence[float]) -> list[float]:
    """Least-squares non-decreasing fit of a sequence (pool-adjacent-violators, equal weights)."""
    blocks: list[list[float]] = []  # [mean, count]
    for value in values:
        blocks.append([float(value), 1.0])
        while len(blocks) >= 2 and blocks[-2][0] > blocks[-1][0]:
            (m2, c2), (m1, c1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2])
    return [mean for mean, count in blocks for _ in range(int(count))]


#: Tokens in the draft pass timed for its catch-up prefill rate. A catch-up is a whole prompt, and a model's
#: prefill rate grows with the tokens per pass, so the pass timed is prompt-sized rather than a few tokens.
PREFILL_CHUNK_TOKENS = 256
#: Context (tokens) of the second, longer timing that measures how pass times grow with the context.
LONG_CONTEXT_TOKENS = 1024


def calibrate_cost_model(
    target: CausalLM,
    max_k: int,
    *,
    draft: CausalLM | None = None,
    proposer: SequenceProposer | None = None,
    dtype: str | None = None,
    device: str | None = None,
    context_len: int = 200,
    long_context_len: int = LONG_CONTEXT_TOKENS,
    repeats: int = 5,
    cache_dir: Path | None = None,
) -> CostModel:
    """Measure (or read from the cache) the :class:`~draftwise.speculation.cost_model.CostModel` that
    :class:`draftwise.speculation.controller.AutoK` needs.

    - verify curve: the target's forward time over j = 1..max_k + 1 tokens at ``context_len``, made
      non-decreasing in j (:func:`monotone_fit`: a pass over more tokens never costs less; dips are noise);
    - draft cost per token: a draft model's one-token forward time (cached like the target's), else the
      model-free ``proposer``'s measured time per drafted token, else 0;
    - a draft model's catch-up (prefill) time per token: its :func:`prefill_chunk`-token pass (logits of the
      last row only, as a catch-up asks) / that;
    - context growth: the one-token pass times of the target (and the draft model) again at
      ``long_context_len`` tokens (capped by the context length; skipped when not longer than
      ``context_len``), as relative growth per context token.

    Args:
        target: the target backend.
        max_k: the largest K the controller may choose (>= 1).
        draft: the draft model backend for the draft-model method.
        proposer: a model-free proposer to time when there is no draft model.
        long_context_len: context of the growth timing (tokens).
        dtype, device, context_len, repeats, cache_dir: see :func:`cached_forward_costs`.

    Raises:
        ValueError: max_k < 1 or a context too short for the timing passes.
    """
    if max_k < 1:
        raise ValueError(f"max_k must be >= 1, got {max_k}")
    options = dict(dtype=dtype, device=device, repeats=repeats, cache_dir=cache_dir)
    verify = cached_forward_costs(target, range(1, max_k + 2), context_len=context_len, **options)
    draft_cost = prefill_cost = draft_growth = 0.0
    if draft is not None:
        timed = cached_forward_costs(draft, draft_passes(draft, verify.context_len), context_len=verify.context_len,
                                     num_logits=1, **options)
        draft_cost, prefill_cost = draft_seconds(timed)
        draft_growth = _context_growth(draft, timed, long_context_len, options)
    elif proposer is not None:
        draft_cost = measure_proposer_seconds_per_token(proposer, target.vocab_size, k=max_k)
    target_growth = _context_growth(target, verify, long_context_len, options)
    curve = monotone_fit([verify.seconds[j] for j in range(1, max_k + 2)])
    model = CostModel(tuple(curve), draft_cost, "measured", draft_prefill_seconds_per_token=prefill_cost,
                      context_len=verify.context_len, target_context_growth=target_growth,
                      draft_context_growth=draft_growth)
    logger.info("cost model for %s: verify %s s, draft %.2e s/token, draft prefill %.2e s/token, growth per "
                "context token %.1e (target) %.1e (draft)", target.name,
                ", ".join(f"{v:.4f}" for v in model.verify_seconds), draft_cost, prefill_cost, target_growth,
                draft_growth)
    return model


def draft_passes(draft: CausalLM, context_len: int) -> list[int]:
    """The passes (tokens each) a draft model is timed on above ``context_len`` cached tokens, with the logits of
    the last row only (as drafting and catch-up ask for them): one token (its drafting cost) and a
    :func:`prefill_chunk` (its catch-up rate). :func:`draft_seconds` reads the costs from their timings; both
    :func:`calibrate_cost_model` and ``draftwise bench``'s calibration time a draft this way."""
    return [1, prefill_chunk(draft, context_len)]


def draft_seconds(timed: ForwardCosts) -> tuple[float, float]:
    """``(one-token pass seconds, catch-up seconds per prompt token)`` from a draft's timing of
    :func:`draft_passes` (the prefill pass is the longest one timed).

    Raises:
        KeyError: ``timed`` has no one-token pass.
    """
    chunk = max(timed.seconds)
    return timed.seconds[1], timed.seconds[chunk] / chunk


def prefill_chunk(draft: CausalLM, context_len: int) -> int:
    """Tokens of the pass that times ``draft``'s prefill rate on top of ``context_len`` cached ones:
    :data:`PREFILL_CHUNK_TOKENS`, fewer where the model's context cannot hold them (at least 1)."""
    return min(PREFILL_CHUNK_TOKENS, max(1, draft.max_context - context_len - 1))


def _context_growth(backend: CausalLM, short: ForwardCosts, long_context_len: int, options: dict) -> float:
    """Relative growth of the one-token pass time per context token between ``short.context_len`` and
    ``long_context_len`` (capped by the backend's context); 0 when that is not longer."""
    long_context_len = min(long_context_len, backend.max_context - 2)
    if long_context_len <= short.context_len:
        return 0.0
    long = cached_forward_costs(backend, [1], context_len=long_context_len, **options)
    ratio = long.seconds[1] / short.seconds[1]
    return max(0.0, (ratio - 1.0) / (long.context_len - short.context_len))
