"""Measuring what a forward pass costs on this machine.

The speed-up of speculative decoding depends on two measured quantities (Leviathan et al. 2023, Sec. 3.4):
- the verify-cost curve ``v_k``: target forward time over k new tokens divided by one token's (k = 1..);
- the cost ratio ``c``: the proposer's time per drafted token divided by one target token's time.
With acceptance rate alpha, the expected speed-up of K draft tokens per step is
``(1 - alpha^(K+1)) / ((1 - alpha) * (K * c + v_(K+1)))``.

:class:`CostModel` holds the same quantities in seconds for the adaptive K controller
(:class:`draftwise.controller.AutoK`). :func:`calibrate_cost_model` measures it once and caches the target's
verify-cost curve and a draft model's one-token cost as JSON under ``draftwise_home()/calibration/``, keyed by
model identity, dtype, device and machine (platform, CPU count, torch version and threads), so start-up
stays quick after the first run.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import re
import statistics
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from draftwise.backends.base import CausalLM
from draftwise.config import SamplingParams
from draftwise.models.pull import draftwise_home
from draftwise.proposers.base import Proposer
from draftwise.sampling import Sampler

__all__ = [
    "ForwardCosts",
    "measure_forward_costs",
    "predicted_speedup",
    "CostModel",
    "calibrate_cost_model",
    "cached_forward_costs",
    "calibration_dir",
    "backend_identity",
    "machine_identity",
    "measure_proposer_seconds_per_token",
    "monotone_fit",
]

logger = logging.getLogger(__name__)

CACHE_SCHEMA = 1  # bump when the cached JSON layout or the measuring method changes


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
    def from_dict(cls, data: dict) -> ForwardCosts:
        """Inverse of :meth:`to_dict` (``relative`` is recomputed). Raises KeyError/ValueError on bad data."""
        seconds = {int(k): float(v) for k, v in data["seconds"].items()}
        if 1 not in seconds or any(v <= 0 for v in seconds.values()):
            raise ValueError("forward costs need a positive 1-token time")
        return cls(seconds=seconds, context_len=int(data["context_len"]))


def measure_forward_costs(
    backend: CausalLM, ks: Iterable[int], *, context_len: int = 200, repeats: int = 5, warmup: int = 1
) -> ForwardCosts:
    """Time forward passes of k new tokens on top of a ``context_len``-token cache, median of ``repeats``.

    Token ids are arbitrary but valid; the cache is rolled back between passes and reset at the end. The ks
    are timed round-robin (k = 1, 2, ..., 1, 2, ...), so a burst of load on the machine affects all of them
    alike rather than one k.

    Raises:
        ContextOverflowError: if ``context_len + max(ks)`` exceeds the model's context.
    """
    samples = _time_forward_passes(backend, ks, context_len=context_len, repeats=repeats, warmup=warmup)
    return ForwardCosts(seconds={k: statistics.median(t) for k, t in samples.items()}, context_len=context_len)


def _time_forward_passes(
    backend: CausalLM, ks: Iterable[int], *, context_len: int, repeats: int, warmup: int
) -> dict[int, list[float]]:
    """``{k: [seconds of each timed pass]}`` (see :func:`measure_forward_costs`)."""
    ks = sorted(set(ks) | {1})
    vocab = backend.vocab_size
    context = [(7 + 31 * i) % vocab for i in range(context_len)]
    backend.reset()
    backend.forward(context, num_logits=1)
    samples: dict[int, list[float]] = {k: [] for k in ks}
    for rep in range(warmup + repeats):
        for k in ks:
            new = [(11 + 17 * i) % vocab for i in range(k)]
            t0 = time.perf_counter()
            backend.forward(new)
            elapsed = time.perf_counter() - t0
            backend.rollback(context_len)
            if rep >= warmup:
                samples[k].append(elapsed)
    backend.reset()
    return samples


def predicted_speedup(alpha: float, k: int, cost_ratio: float, verify_cost: float) -> float:
    """Expected speed-up over plain decoding (Leviathan et al. 2023, Theorem 3.8 with a measured verify cost).

    Args:
        alpha: per-token acceptance rate in [0, 1].
        k: draft tokens per step (K).
        cost_ratio: c, proposer time per draft token / target time per token.
        verify_cost: target time of the (K + 1)-token verification pass / one-token pass.
    """
    expected_tokens = float(k + 1) if alpha >= 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return expected_tokens / (k * cost_ratio + verify_cost)


# ---------------------------------------------------------------------------------------------- cost model
@dataclass(frozen=True)
class CostModel:
    """What one speculative step costs, in seconds.

    Attributes:
        verify_seconds: ``verify_seconds[j - 1]`` is the target's forward time over j new tokens
            (j = 1..len); a step with K draft tokens verifies K + 1 tokens. Beyond the measured range the
            curve is extended linearly from its last two points.
        draft_seconds_per_token: the proposer's time per drafted token (a draft model: about one 1-token
            forward of the draft; n-gram lookup: about 0).
        source: where the numbers come from (for reports), e.g. ``"measured"`` or ``"scripted"``.

    Raises:
        ValueError: empty or non-positive verify times, or a negative draft cost.
    """

    verify_seconds: tuple[float, ...]
    draft_seconds_per_token: float = 0.0
    source: str = "scripted"

    def __post_init__(self) -> None:
        object.__setattr__(self, "verify_seconds", tuple(float(v) for v in self.verify_seconds))
        if not self.verify_seconds or min(self.verify_seconds) <= 0:
            raise ValueError(f"verify_seconds must be non-empty and positive, got {self.verify_seconds}")
        if not (self.draft_seconds_per_token >= 0):
            raise ValueError(f"draft_seconds_per_token must be >= 0, got {self.draft_seconds_per_token}")

    @property
    def max_k(self) -> int:
        """The largest K whose verify pass (K + 1 tokens) was measured."""
        return len(self.verify_seconds) - 1

    def verify_cost(self, num_tokens: int) -> float:
        """Seconds of a target forward over ``num_tokens`` (>= 1) new tokens."""
        if num_tokens < 1:
            raise ValueError(f"a verify pass has at least 1 token, got {num_tokens}")
        curve = self.verify_seconds
        if num_tokens <= len(curve):
            return curve[num_tokens - 1]
        slope = max(0.0, curve[-1] - curve[-2]) if len(curve) >= 2 else curve[-1]
        return curve[-1] + slope * (num_tokens - len(curve))

    def step_cost(self, k: int) -> float:
        """Seconds of one step with K draft tokens: ``K * draft_seconds_per_token + verify_cost(K + 1)``."""
        return k * self.draft_seconds_per_token + self.verify_cost(k + 1)

    @classmethod
    def from_forward_costs(
        cls, costs: ForwardCosts, draft_seconds_per_token: float, source: str = "measured"
    ) -> CostModel:
        """Build from a measured curve; its ks must be 1..n without gaps."""
        n = max(costs.seconds)
        missing = [j for j in range(1, n + 1) if j not in costs.seconds]
        if missing:
            raise ValueError(f"forward costs miss token counts {missing}")
        return cls(tuple(costs.seconds[j] for j in range(1, n + 1)), draft_seconds_per_token, source)

    def to_dict(self) -> dict:
        return {"verify_seconds": list(self.verify_seconds), "draft_seconds_per_token": self.draft_seconds_per_token,
                "source": self.source}

    @classmethod
    def from_dict(cls, data: dict) -> CostModel:
        return cls(tuple(data["verify_seconds"]), float(data["draft_seconds_per_token"]), str(data.get("source", "")))


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


def backend_identity(backend: CausalLM, *, dtype: str | None = None, device: str | None = None) -> dict:
    """Model identity for the cache key: name, class, vocabulary width, dtype and device.

    ``dtype`` and ``device`` default to the backend's own (``backend.device``, ``backend.model.dtype``) when
    it has them, else ``"unknown"`` / ``"cpu"``.
    """
    model = getattr(backend, "model", None)
    device = device or str(getattr(backend, "device", "cpu"))
    dtype = dtype or str(getattr(model, "dtype", "unknown")).replace("torch.", "")
    return {"name": backend.name, "class": type(backend).__name__, "vocab_size": backend.vocab_size,
            "dtype": dtype, "device": device}


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


def _write_atomic(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".partial")
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(data, handle, indent=2, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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
    path = _cache_path(key, cache_dir or calibration_dir())
    cached = None if refresh else _read_cached(path, key, ks)
    if cached is not None:
        logger.debug("calibration of %s read from %s", backend.name, path)
        return cached
    logger.info("calibrating %s: forward passes of k = %s tokens (once per model and machine)", backend.name, ks)
    samples = _time_forward_passes(backend, ks, context_len=context_len, repeats=repeats, warmup=1)
    costs = ForwardCosts(seconds={k: statistics.median(t) for k, t in samples.items()}, context_len=context_len)
    spread = _max_relative_spread(samples)
    if spread > max_spread:
        logger.warning("calibration of %s is noisy (timings of one pass differ by %.0f%%; is the machine busy?): "
                       "using it for this run without caching it", backend.name, 100 * spread)
        return costs
    try:
        _write_atomic(path, {"key": key, "forward_costs": costs.to_dict()})
    except OSError as exc:
        logger.warning("could not cache calibration at %s: %s", path, exc)
    return costs


def _max_relative_spread(samples: dict[int, list[float]]) -> float:
    """Largest (max - min) / median over the ks' repeated timings (0 with fewer than 2 repeats)."""
    spreads = [(max(t) - min(t)) / statistics.median(t) for t in samples.values() if len(t) >= 2 and min(t) > 0]
    return max(spreads, default=0.0)


def measure_proposer_seconds_per_token(
    proposer: Proposer, vocab_size: int, *, k: int = 4, context_len: int = 200, repeats: int = 20
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


def calibrate_cost_model(
    target: CausalLM,
    max_k: int,
    *,
    draft: CausalLM | None = None,
    proposer: Proposer | None = None,
    dtype: str | None = None,
    device: str | None = None,
    context_len: int = 200,
    repeats: int = 5,
    cache_dir: Path | None = None,
) -> CostModel:
    """Measure (or read from the cache) the costs :class:`draftwise.controller.AutoK` needs.

    - verify curve: the target's forward time over j = 1..max_k + 1 tokens, made non-decreasing in j
      (:func:`monotone_fit`: a pass over more tokens never costs less; dips are timing noise);
    - draft cost per token: a draft model's one-token forward time (cached like the target's), else the
      model-free ``proposer``'s measured time per drafted token, else 0.

    Args:
        target: the target backend.
        max_k: the largest K the controller may choose (>= 1).
        draft: the draft model backend for the draft-model method.
        proposer: a model-free proposer to time when there is no draft model.
        dtype, device, context_len, repeats, cache_dir: see :func:`cached_forward_costs`.

    Raises:
        ValueError: max_k < 1 or a context too short for the timing passes.
    """
    if max_k < 1:
        raise ValueError(f"max_k must be >= 1, got {max_k}")
    options = dict(dtype=dtype, device=device, context_len=context_len, repeats=repeats, cache_dir=cache_dir)
    verify = cached_forward_costs(target, range(1, max_k + 2), **options)
    if draft is not None:
        draft_cost = cached_forward_costs(draft, [1], **options).seconds[1]
    elif proposer is not None:
        draft_cost = measure_proposer_seconds_per_token(proposer, target.vocab_size, k=max_k)
    else:
        draft_cost = 0.0
    curve = monotone_fit([verify.seconds[j] for j in range(1, max_k + 2)])
    model = CostModel(tuple(curve), draft_cost, source="measured")
    logger.info("cost model for %s: verify %s s, draft %.2e s/token", target.name,
                ", ".join(f"{v:.4f}" for v in model.verify_seconds), draft_cost)
    return model
