"""Side-by-side benchmark of plain and speculative decoding (the Spec-Bench protocol, Xia et al. 2024).

Every method runs on every prompt in one process, interleaved per prompt (plain first, then each
speculative configuration, then plain again when the method list ends with the baseline's repeat,
:func:`draftwise.speculation.measurement.with_baseline_repeat`), so machine drift hits all alike and shows as a spread
between the two plain passes. Greedy outputs are compared with plain decoding token for token; speed is
reported as a ratio against the mean of the plain passes on the same prompt. Every run records its process CPU
time and the load average (:mod:`draftwise.speculation.measurement`), and the summary marks the rows whose figures are
doubtful. Results are saved after every prompt so an interrupted run can be resumed.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import resource
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from draftwise.speculation import cost_model, measurement
from draftwise.speculation.calibration import ForwardCosts
from draftwise.config import SamplingParams
from draftwise.engine import GenerationResult, SpeculativeEngine
from draftwise.files import write_json_atomic
from draftwise.models.loading import LoadedModel
from draftwise.stats import total_hybrid_steps

__all__ = ["BenchPrompt", "MethodSpec", "PromptRun", "load_prompts", "default_prompts_path", "run_benchmark",
           "summarize", "first_difference", "load_results", "write_json", "doubts_of", "row_name", "is_external_anchor",
           "draftwise_mismatches"]

logger = logging.getLogger(__name__)

Runner = Callable[[list[int], SamplingParams], GenerationResult]


@dataclass(frozen=True)
class BenchPrompt:
    """One benchmark question: Spec-Bench ``turns`` (multi-turn) or a single ``{"prompt": ...}``."""

    id: str
    category: str
    turns: tuple[str, ...]

    @property
    def text(self) -> str:
        """The first turn."""
        return self.turns[0]


@dataclass
class MethodSpec:
    """A named configuration to benchmark.

    Attributes:
        label: unique name in tables and JSON (e.g. ``"draft K=4"``, ``"ngram auto"``).
        kind: ``"plain"``, ``"draft"``, ``"ngram"``, or an external anchor (``"hf-assisted"``, ``"hf-lookup"``).
        k: K (the maximum K for a controller); None for plain decoding.
        policy: ``"fixed"`` or ``"auto"``.
        engine: the draftwise engine, or None when ``runner`` is given.
        runner: ``(prompt_ids, params) -> GenerationResult`` for methods outside the engine.
        repeat_of: for the baseline's second pass, the baseline's label (else None).
    """

    label: str
    kind: str = "plain"
    k: int | None = None
    policy: str = "fixed"
    engine: SpeculativeEngine | None = None
    runner: Runner | None = None
    repeat_of: str | None = None

    def run(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        if self.runner is not None:
            return self.runner(prompt_ids, params)
        assert self.engine is not None, f"method {self.label} has neither an engine nor a runner"
        return self.engine.generate(prompt_ids, params)


@dataclass
class PromptRun:
    """One method on one turn of one prompt (times in seconds, memory in bytes).

    ``speedup``: tokens/s over the plain passes' on the same prompt and turn (their tokens over their time);
    ``measurement``: :class:`draftwise.speculation.measurement.Measurement` as a dict (wall and CPU time, threads, load);
    ``warnings``: :class:`draftwise.speculation.measurement.Doubt` dicts of this run alone (machine busy);
    ``repeat_of``: the baseline's label on its second pass.
    """

    prompt_id: str
    category: str
    turn: int
    method: str
    kind: str
    k: int | None
    policy: str
    num_prompt_tokens: int
    num_tokens: int
    time_s: float
    tokens_per_s: float
    identical_to_plain: bool
    first_difference: int | None
    speedup: float | None
    peak_rss_bytes: int
    peak_gpu_bytes: int | None
    token_ids: list[int] = field(default_factory=list)
    stats: dict = field(default_factory=dict)
    measurement: dict = field(default_factory=dict)
    warnings: list[dict] = field(default_factory=list)
    repeat_of: str | None = None


def is_external_anchor(kind: str) -> bool:
    """True for a method run by another library (``"hf-assisted"``, ``"hf-lookup"``: transformers' own
    ``generate``): its numerics are not draftwise's, so its output may differ from draftwise's plain decoding
    without any draftwise error, and it reports only wall time."""
    return kind.startswith("hf")


def draftwise_mismatches(runs: Sequence[PromptRun]) -> list[PromptRun]:
    """The runs of draftwise's own methods whose greedy output differs from plain decoding (external anchors
    left out: see :func:`is_external_anchor`)."""
    return [r for r in runs if not r.identical_to_plain and not is_external_anchor(r.kind)]


def default_prompts_path() -> Path:
    """The Spec-Bench questions: ``$DRAFTWISE_PROMPTS``, else ``data/spec_bench/question.jsonl`` in
    ``$DRAFTWISE_SHARED`` (the shared folder, as for the tests' models), else ``shared/data/spec_bench/question.jsonl``
    next to the current directory or the source checkout.

    Raises:
        FileNotFoundError: when none exists.
    """
    candidates = []
    if os.environ.get("DRAFTWISE_PROMPTS"):
        candidates.append(Path(os.environ["DRAFTWISE_PROMPTS"]))
    relative = Path("shared/data/spec_bench/question.jsonl")
    if os.environ.get("DRAFTWISE_SHARED"):
        candidates.append(Path(os.environ["DRAFTWISE_SHARED"]) / relative.relative_to("shared"))
    for base in (Path.cwd(), Path.cwd().parent, Path(__file__).resolve().parents[3]):  # repo's parent
        candidates.append(base / relative)
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise FileNotFoundError("Spec-Bench prompts not found; pass --prompts FILE or set DRAFTWISE_PROMPTS (the file) "
                            "or DRAFTWISE_SHARED (the shared folder)")


def _parse_prompt_line(row: object, where: str) -> tuple[str, str | None, tuple[str, ...]]:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object")
    if isinstance(row.get("prompt"), str) and row["prompt"]:
        turns: tuple[str, ...] = (row["prompt"],)
    elif isinstance(row.get("turns"), list) and row["turns"] and all(isinstance(t, str) and t for t in row["turns"]):
        turns = tuple(row["turns"])
    else:
        raise ValueError(f"{where}: expected a 'prompt' string or a non-empty 'turns' list of strings")
    identifier = row.get("question_id", row.get("id"))
    return str(row.get("category", "prompt")), None if identifier is None else str(identifier), turns


def load_prompts(path: str | Path, categories: Sequence[str] | None = None, limit: int | None = None) -> list[BenchPrompt]:
    """Read a JSONL prompt file: Spec-Bench lines (``question_id``, ``category``, ``turns``) or ``{"prompt": ...}``.

    Args:
        categories: keep only these categories (None: all).
        limit: at most this many prompts per category (None: all).

    Raises:
        FileNotFoundError: missing file. ValueError: a line that is not a JSON object with a prompt.
    """
    prompts: list[BenchPrompt] = []
    per_category: dict[str, int] = {}
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not valid JSON: {exc}") from exc
            category, identifier, turns = _parse_prompt_line(row, f"{path}:{number}")
            if categories and category not in categories:
                continue
            if limit is not None and per_category.get(category, 0) >= limit:
                continue
            per_category[category] = per_category.get(category, 0) + 1
            prompts.append(BenchPrompt(id=identifier or str(number), category=category, turns=turns))
    return prompts


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (or of the shorter length), None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _peak_memory() -> tuple[int, int | None]:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    gpu = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    return rss, gpu


def encode_turn(target: LoadedModel, prompt: BenchPrompt, turn: int, answers: Sequence[str], chat: bool) -> list[int]:
    """Token ids of ``prompt``'s turn ``turn``; later turns see the method's own earlier ``answers``."""
    if chat and target.has_chat_template:
        messages = []
        for i in range(turn):
            messages += [{"role": "user", "content": prompt.turns[i]}, {"role": "assistant", "content": answers[i]}]
        messages.append({"role": "user", "content": prompt.turns[turn]})
        return target.encode_chat(messages)
    history = "".join(f"{prompt.turns[i]}\n{answers[i]}\n" for i in range(turn))
    return target.encode(history + prompt.turns[turn])


def run_benchmark(
    target: LoadedModel,
    methods: Sequence[MethodSpec],
    prompts: Sequence[BenchPrompt],
    params: SamplingParams,
    *,
    chat: bool = True,
    all_turns: bool = False,
    done: Sequence[PromptRun] = (),
    on_run: Callable[[PromptRun], None] | None = None,
    on_prompt: Callable[[list[PromptRun]], None] | None = None,
    threads: int | None = None,
) -> list[PromptRun]:
    """Run every method on every prompt (and turn), interleaved per prompt; ``methods[0]`` must be plain, and
    a method with ``repeat_of`` set (:func:`draftwise.speculation.measurement.with_baseline_repeat`) is a second plain pass.

    Args:
        done: runs from an earlier, interrupted benchmark; prompts they complete are skipped.
        on_run: called after each (prompt, turn, method) run, before the turn's speed-ups are known;
            on_prompt: after each prompt with all runs.
        threads: threads the runs may use, for their CPU share (default:
            :func:`draftwise.speculation.measurement.backend_threads` of the target).

    Returns:
        All runs, ``done`` included, each with greedy exactness against plain, the speed-up over the plain
        passes on the same prompt and turn, its measurement and its own warnings.

    Raises:
        ValueError: if the first method is not plain decoding.
    """
    if not methods or methods[0].kind != "plain":
        raise ValueError("the first benchmark method must be plain decoding")
    runs = list(done)
    threads = threads or measurement.backend_threads(target.backend)
    for prompt in prompts:
        num_turns = len(prompt.turns) if all_turns else 1
        have = {(r.method, r.turn) for r in runs if r.prompt_id == prompt.id}
        if {(m.label, t) for m in methods for t in range(num_turns)} <= have:
            continue
        runs = [r for r in runs if r.prompt_id != prompt.id]  # drop a half-finished prompt
        if not _fits_context(target, prompt, chat):
            continue
        runs.extend(_run_prompt(target, methods, prompt, params, chat, all_turns, on_run, threads))
        if on_prompt:
            on_prompt(runs)
    return runs


def _fits_context(target: LoadedModel, prompt: BenchPrompt, chat: bool) -> bool:
    """Whether the prompt's first turn leaves the context room for a new token; logs a warning naming the prompt
    when it does not (the benchmark then skips it rather than abort every other prompt's run)."""
    num_tokens, limit = len(encode_turn(target, prompt, 0, [], chat)), target.backend.max_context
    if num_tokens < limit:
        return True
    logger.warning("prompt %s (%s) skipped: %d tokens, and the context length is %d tokens (--max-model-len)",
                   prompt.id, prompt.category, num_tokens, limit)
    return False


def _run_prompt(target, methods, prompt, params, chat, all_turns, on_run, threads) -> list[PromptRun]:
    turns = range(len(prompt.turns) if all_turns else 1)
    answers: dict[str, list[str]] = {m.label: [] for m in methods}
    runs: list[PromptRun] = []
    for turn in turns:
        baseline: PromptRun | None = None
        turn_runs = []
        for method in methods:
            ids = encode_turn(target, prompt, turn, answers[method.label], chat)
            with measurement.measure(threads) as measured:
                result = method.run(ids, params)
            answers[method.label].append(target.decode(result.token_ids))
            run = _to_run(prompt, turn, method, ids, result, baseline, measured.result)
            baseline = baseline or run
            if not run.identical_to_plain and params.greedy:
                logger.warning("%s on prompt %s turn %d differs from plain at token %s", method.label, prompt.id,
                               turn, run.first_difference)
            turn_runs.append(run)
            if on_run:
                on_run(run)
        _set_speedups(turn_runs)
        runs.extend(turn_runs)
    return runs


def _set_speedups(turn_runs: list[PromptRun]) -> None:
    """Each run's speed-up over the plain passes of the same prompt and turn (``turn_runs[0]`` and the runs
    repeating it): their tokens over their time, so the mean of the passes."""
    passes = _baseline_passes(turn_runs)
    tokens, seconds = sum(r.num_tokens for r in passes), sum(r.time_s for r in passes)
    rate = tokens / seconds if seconds > 0 else 0.0
    for run in turn_runs:
        run.speedup = run.tokens_per_s / rate if rate else None


def _baseline_passes(runs: Sequence[PromptRun]) -> list[PromptRun]:
    """The runs of the baseline (``runs[0]``'s method) and of its repeats, in order."""
    labels = measurement.baseline_labels(runs)
    return [r for r in runs if r.method in labels]


def _to_run(prompt: BenchPrompt, turn: int, method: MethodSpec, ids: list[int], result: GenerationResult,
            baseline: PromptRun | None, measured: measurement.Measurement | None) -> PromptRun:
    stats = result.stats
    diff = first_difference(result.token_ids, baseline.token_ids) if baseline else None
    rss, gpu = _peak_memory()
    busy = measurement.machine_busy(measured)
    return PromptRun(
        prompt_id=prompt.id, category=prompt.category, turn=turn, method=method.label, kind=method.kind,
        k=method.k, policy=method.policy, num_prompt_tokens=len(ids), num_tokens=len(result.token_ids),
        time_s=stats.total_time_s, tokens_per_s=stats.tokens_per_s, identical_to_plain=diff is None,
        first_difference=diff, speedup=None, peak_rss_bytes=rss, peak_gpu_bytes=gpu,
        token_ids=list(result.token_ids), stats=stats.to_dict(),
        measurement=measured.to_dict() if measured else {}, warnings=[busy.to_dict()] if busy else [],
        repeat_of=method.repeat_of,
    )


def _sum(runs: Sequence[PromptRun], key: str) -> float:
    return sum(r.stats.get(key, 0) or 0 for r in runs)


def _method_row(label: str, mine: list[PromptRun], plain_time: float) -> dict:
    speedups = sorted(r.speedup for r in mine if r.speedup is not None)
    drafted, accepted = _sum(mine, "num_draft_tokens"), _sum(mine, "num_accepted_tokens")
    passes = _sum(mine, "num_target_passes")
    decode_time = sum(r.stats.get("total_time_s", 0) - r.stats.get("prefill_time_s", 0) for r in mine)
    total_time = sum(r.time_s for r in mine)
    drafted_pos, accepted_pos, rejected_pos = _position_counts(mine)
    ks = [k for r in mine for k in r.stats.get("k_history", [])]
    return {
        "method": label, "kind": mine[0].kind, "k": mine[0].k, "policy": mine[0].policy, "runs": len(mine),
        "tokens": sum(r.num_tokens for r in mine), "time_s": total_time,
        "tokens_per_s": sum(r.num_tokens for r in mine) / total_time if total_time else 0.0,
        "speedup_total": plain_time / total_time if total_time else None,
        "decode_time_s": decode_time,
        "speedup_median": statistics.median(speedups) if speedups else None,
        "speedup_min": speedups[0] if speedups else None,
        "speedup_max": speedups[-1] if speedups else None,
        "acceptance_rate": cost_model.acceptance_rate(accepted, drafted),
        "token_acceptance": cost_model.token_acceptance(accepted_pos, rejected_pos),
        "mean_accepted_length": cost_model.mean_accepted_length(accepted, passes) if passes else None,
        "acceptance_by_position": [a / d if d else 0.0 for a, d in zip(accepted_pos, drafted_pos)],
        "mean_k": statistics.fmean(ks) if ks else None,
        "hybrid_steps": total_hybrid_steps(r.stats.get("hybrid_steps") for r in mine),
        "identical": sum(r.identical_to_plain for r in mine),
        # external anchors report only wall time, so the engine's overhead share is undefined for them
        "overhead_share": (_sum(mine, "overhead_time_s") / decode_time if decode_time > 0 else 0.0)
        if not is_external_anchor(mine[0].kind) else None,
        "draft_time_s": _sum(mine, "draft_time_s"), "target_time_s": _sum(mine, "target_time_s"),
        "peak_rss_bytes": max(r.peak_rss_bytes for r in mine),
        "peak_gpu_bytes": max((r.peak_gpu_bytes or 0 for r in mine), default=None) if mine[0].peak_gpu_bytes is not None else None,
    }


def _position_counts(runs: Sequence[PromptRun]) -> tuple[list[int], list[int], list[int]]:
    """Drafted, accepted and rejected counts per draft position, summed over runs (rejections rebuilt with
    :func:`draftwise.speculation.cost_model.rejections_from_counts` for records that predate their counting)."""
    totals: list[list[int]] = [[], [], []]
    for run in runs:
        drafted = run.stats.get("drafted_per_position", [])
        accepted = run.stats.get("accepted_per_position", [])
        rejected = run.stats.get("rejected_per_position")
        if rejected is None:
            rejected = cost_model.rejections_from_counts(drafted, accepted)
        for total, counts in zip(totals, (drafted, accepted, rejected)):
            total.extend([0] * (len(counts) - len(total)))
            for i, n in enumerate(counts):
                total[i] += n
    return totals[0], totals[1], totals[2]


def summarize(
    runs: Sequence[PromptRun],
    target_costs: ForwardCosts | None = None,
    draft_cost_s: float | None = None,
    *,
    by_category: bool = False,
    draft_prefill_s: float | None = None,
) -> list[dict]:
    """Per method (and per category when asked): tokens/s, speed-up over plain (total, median, min, max),
    alpha, tau, acceptance by position, mean K, identical outputs, engine overhead share, peak memory; for
    fixed-K draft-model rows with calibration: c, v_(K+1) and the Leviathan-predicted speed-up (from the
    per-token acceptance and the tokens each step drafted, which a confidence stop makes fewer than K:
    :func:`draftwise.speculation.cost_model.predicted_speedup_of_steps`), with the draft's catch-up of each prompt's
    uncached tokens priced in when ``draft_prefill_s`` (the draft's calibrated prefill seconds per token) is
    given (``catch_up_passes``: in one-token target passes, summed over the row's runs).

    Speed-ups are over the mean of the plain passes (the first method and its repeats): ``baseline_pass_s``
    lists each pass's total seconds and ``baseline_spread`` their relative spread. ``measurement`` is the
    row's runs' :func:`draftwise.speculation.measurement.combine` d measurement, and ``warnings`` its doubts
    (:mod:`draftwise.speculation.measurement`): baseline moved, machine busy during the row's runs or the plain passes it
    is compared with, and a decode speed-up (the like-for-like figure: the prediction leaves the target's prefill
    out, as the decode time does, and counts the draft's catch-up, which falls in the decode time) far from its
    prediction."""
    groups: dict[tuple[str, str], list[PromptRun]] = {}
    for run in runs:
        groups.setdefault((run.category if by_category else "all", run.method), []).append(run)
    base_labels = measurement.baseline_labels(runs)
    rows = []
    for (category, label), mine in groups.items():
        passes = [groups[(category, name)] for name in base_labels if (category, name) in groups]
        pass_seconds = [sum(r.time_s for r in p) for p in passes]
        plain_time = statistics.fmean(pass_seconds) if passes else 0.0
        row = {"category": category, **_method_row(label, mine, plain_time)}
        plain_decode = statistics.fmean(_decode_seconds(p) for p in passes) if passes else 0.0
        row["decode_speedup_total"] = plain_decode / row["decode_time_s"] if row["decode_time_s"] > 0 else None
        k = row["k"]
        if (row["kind"] == "draft" and row["policy"] == "fixed" and k and target_costs and draft_cost_s is not None
                and row["token_acceptance"] is not None and all(n in target_costs.seconds for n in range(1, k + 2))):
            drafted = ([min(d, k) for r in mine for d in r.stats.get("k_history", [])]  # older records: K a pass
                       or [k] * int(_sum(mine, "num_target_passes")))
            if drafted:
                c = draft_cost_s / target_costs.seconds[1]
                catch_up = 0.0
                if draft_prefill_s is not None:
                    catch_up = sum(cost_model.catch_up_passes(
                        max(0, r.num_prompt_tokens - (r.stats.get("num_cached_prompt_tokens") or 0)),
                        draft_prefill_s, target_costs.seconds[1]) for r in mine)
                    row.update(catch_up_passes=catch_up)
                row.update(cost_ratio=c, verify_cost=target_costs.relative(k + 1),
                           predicted_speedup=cost_model.predicted_speedup_of_steps(
                               row["token_acceptance"], drafted, c, target_costs.relative, catch_up))
        combined = measurement.combine(_measurements(mine))
        row.update(baseline_pass_s=pass_seconds, baseline_spread=measurement.relative_spread(pass_seconds),
                   measurement=combined.to_dict() if combined else {},
                   warnings=[d.to_dict() for d in _row_doubts(row, mine, passes, label in base_labels)])
        rows.append(row)
    return rows


def _decode_seconds(runs: Sequence[PromptRun]) -> float:
    return sum(r.stats.get("total_time_s", 0) - r.stats.get("prefill_time_s", 0) for r in runs)


def _measurements(runs: Sequence[PromptRun]) -> list[measurement.Measurement | None]:
    return [measurement.Measurement.from_dict(r.measurement) for r in runs]


def _row_doubts(row: dict, mine: Sequence[PromptRun], passes: Sequence[Sequence[PromptRun]],
                is_baseline: bool) -> list[measurement.Doubt]:
    """A summary row's doubts (:func:`draftwise.speculation.measurement.comparison_doubts`), judging its decode speed-up
    against the prediction."""
    measured = row["decode_speedup_total"] if row["decode_speedup_total"] is not None else row["speedup_total"]
    return measurement.comparison_doubts(
        row["method"], _measurements(mine),
        [(p[0].method, sum(r.time_s for r in p), _measurements(p)) for p in passes], is_baseline=is_baseline,
        measured_speedup=measured, predicted_speedup=row.get("predicted_speedup"))


def row_name(row: dict) -> str:
    """A summary row's name in warnings: the method, prefixed by its category unless that is ``"all"``."""
    return row["method"] if row["category"] == "all" else f"{row['category']}/{row['method']}"


def doubts_of(summary: Sequence[dict], calibration: dict | None = None) -> list[tuple[str, dict]]:
    """``(what, doubt dict)`` for every doubt of the summary rows and the calibration (``calibration["warnings"]``,
    see ``draftwise bench``), in table order."""
    pairs = [(row_name(row), d) for row in summary for d in row.get("warnings", [])]
    return pairs + [("calibration", d) for d in (calibration or {}).get("warnings", [])]


def environment() -> dict:
    """Machine and library versions recorded with every benchmark."""
    return {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def write_json(path: str | Path, config: dict, runs: Sequence[PromptRun], summary: list[dict], calibration: dict,
               *, complete: bool = True) -> Path:
    """Write every raw measurement plus the summary to ``path`` atomically (parents created), with the
    combined measurement of all runs (``measurement``) and every doubt of the summary rows and the calibration
    (``warnings``: ``{"row", "code", "reason", "detail"}``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    combined = measurement.combine(_measurements(runs))
    payload = {"config": config, "environment": environment(), "complete": complete, "calibration": calibration,
               "measurement": combined.to_dict() if combined else {},
               "warnings": [{"row": what, **d} for what, d in doubts_of(summary, calibration)],
               "summary": summary, "runs": [asdict(r) for r in runs]}
    return write_json_atomic(path, payload, indent=1)


def load_results(path: str | Path) -> tuple[dict, list[PromptRun], dict]:
    """Read a benchmark JSON: (config, runs, calibration).

    Raises:
        FileNotFoundError, ValueError: missing or malformed file.
    """
    try:
        data = json.loads(Path(path).read_text())
        runs = [PromptRun(**row) for row in data["runs"]]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f"{path} is not a draftwise benchmark file: {exc}") from exc
    return data.get("config", {}), runs, data.get("calibration", {})
