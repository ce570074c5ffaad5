"""Side-by-side benchmark of plain and speculative decoding on the same target, prompts and process.

Methods run interleaved per prompt (plain, then each speculative configuration) so machine drift hits all
alike. Greedy outputs are compared with plain decoding token for token; speed is reported as a ratio.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from draftwise.calibration import ForwardCosts, predicted_speedup
from draftwise.config import SamplingParams
from draftwise.engine import GenerationResult, SpeculativeEngine
from draftwise.models.loading import LoadedModel

__all__ = ["BenchPrompt", "MethodSpec", "PromptRun", "load_prompts", "default_prompts_path", "run_benchmark",
           "summarize", "first_difference"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BenchPrompt:
    """One benchmark prompt (the first turn of a Spec-Bench question, or a ``{"prompt": ...}`` line)."""

    id: str
    category: str
    text: str


@dataclass
class MethodSpec:
    """A named engine configuration to benchmark (``k`` is None for plain decoding)."""

    label: str
    engine: SpeculativeEngine
    k: int | None = None


@dataclass
class PromptRun:
    """One method on one prompt."""

    prompt_id: str
    category: str
    method: str
    k: int | None
    num_prompt_tokens: int
    num_tokens: int
    time_s: float
    tokens_per_s: float
    identical_to_plain: bool
    first_difference: int | None
    stats: dict = field(default_factory=dict)
    speedup: float | None = None


def default_prompts_path() -> Path:
    """The Spec-Bench questions: ``$DRAFTWISE_PROMPTS``, else ``shared/data/spec_bench/question.jsonl`` next to
    the current directory or the source checkout.

    Raises:
        FileNotFoundError: when none exists.
    """
    candidates = []
    if os.environ.get("DRAFTWISE_PROMPTS"):
        candidates.append(Path(os.environ["DRAFTWISE_PROMPTS"]))
    relative = Path("shared/data/spec_bench/question.jsonl")
    for base in (Path.cwd(), Path.cwd().parent, Path(__file__).resolve().parents[3].parent):
        candidates.append(base / relative)
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise FileNotFoundError("Spec-Bench prompts not found; pass --prompts FILE or set DRAFTWISE_PROMPTS")


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
            text = row.get("prompt") if isinstance(row, dict) else None
            if text is None and isinstance(row, dict) and row.get("turns"):
                text = row["turns"][0]
            if not isinstance(text, str) or not text:
                raise ValueError(f"{path}:{number}: expected a 'prompt' string or a non-empty 'turns' list")
            category = str(row.get("category", "prompt"))
            if categories and category not in categories:
                continue
            if limit is not None and per_category.get(category, 0) >= limit:
                continue
            per_category[category] = per_category.get(category, 0) + 1
            prompts.append(BenchPrompt(id=str(row.get("question_id", row.get("id", number))), category=category, text=text))
    return prompts


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (or of the shorter length), None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def run_benchmark(
    target: LoadedModel,
    methods: Sequence[MethodSpec],
    prompts: Sequence[BenchPrompt],
    params: SamplingParams,
    *,
    chat: bool = True,
    on_run: Callable[[PromptRun], None] | None = None,
) -> list[PromptRun]:
    """Run every method on every prompt, interleaved per prompt; ``methods[0]`` must be plain decoding.

    Returns one :class:`PromptRun` per (prompt, method), with greedy exactness against plain and the speed-up
    over plain on the same prompt.

    Raises:
        ValueError: if the first method is not plain decoding.
    """
    if not methods or methods[0].k is not None:
        raise ValueError("the first benchmark method must be plain decoding (k=None)")
    runs: list[PromptRun] = []
    for prompt in prompts:
        ids = _encode(target, prompt.text, chat)
        baseline: GenerationResult | None = None
        for method in methods:
            result = method.engine.generate(ids, params)
            if baseline is None:
                baseline = result
            diff = first_difference(result.token_ids, baseline.token_ids)
            run = _to_run(prompt, method, ids, result, diff)
            base_tps = baseline.stats.tokens_per_s
            run.speedup = run.tokens_per_s / base_tps if base_tps else None
            if diff is not None and params.greedy:
                logger.warning("%s on prompt %s differs from plain at token %d", method.label, prompt.id, diff)
            runs.append(run)
            if on_run:
                on_run(run)
    return runs


def _encode(target: LoadedModel, text: str, chat: bool) -> list[int]:
    if chat and target.has_chat_template:
        return target.encode_chat([{"role": "user", "content": text}])
    return target.encode(text)


def _to_run(prompt: BenchPrompt, method: MethodSpec, ids: list[int], result: GenerationResult, diff) -> PromptRun:
    stats = result.stats
    return PromptRun(
        prompt_id=prompt.id, category=prompt.category, method=method.label, k=method.k,
        num_prompt_tokens=len(ids), num_tokens=len(result.token_ids), time_s=stats.total_time_s,
        tokens_per_s=stats.tokens_per_s, identical_to_plain=diff is None, first_difference=diff,
        stats=stats.to_dict(),
    )


def summarize(
    runs: Sequence[PromptRun],
    target_costs: ForwardCosts | None = None,
    draft_cost_s: float | None = None,
) -> list[dict]:
    """Per method: tokens/s (total tokens / total time), median/min/max speed-up over plain, alpha, tau,
    identical outputs, engine overhead share, and (with calibration) c, v_(K+1) and the predicted speed-up."""
    rows = []
    for label in dict.fromkeys(run.method for run in runs):
        mine = [r for r in runs if r.method == label]
        speedups = [r.speedup for r in mine if r.speedup is not None]
        drafted = sum(r.stats["num_draft_tokens"] for r in mine)
        accepted = sum(r.stats["num_accepted_tokens"] for r in mine)
        passes = sum(r.stats["num_target_passes"] for r in mine)
        step_tokens = sum(r.stats["num_step_tokens"] for r in mine)
        decode_time = sum(r.stats["total_time_s"] - r.stats["prefill_time_s"] for r in mine)
        overhead = sum(r.stats["overhead_time_s"] for r in mine)
        total_time = sum(r.time_s for r in mine)
        row = {
            "method": label, "k": mine[0].k, "prompts": len(mine),
            "tokens": sum(r.num_tokens for r in mine), "time_s": total_time,
            "tokens_per_s": sum(r.num_tokens for r in mine) / total_time if total_time else 0.0,
            "speedup_median": statistics.median(speedups) if speedups else None,
            "speedup_min": min(speedups) if speedups else None,
            "speedup_max": max(speedups) if speedups else None,
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_accepted_length": step_tokens / passes if passes else None,
            "identical": sum(r.identical_to_plain for r in mine),
            "overhead_share": overhead / decode_time if decode_time else 0.0,
            "draft_time_s": sum(r.stats["draft_time_s"] for r in mine),
            "target_time_s": sum(r.stats["target_time_s"] for r in mine),
        }
        plain_rows = [r for r in runs if r.method == runs[0].method]
        plain_time = sum(r.time_s for r in plain_rows)
        row["speedup_total"] = plain_time / total_time if total_time else None
        k = row["k"]
        if k and target_costs and draft_cost_s is not None and row["acceptance_rate"] is not None \
                and (k + 1) in target_costs.seconds:
            c = draft_cost_s / target_costs.seconds[1]
            v = target_costs.relative(k + 1)
            row.update(cost_ratio=c, verify_cost=v,
                       predicted_speedup=predicted_speedup(row["acceptance_rate"], k, c, v))
        rows.append(row)
    return rows


def environment() -> dict:
    """Machine and library versions recorded with every benchmark."""
    return {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def write_json(path: str | Path, config: dict, runs: Sequence[PromptRun], summary: list[dict], calibration: dict) -> Path:
    """Write every raw measurement plus the summary to ``path`` (parents created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"config": config, "environment": environment(), "calibration": calibration,
               "summary": summary, "runs": [asdict(r) for r in runs]}
    path.write_text(json.dumps(payload, indent=2))
    return path
