"""The measured self-test that picks the fastest row-invariant kernel of a mode on this machine, cached."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from draftwise import progress
from draftwise.backends.kernels.invariance import check_row_invariance
from draftwise.backends.kernels.layers import KernelError
from draftwise.backends.kernels.registry import LINEAR_KERNELS, LinearKernel, _check_mode
from draftwise.backends.kernels.settings import (
    _SYNTHETIC_BLOCK_ROWS,
    CACHE_SCHEMA,
    COST_WEIGHTS,
    FULL_CHECK_ROWS,
    INVARIANCE_ROWS,
    KERNEL_ENV,
    LARGE_CALL_SECONDS,
    SLOW_CALL_SECONDS,
    SLOWER_CUTOFF,
    TIMED_ROWS,
)
from draftwise.backends.kernels.shapes import LinearShape, as_shapes
from draftwise.machine import cpu_description, cpu_flags, cpu_model_name, torch_threads

logger = logging.getLogger(__name__)


def _call_seconds(module: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, repeats: int) -> float:
    """Wall time (s) of ``module(x)``: the fastest of ``repeats`` calls after one untimed call. The fastest,
    not the median: on a shared machine noise only adds time (a second OpenMP thread that waits for a core
    adds whole scheduler slices), so the minimum is the machine's figure. A first call longer than
    :data:`SLOW_CALL_SECONDS` is the measurement (noise is small against it; repeats would cost seconds)."""
    t0 = time.perf_counter()
    module(x)
    best = time.perf_counter() - t0
    if best > SLOW_CALL_SECONDS:
        return best
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        module(x)
        best = min(best, time.perf_counter() - t0)
    return best


def _synthetic_layer(shape: LinearShape, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(weight [out, in], bias [out], x [M, in])`` random, weight ~ N(0, 1/in); a large weight repeats a
    random block of :data:`_SYNTHETIC_BLOCK_ROWS` rows (generating 233M normal numbers would take seconds).
    The rows of ``x`` have scales spread over 0.1..10 (per-row activation scales differ); M is the largest
    of :data:`INVARIANCE_ROWS`."""
    out_f, in_f = shape.out_features, shape.in_features
    block = torch.randn(min(out_f, _SYNTHETIC_BLOCK_ROWS), in_f, generator=generator) / math.sqrt(in_f)
    weight = block.repeat(-(-out_f // block.shape[0]), 1)[:out_f].contiguous()
    bias = torch.randn(out_f, generator=generator) * 0.1
    max_rows = max(INVARIANCE_ROWS)
    scales = 10 ** (torch.rand(max_rows, 1, generator=generator) * 2 - 1)
    return weight, bias, torch.randn(max_rows, in_f, generator=generator) * scales


# ------------------------------------------------------------------------------------------------- results
@dataclass(frozen=True)
class KernelTrial:
    """One candidate's self-test: availability, row invariance over every shape (None: not checked),
    parameters per shape and seconds per call (fastest of the repeats) by shape key and row count."""

    name: str
    mode: str
    numerics: str
    available: bool
    invariant: bool | None
    detail: str
    params: Mapping[str, Mapping] = field(default_factory=dict)
    seconds: Mapping[str, Mapping[int, float]] = field(default_factory=dict)
    weight_bytes: int = 0  # stored weight bytes of one forward pass (shapes x counts, scales included)

    def total_seconds(self, m: int, shapes: Sequence[LinearShape]) -> float | None:
        """Seconds of the linear layers of one forward pass over m rows (sum over shapes x count), or None
        when not timed."""
        try:
            return sum(s.count * self.seconds[s.key][m] for s in shapes)
        except KeyError:
            return None

    def cost(self, shapes: Sequence[LinearShape]) -> float | None:
        """The weighted cost (s) that ranks kernels: ``sum_m COST_WEIGHTS[m] * total_seconds(m)``."""
        totals = [self.total_seconds(m, shapes) for m in COST_WEIGHTS]
        if any(t is None for t in totals):
            return None
        return sum(w * t for w, t in zip(COST_WEIGHTS.values(), totals))

    def to_dict(self) -> dict:
        return {"name": self.name, "mode": self.mode, "numerics": self.numerics, "available": self.available,
                "invariant": self.invariant, "detail": self.detail, "params": {k: dict(v) for k, v in self.params.items()},
                "seconds": {k: {str(m): s for m, s in v.items()} for k, v in self.seconds.items()},
                "weight_bytes": self.weight_bytes}

    @classmethod
    def from_dict(cls, data: dict) -> KernelTrial:
        """Inverse of :meth:`to_dict`. Raises KeyError/TypeError/ValueError on malformed data."""
        return cls(name=str(data["name"]), mode=str(data["mode"]), numerics=str(data["numerics"]),
                   available=bool(data["available"]), invariant=data["invariant"], detail=str(data["detail"]),
                   params={k: dict(v) for k, v in data["params"].items()},
                   seconds={k: {int(m): float(s) for m, s in v.items()} for k, v in data["seconds"].items()},
                   weight_bytes=int(data["weight_bytes"]))


@dataclass(frozen=True)
class KernelChoice:
    """The kernel chosen for a quantization mode on this machine, with the self-test that chose it.

    Attributes:
        kernel: the chosen :class:`LinearKernel`.
        mode: its quantization mode.
        require_invariant: whether row invariance was required (False for a draft model).
        shapes: the shapes tested.
        trials: every candidate's :class:`KernelTrial` (the self-test table).
        reason: why this kernel (its cost against the others, the refused ones and why).
        cpu: :func:`cpu_description` of the machine; threads: intra-op threads of the timings.
        selftest_seconds: how long the self-test took when it ran (not on a cache hit).
        load_average: the machine's 1/5/15-minute load average when the self-test started (timings on a
            busy machine are inflated; pass ``refresh=True`` to measure again), None where unknown.
        cached: read from the cache rather than measured now.
    """

    kernel: LinearKernel
    mode: str
    require_invariant: bool
    shapes: tuple[LinearShape, ...]
    trials: tuple[KernelTrial, ...]
    reason: str
    cpu: str
    threads: int
    torch_version: str
    selftest_seconds: float
    load_average: tuple[float, ...] | None = None
    cached: bool = False

    @property
    def name(self) -> str:
        """The chosen kernel's name."""
        return self.kernel.name

    @property
    def trial(self) -> KernelTrial:
        """The chosen kernel's :class:`KernelTrial`."""
        return next(t for t in self.trials if t.name == self.name)

    def params_for(self, out_features: int, in_features: int) -> Mapping:
        """The kernel parameters the self-test found for ``[out, in]``.

        Raises:
            KernelError: the shape was not tested and invariance is required (its parameters, and whether
                the kernel is row-invariant for it, are unknown).
        """
        key = f"{out_features}x{in_features}"
        if key in self.trial.params:
            return self.trial.params[key]
        if self.require_invariant:
            raise KernelError(f"{self.name}: shape {key} was not in the self-test "
                              f"({', '.join(s.key for s in self.shapes)}); select the kernel with every layer shape")
        return self.kernel.variants[0]

    def build(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Module:
        """The linear layer for ``weight [out, in]`` (float) and ``bias [out]`` (or None) with the chosen
        kernel and the parameters found for that shape: ``x [m, in]`` fp32 -> ``[m, out]`` fp32.

        Raises:
            KernelError: an untested shape where invariance is required, or a shape the kernel cannot serve.
        """
        return self.kernel.build(weight, bias, self.params_for(*weight.shape))

    def table_rows(self) -> list[dict]:
        """One dict per candidate: ``kernel``, ``available``, ``invariant`` (True/False/None), ``ms``
        (``{m: ms}`` of one forward pass's linear layers, shapes x counts), ``cost_ms``, ``weight_bytes``,
        ``chosen``, ``detail``, ``params``."""
        rows = []
        for trial in self.trials:
            ms = {m: (None if (t := trial.total_seconds(m, self.shapes)) is None else t * 1e3) for m in TIMED_ROWS}
            cost = trial.cost(self.shapes)
            rows.append({"kernel": trial.name, "available": trial.available, "invariant": trial.invariant, "ms": ms,
                         "cost_ms": None if cost is None else cost * 1e3, "weight_bytes": trial.weight_bytes,
                         "chosen": trial.name == self.name,
                         "detail": trial.detail, "params": dict(trial.params)})
        return rows

    def to_dict(self) -> dict:
        return {"name": self.name, "mode": self.mode, "require_invariant": self.require_invariant,
                "shapes": [[s.out_features, s.in_features, s.count, s.name] for s in self.shapes],
                "trials": [t.to_dict() for t in self.trials], "reason": self.reason, "cpu": self.cpu,
                "threads": self.threads, "torch_version": self.torch_version,
                "selftest_seconds": self.selftest_seconds,
                "load_average": None if self.load_average is None else list(self.load_average)}


# ----------------------------------------------------------------------------------------------- selecting
def kernel_cache_dir() -> Path:
    """``draftwise_home()/kernels`` (not created here)."""
    from draftwise.files import draftwise_home

    return draftwise_home() / "kernels"


def select_linear_kernel(
    mode: str,
    shapes: Iterable[LinearShape | Sequence[int]],
    *,
    threads: int | None = None,
    cache_dir: Path | None = None,
    kernel: str | None = None,
    require_invariant: bool = True,
    candidates: Sequence[LinearKernel] | None = None,
    repeats: int = 3,
    refresh: bool = False,
    check_all: bool = False,
) -> KernelChoice:
    """Choose the linear kernel of a quantization mode for this machine by a short measured self-test.

    On synthetic weights of each shape, candidate by candidate (in :data:`LINEAR_KERNELS` order): time it
    at m = 1, 2, 4, 8, 16 rows (fastest of ``repeats`` calls; stopped once its weighted cost
    :meth:`KernelTrial.cost` exceeds :data:`SLOWER_CUTOFF` times the fastest row-invariant one so far); if it
    is faster than that one, check its row invariance (:func:`check_row_invariance`: m = 1..17, and the
    prefill sizes 32..512 whose predicted call time is within :data:`LARGE_CALL_SECONDS`). The fastest
    row-invariant candidate wins; slower ones are left unchecked (``check_all`` checks them all, for a full
    table). For a kernel with variants, such as ``fp32-mkl-pad``'s row multiple R, the check keeps per shape
    the first row-invariant variant, and the layer is timed again with it. The result is cached (see the
    module docstring); a cache hit measures nothing.

    Args:
        mode: one of :data:`KERNEL_MODES`.
        shapes: the model's linear shapes (:class:`LinearShape` or ``(out, in[, count])``), e.g.
            :func:`llama_linear_shapes` or :func:`model_linear_shapes`.
        threads: intra-op threads for the test (default: torch's current setting); part of the cache key.
        cache_dir: default :func:`kernel_cache_dir`.
        kernel: force this kernel (default: the ``DRAFTWISE_KERNEL`` environment variable, a name or
            comma-separated names of which the one of this mode applies); it is still tested and refused when
            not row-invariant and ``require_invariant``.
        require_invariant: False for a draft model (its output need not be row-invariant): invariance is then
            not checked and each kernel runs its first variant (e.g. no padding).
        candidates: the kernels to consider instead of :data:`LINEAR_KERNELS` (tests).
        repeats: timed calls per row count (the fastest is kept).
        refresh: measure even when a cached result exists.
        check_all: check the invariance of every fully timed candidate, not only of those that could win.

    Returns:
        A :class:`KernelChoice`.

    Raises:
        KernelError: unknown mode or kernel name, a forced kernel of another mode, unavailable, or not
            row-invariant when required; or no candidate of the mode that is available and row-invariant.
        ValueError: no shapes, or malformed ones.
    """
    _check_mode(mode)
    shapes = as_shapes(shapes)
    pool = [k for k in (LINEAR_KERNELS if candidates is None else candidates) if k.mode == mode]
    forced = _forced_kernel(mode, pool, kernel, candidates)
    tested = [forced] if forced is not None else pool
    if not tested:
        raise KernelError(f"no kernel candidates for mode {mode!r}")
    with torch_threads(threads) as n_threads:
        key = _cache_key(mode, shapes, tested, require_invariant, n_threads, check_all)
        path = Path(cache_dir or kernel_cache_dir()) / f"kernels-{mode}-{_digest(key)}.json"
        choice = None if refresh else _read_cached(path, key, tested)
        if choice is None:
            choice = _run_selftest(mode, shapes, tested, require_invariant, n_threads, repeats, forced is not None,
                                   check_all)
            try:
                from draftwise.files import write_json_atomic

                write_json_atomic(path, {"key": key, "choice": choice.to_dict()}, sort_keys=True)
            except OSError as exc:
                logger.warning("could not cache the kernel self-test at %s: %s", path, exc)
        else:
            logger.debug("kernel choice for %s read from %s", mode, path)
    if forced is not None:
        _require_usable(choice.trial, require_invariant)
    return choice


def _forced_kernel(mode: str, pool: Sequence[LinearKernel], kernel: str | None,
                   candidates: Sequence[LinearKernel] | None) -> LinearKernel | None:
    """The kernel forced by ``kernel`` or ``$DRAFTWISE_KERNEL`` for ``mode``, or None.

    Raises:
        KernelError: an explicit ``kernel`` not among the mode's candidates, or an environment value naming
            no known kernel.
    """
    known = {k.name: k for k in (*LINEAR_KERNELS, *(candidates or ()))}
    by_name = {k.name: k for k in pool}
    if kernel is not None:
        if kernel in by_name:
            return by_name[kernel]
        other = f" (it serves mode {known[kernel].mode!r})" if kernel in known else ""
        raise KernelError(f"kernel {kernel!r} is not a {mode!r} kernel{other}; {mode!r} kernels: "
                          f"{', '.join(by_name) or 'none'}")
    names = [n.strip() for n in os.environ.get(KERNEL_ENV, "").split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise KernelError(f"{KERNEL_ENV}={os.environ[KERNEL_ENV]!r}: unknown kernel {unknown[0]!r}; kernels: "
                          f"{', '.join(known)}")
    mine = [n for n in names if n in by_name]
    if len(mine) > 1:
        raise KernelError(f"{KERNEL_ENV} names several {mode!r} kernels: {', '.join(mine)}")
    if names and not mine:
        logger.debug("%s=%s names no %r kernel; choosing by self-test", KERNEL_ENV, os.environ[KERNEL_ENV], mode)
    return by_name[mine[0]] if mine else None


def _require_usable(trial: KernelTrial, require_invariant: bool) -> None:
    """Raise KernelError when a forced kernel is unavailable or (when required) not row-invariant."""
    if not trial.available:
        raise KernelError(f"kernel {trial.name} is not available here: {trial.detail}")
    if require_invariant and not trial.invariant:
        raise KernelError(f"kernel {trial.name} is not row-invariant on this machine ({trial.detail}), so greedy "
                          "speculative decoding would not be exact; choose another kernel, or pass "
                          "require_invariant=False for a draft model")


@dataclass
class _Candidate:
    """Working state of one kernel during a self-test (becomes a :class:`KernelTrial`)."""

    kernel: LinearKernel
    available: bool = True
    invariant: bool | None = None
    detail: str = ""
    params: dict[str, dict] = field(default_factory=dict)
    seconds: dict[str, dict[int, float]] = field(default_factory=dict)
    modules: dict[str, nn.Module] = field(default_factory=dict)  # the timed layer per shape, reused by the check
    timed_out: bool = False  # timing stopped: far slower than a kernel timed before

    def cost(self, shapes: Sequence[LinearShape]) -> float:
        return sum(w * sum(s.count * self.seconds[s.key][m] for s in shapes) for m, w in COST_WEIGHTS.items())

    def trial(self, shapes: Sequence[LinearShape]) -> KernelTrial:
        k = self.kernel
        return KernelTrial(name=k.name, mode=k.mode, numerics=k.numerics, available=self.available,
                           invariant=self.invariant, detail=self.detail, params=self.params, seconds=self.seconds,
                           weight_bytes=sum(s.count * k.stored_bytes(s.out_features, s.in_features) for s in shapes))


def _run_selftest(mode: str, shapes: tuple[LinearShape, ...], kernels: Sequence[LinearKernel],
                  require_invariant: bool, threads: int, repeats: int, forced: bool, check_all: bool) -> KernelChoice:
    """Time each candidate, check the row invariance of those faster than the fastest row-invariant one so
    far (or of all), pick (see :func:`select_linear_kernel`)."""
    started = time.perf_counter()
    load = _load_average()
    logger.info("kernel self-test for mode %s (%d shapes, %d threads; cached after this run) ...",
                mode, len(shapes), threads)
    generator = torch.Generator().manual_seed(0)
    layers = {s.key: _synthetic_layer(s, generator) for s in shapes}
    candidates: list[_Candidate] = []
    stage = f"kernel self-test ({mode}; cached afterwards)"
    progress.report(stage, done=0, total=len(kernels), unit="kernels", estimate=False)
    for kernel in kernels:
        best = _best_cost(candidates, shapes, require_invariant)
        candidate = _time_candidate(kernel, shapes, layers, repeats, SLOWER_CUTOFF * best)
        candidates.append(candidate)
        if require_invariant and candidate.available and not candidate.timed_out and (
                check_all or forced or candidate.cost(shapes) < best):
            _check_candidate(candidate, shapes, layers, repeats)
        candidate.modules.clear()
        progress.report(stage, done=len(candidates), total=len(kernels), unit="kernels", estimate=False)
    for candidate in candidates:
        if require_invariant and candidate.available and not candidate.timed_out and candidate.invariant is None:
            candidate.detail = "invariance not checked: slower than a row-invariant kernel"
    del layers
    trials = tuple(c.trial(shapes) for c in candidates)
    for trial in trials:
        if not trial.available or trial.invariant is False:
            logger.info("kernel %s refused: %s", trial.name, trial.detail)
    chosen, reason = _pick(trials, shapes, require_invariant, forced)
    choice = KernelChoice(kernel=next(k for k in kernels if k.name == chosen.name), mode=mode,
                          require_invariant=require_invariant, shapes=shapes, trials=trials, reason=reason,
                          cpu=cpu_description(), threads=threads, torch_version=torch.__version__,
                          selftest_seconds=time.perf_counter() - started, load_average=load)
    logger.info("kernel for mode %s: %s (self-test %.1f s)", mode, reason, choice.selftest_seconds)
    return choice


@torch.inference_mode()
def _time_layer(module: nn.Module, x: torch.Tensor, repeats: int) -> dict[int, float]:
    """``{m: seconds}`` of ``module`` on the first m rows of ``x``, m in :data:`TIMED_ROWS`."""
    return {m: _call_seconds(module, x[:m], repeats) for m in TIMED_ROWS}


def _time_candidate(kernel: LinearKernel, shapes: Sequence[LinearShape], layers: Mapping[str, tuple],
                    repeats: int, budget: float = math.inf) -> _Candidate:
    """Time a kernel with its first variant on every shape, smallest shapes first (unavailable when it
    cannot run here or a shape). Timing stops once the weighted cost so far exceeds ``budget`` (s): such a
    kernel cannot be chosen, and its slowest calls are not worth waiting for."""
    missing = kernel.unavailable_reason()
    if missing is not None:
        return _Candidate(kernel, available=False, detail=f"not available: {missing}")
    candidate = _Candidate(kernel, detail="invariance not checked")
    spent = 0.0
    for shape in sorted(shapes, key=lambda s: s.out_features * s.in_features):
        weight, bias, x = layers[shape.key]
        candidate.params[shape.key] = dict(kernel.variants[0])
        try:
            module = candidate.modules[shape.key] = kernel.build(weight, bias, candidate.params[shape.key])
            seconds = candidate.seconds[shape.key] = {}
            for m in TIMED_ROWS:
                seconds[m] = _call_seconds(module, x[:m], repeats)
                spent += shape.count * COST_WEIGHTS.get(m, 0.0) * seconds[m]
                if spent > budget:
                    candidate.timed_out = True
                    candidate.modules.clear()
                    candidate.detail = (f"timing stopped at {shape.key}, m={m}: weighted cost already "
                                        f"{_ms(spent)}, over {SLOWER_CUTOFF:g}x the fastest kernel's")
                    return candidate
        except (KernelError, RuntimeError, NotImplementedError) as exc:
            first_line = str(exc).splitlines()[0][:160] if str(exc) else ""
            return _Candidate(kernel, available=False, detail=f"{shape.key}: cannot run ({type(exc).__name__}: {first_line})")
    return candidate


def _best_cost(candidates: Sequence[_Candidate], shapes: Sequence[LinearShape], require_invariant: bool) -> float:
    """The lowest weighted cost among the fully timed candidates that can be chosen (row-invariant ones
    when required), or infinity."""
    costs = [c.cost(shapes) for c in candidates if c.available and not c.timed_out
             and (c.invariant or not require_invariant)]
    return min(costs, default=math.inf)


def _rows_to_check(seconds: Mapping[int, float]) -> tuple[int, ...]:
    """Row counts of the invariance check for a layer, given its timings: all up to 17, larger ones while
    the predicted call time (from the 16-row time) stays within :data:`LARGE_CALL_SECONDS`."""
    per_row = seconds[max(TIMED_ROWS)] / max(TIMED_ROWS)
    return tuple(m for m in INVARIANCE_ROWS if m <= FULL_CHECK_ROWS or per_row * m <= LARGE_CALL_SECONDS)


def _check_candidate(candidate: _Candidate, shapes: Sequence[LinearShape], layers: Mapping[str, tuple],
                     repeats: int) -> None:
    """Check one candidate on every shape (stopping at the first failing shape); keep per shape the first
    row-invariant variant and re-time the layer when that is not the variant timed."""
    notes = []
    kernel = candidate.kernel
    for shape in shapes:
        weight, bias, x = layers[shape.key]
        timed = (candidate.params[shape.key], candidate.modules.pop(shape.key))
        try:
            found, module, note = _invariant_variant(kernel, weight, bias, x,
                                                     _rows_to_check(candidate.seconds[shape.key]), timed)
            notes.append(f"{shape.key}: {note}")
            if found is None:
                candidate.invariant, candidate.detail = False, f"NOT row-invariant: {notes[-1]}"
                candidate.modules.clear()
                return
            if dict(found) != candidate.params[shape.key]:
                candidate.params[shape.key] = dict(found)
                candidate.seconds[shape.key] = _time_layer(module, x, repeats)
            del module
        except (KernelError, RuntimeError, NotImplementedError) as exc:
            candidate.invariant = False
            candidate.detail = f"{shape.key}: check failed to run ({type(exc).__name__}: {str(exc)[:160]})"
            return
    candidate.invariant, candidate.detail = True, "row-invariant: " + "; ".join(notes)


@torch.inference_mode()
def _invariant_variant(kernel: LinearKernel, weight: torch.Tensor, bias: torch.Tensor, x: torch.Tensor,
                       rows: Sequence[int], built: tuple[Mapping, nn.Module]) -> tuple[Mapping | None, nn.Module | None, str]:
    """The first of the kernel's variants that is row-invariant for this layer over ``rows``, its module, and a
    note: which variant and the rows checked, or why each variant failed. ``built``: a variant's module that
    already exists (the timed one), used instead of building it again."""
    failures = []
    for variant in kernel.variants:
        module = built[1] if dict(variant) == dict(built[0]) else kernel.build(weight, bias, variant)
        result = check_row_invariance(module, x, rows)
        label = ",".join(f"{k}={v}" for k, v in variant.items())
        if result.invariant:
            return variant, module, f"{label + ': ' if label else ''}{result.detail}"
        failures.append(f"{label + ': ' if label else ''}{result.detail}")
        del module
    return None, None, "; ".join(failures)


def _pick(trials: Sequence[KernelTrial], shapes: Sequence[LinearShape], require_invariant: bool, forced: bool
          ) -> tuple[KernelTrial, str]:
    """The cheapest usable trial and the reason string (a forced kernel is returned as it is; the caller
    refuses it when unusable, after caching).

    Raises:
        KernelError: no usable candidate.
    """
    if forced:
        return trials[0], f"{trials[0].name} (forced; weighted cost {_ms(trials[0].cost(shapes))})"
    usable = [t for t in trials if t.available and (t.invariant or not require_invariant) and t.cost(shapes) is not None]
    if not usable:
        raise KernelError("no usable kernel: " + "; ".join(f"{t.name} ({t.detail})" for t in trials))
    best = min(usable, key=lambda t: t.cost(shapes))
    reason = (f"{best.name}: {'row-invariant, ' if require_invariant else ''}weighted cost {_ms(best.cost(shapes))} "
              f"(m=1: {_ms(best.total_seconds(1, shapes))})")
    slower = [t for t in trials if t.available and t is not best and t.invariant is not False]
    if slower:
        reason += "; beats " + ", ".join(f"{t.name} {_cost_text(t, shapes)}" for t in slower)
    refused = [t for t in trials if not t.available or (require_invariant and t.invariant is False)]
    if refused:
        reason += "; refused: " + ", ".join(
            f"{t.name} ({'unavailable' if not t.available else 'not row-invariant'}"
            f"{'' if not t.available else ', ' + _ms(t.cost(shapes))})" for t in refused)
    return best, reason


def _load_average() -> tuple[float, ...] | None:
    """``os.getloadavg()`` rounded, or None where the OS has none."""
    try:
        return tuple(round(v, 2) for v in os.getloadavg())
    except OSError:
        return None


def _cost_text(trial: KernelTrial, shapes: Sequence[LinearShape]) -> str:
    cost = trial.cost(shapes)
    return "(timing stopped)" if cost is None else _ms(cost)


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.2f} ms"


def _cache_key(mode: str, shapes: Sequence[LinearShape], kernels: Sequence[LinearKernel], require_invariant: bool,
               threads: int, check_all: bool) -> dict:
    flags = cpu_flags()
    return {"schema": CACHE_SCHEMA, "cpu": cpu_model_name(), "cpu_count": os.cpu_count(),
            "cpu_flags_sha": hashlib.sha256(" ".join(sorted(flags)).encode()).hexdigest()[:16],
            "torch": torch.__version__, "threads": threads, "mode": mode, "require_invariant": require_invariant,
            "shapes": [[s.out_features, s.in_features, s.count] for s in shapes],
            "kernels": [k.name for k in kernels], "check_all": check_all, "weights": {str(m): w for m, w in COST_WEIGHTS.items()},
            "extension": _extension_key(kernels)}


#: modes whose kernels are draftwise's own C++ extension (``q4k.cpp``), rebuilt when its source changes
_EXTENSION_MODES = ("q4k", "q6k", "q8_0", "q5_0")


def _extension_key(kernels: Sequence[LinearKernel]) -> str | None:
    """The extension's build key (a hash of its sources and flags) when a kernel runs on it, so that a changed
    kernel is measured and checked again instead of read from the cache; None otherwise."""
    if not any(kernel.mode in _EXTENSION_MODES for kernel in kernels):
        return None
    from draftwise.backends.kernels.q4k import build_key

    return build_key()


def _digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def _read_cached(path: Path, key: dict, kernels: Sequence[LinearKernel]) -> KernelChoice | None:
    """The cached choice at ``path`` if it exists and matches ``key``, else None (a bad file is logged)."""
    try:
        data = json.loads(path.read_text())
        if data.get("key") != key:
            return None
        raw = data["choice"]
        by_name = {k.name: k for k in kernels}
        shapes = tuple(LinearShape(int(o), int(i), int(c), str(n)) for o, i, c, n in raw["shapes"])
        return KernelChoice(kernel=by_name[raw["name"]], mode=raw["mode"], require_invariant=bool(raw["require_invariant"]),
                            shapes=shapes, trials=tuple(KernelTrial.from_dict(t) for t in raw["trials"]),
                            reason=str(raw["reason"]), cpu=str(raw["cpu"]), threads=int(raw["threads"]),
                            torch_version=str(raw["torch_version"]), selftest_seconds=float(raw["selftest_seconds"]),
                            load_average=None if raw.get("load_average") is None else tuple(raw["load_average"]),
                            cached=True)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        logger.warning("ignoring unreadable kernel cache %s: %s", path, exc)
        return None


