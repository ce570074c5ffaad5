"""Issue-23 benchmark: the draft model's goals, measured in one sitting and judged goal by goal.

    python scripts/bench/draft_goals.py run [--out DIR]                   # every stage, then the goal table (about an hour)
    python scripts/bench/draft_goals.py run --out DIR --stages costs,coding
    python scripts/bench/draft_goals.py evaluate DIR                      # the goal table from DIR's reports only

``run`` runs each stage as one ``draftwise`` command (each a process of its own, plain decoding timed before
and after the speculative methods in that process, :mod:`draftwise.benchmark`) and writes its report into
DIR; a stage whose report is already there is skipped unless ``--again``. Run it on an idle machine: nothing
else may run beside it (a loaded machine once turned a true 1.16x into 3.26x). The stages, all greedy, with
the Qwen2.5-Coder 1.5B target (``--quantization int8``, exact) and 0.5B draft (``--speculative-backend auto``):

- ``costs``: ``draftwise costs`` at contexts 200 and 1,000 tokens: the draft's cost ratio c (one draft token
  over one target token) -> ``costs-200.json``, ``costs-1000.json``;
- ``coding``: ``draftwise bench`` on the 10 Spec-Bench coding questions' first turns (``--limit 20``: the 20
  coding prompts, first turns only), 128 tokens: plain, draft K=4 / K=8 / auto(K<=8), ngram, and transformers'
  assisted generation and prompt lookup (``hf``) -> ``coding.json`` (and ``.md``);
- ``categories``: all 13 categories x 5 prompts, 128 tokens: plain, draft K=4 / K=8 / auto(K<=8) ->
  ``categories.json``;
- ``agent``: ``bench --workload agent`` on 2 shipped sessions x 4 turns, 256 tokens: plain with and without
  prefix reuse, draft / suffix / hybrid with the auto K policy (K <= 8) -> ``agent.json``.

``evaluate`` reads those reports and prints, per goal of issue 23, the figure, the threshold and whether it is
met (``n/a`` where the report is missing), the CPU line, and any report whose outputs differ from plain
decoding or whose plain passes moved (such a figure is void or flagged, whatever its value). The thresholds
live here, in this script, not in a timed test.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("draft_goals")

TARGET, DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"
COMMON = ["--quantization", "int8", "--speculative-backend", "auto", "--threads", "2"]
#: Spec-Bench's categories: the per-category goals are judged only on a report that covers them all.
SPEC_BENCH_CATEGORIES = 13
#: A plain baseline whose passes are further apart than this (relative) flags the report's ratios.
BASELINE_SPREAD_FLAG = 0.05


def stage_commands(out: Path, draftwise: str) -> dict[str, list[list[str]]]:
    """The ``draftwise`` argv lists of each stage (run in order), writing their reports into ``out``."""
    bench = [draftwise, "bench", "--model", TARGET, "--speculative-model", DRAFT, *COMMON]
    return {
        "costs": [[draftwise, "costs", TARGET, "--draft", DRAFT, "--quantization", "int8", "--speculative-backend",
                   "auto", "--ks", "1,5,9", "--context", str(context), "--json"] for context in (200, 1000)],
        "coding": [[*bench, "--category", "coding", "--limit", "20", "--max-tokens", "128", "--methods",
                    "plain,draft,ngram,hf", "--ks", "4,8", "--k-policies", "fixed,auto",
                    "--output", str(out / "coding.json")]],
        "categories": [[*bench, "--limit", "5", "--max-tokens", "128", "--methods", "plain,draft", "--ks", "4,8",
                        "--k-policies", "fixed,auto", "--output", str(out / "categories.json")]],
        "agent": [[*bench, "--workload", "agent", "--limit", "2", "--agent-turns", "4", "--max-tokens", "256",
                   "--methods", "plain-nocache,draft,suffix,hybrid", "--ks", "8", "--k-policies", "auto",
                   "--output", str(out / "agent.json")]],
    }


PROMPT_REPORTS = ("coding.json", "categories.json")
STAGE_FILES = {"costs": ["costs-200.json", "costs-1000.json"], "coding": ["coding.json"],
               "categories": ["categories.json"], "agent": ["agent.json"]}


def run_stage(stage: str, commands: list[list[str]], out: Path) -> None:
    """Run one stage's commands; a ``costs`` command's JSON (its stdout) is written to its file.

    Raises:
        RuntimeError: a command failed or could not start (its own output was shown as it ran).
    """
    for argv, name in zip(commands, STAGE_FILES[stage]):
        log.info("stage %s: %s", stage, " ".join(argv))
        try:
            if stage == "costs":
                result = subprocess.run(argv, check=True, stdout=subprocess.PIPE, text=True)
                (out / name).write_text(result.stdout)
            else:
                subprocess.run(argv, check=True)
        except subprocess.CalledProcessError as exc:
            raise RuntimeError(f"stage {stage}: {argv[0]} {argv[1]} failed (exit {exc.returncode})") from None
        except OSError as exc:
            raise RuntimeError(f"stage {stage}: cannot run {argv[0]}: {exc.strerror or exc}") from None


def stage_done(directory: Path, stage: str) -> bool:
    """Whether every report of ``stage`` is in ``directory`` and complete (an interrupted ``bench`` leaves
    ``"complete": false``: the stage runs again)."""
    for name in STAGE_FILES[stage]:
        path = directory / name
        try:
            if not path.exists() or json.loads(path.read_text()).get("complete", True) is False:
                return False
        except (json.JSONDecodeError, AttributeError):
            return False
    return True


@dataclass(frozen=True)
class Goal:
    """One goal's verdict: ``met`` is None where its report is missing (``figure`` says which)."""

    name: str
    threshold: str
    figure: str
    met: bool | None


def _rows(report: dict, category: str = "all") -> dict[str, dict]:
    """A prompts report's summary rows for one category, by method label."""
    return {row["method"]: row for row in report["summary"] if row["category"] == category}


def _draft_rows(rows: dict[str, dict], policy: str | None = None) -> dict[str, dict]:
    return {label: row for label, row in rows.items()
            if row["kind"] == "draft" and (policy is None or row["policy"] == policy)}


def _best(rows: dict[str, dict], key: str = "speedup_total") -> tuple[str, float] | None:
    """The row with the highest positive ``key`` (label, value); None where no row has one."""
    scored = [(label, row[key]) for label, row in rows.items()
              if isinstance(row.get(key), (int, float)) and row[key] > 0]
    return max(scored, key=lambda item: item[1]) if scored else None


def _missing(name: str, threshold: str, what: str) -> Goal:
    return Goal(name, threshold, f"no {what} report", None)


def cost_goals(costs: dict[int, dict | None]) -> list[Goal]:
    """c = one draft token / one target token (seconds), at contexts 200 and 1,000 tokens."""
    goals = []
    for context, limit in ((200, 0.25), (1000, 0.30)):
        name, threshold = f"c at context {context:,}", f"<= {limit:.2f}"
        result = costs.get(context)
        if result is None or result.get("cost_ratio_c") is None:
            goals.append(_missing(name, threshold, f"costs-{context}"))
            continue
        c = result["cost_ratio_c"]
        figure = (f"{c:.3f} (draft {result['draft_1_token_s'] * 1e3:.1f} ms, target "
                  f"{result['seconds']['1'] * 1e3:.1f} ms)")
        goals.append(Goal(name, threshold, figure, c <= limit))
    return goals


def coding_goals(report: dict | None) -> list[Goal]:
    """Draft >= 2.0x plain on the coding prompts; draftwise's best draft >= 1.5x transformers' best assisted
    generation (tokens/s, same run); auto >= 0.97 of the best fixed K (same run)."""
    names = [("draft on coding prompts", ">= 2.0x plain"), ("draft vs transformers' assisted generation", ">= 1.5x"),
             ("auto vs best fixed K, coding", ">= 0.97")]
    if report is None:
        return [_missing(name, threshold, "coding") for name, threshold in names]
    rows = _rows(report)
    drafts = _draft_rows(rows)
    best = _best(drafts)
    goals = [Goal(*names[0], f"{best[1]:.2f}x ({best[0]})", best[1] >= 2.0) if best
             else _missing(*names[0], "draft row in the coding")]
    hf = _best({label: row for label, row in rows.items() if row["kind"] == "hf-assisted"}, "tokens_per_s")
    mine = _best(drafts, "tokens_per_s")
    if hf and mine:
        ratio = mine[1] / hf[1]
        goals.append(Goal(*names[1], f"{ratio:.2f}x ({mine[0]} {mine[1]:.1f} tok/s, {hf[0]} {hf[1]:.1f} tok/s)",
                          ratio >= 1.5))
    else:
        goals.append(_missing(*names[1], "hf-assisted row in the coding"))
    goals.append(auto_vs_fixed(rows, names[2]))
    return goals


def auto_vs_fixed(rows: dict[str, dict], name: tuple[str, str]) -> Goal:
    """The auto K policy's speed-up over the best fixed-K draft row's, both over all prompts of one run."""
    auto, fixed = _best(_draft_rows(rows, "auto")), _best(_draft_rows(rows, "fixed"))
    if not auto or not fixed:
        return _missing(*name, "auto and fixed draft rows in the")
    ratio = auto[1] / fixed[1]
    return Goal(*name, f"{ratio:.2f} ({auto[0]} {auto[1]:.2f}x, {fixed[0]} {fixed[1]:.2f}x)", ratio >= 0.97)


def category_goals(report: dict | None) -> list[Goal]:
    """Auto >= 1.0x plain in every category and >= 1.3x over all 13; auto >= 0.97 of the best fixed K."""
    names = [("auto, every category", ">= 1.0x plain"), ("auto, all 13 categories", ">= 1.3x plain"),
             ("auto vs best fixed K, 13 categories", ">= 0.97")]
    if report is None:
        return [_missing(name, threshold, "categories") for name, threshold in names]
    categories = sorted({row["category"] for row in report["summary"]} - {"all"})
    overall = _best(_draft_rows(_rows(report), "auto"))  # the auto row judged in every category: the best overall
    per_category = []
    for category in categories:
        row = _rows(report, category).get(overall[0]) if overall else None
        if row and row.get("speedup_total") is not None:
            per_category.append((row["speedup_total"], category))
    goals = []
    complete = len(per_category) == SPEC_BENCH_CATEGORIES  # a judgement over all of Spec-Bench's categories
    if per_category:
        lowest, where = min(per_category)
        goals.append(Goal(*names[0], f"lowest {lowest:.2f}x ({where}; {len(per_category)} categories)",
                          lowest >= 1.0 if complete else None))
    else:
        goals.append(_missing(*names[0], "auto row in the categories"))
    goals.append(Goal(*names[1], f"{overall[1]:.2f}x ({overall[0]}; {len(per_category)} categories)",
                      overall[1] >= 1.3 if complete else None) if overall
                 else _missing(*names[1], "auto row in the categories"))
    goals.append(auto_vs_fixed(_rows(report), names[2]))
    return goals


def agent_goals(report: dict | None) -> list[Goal]:
    """On agent sessions: draft >= 2.5x plain without prefix reuse (wall time), hybrid >= suffix decoding."""
    names = [("agent: draft vs plain without reuse", ">= 2.5x"), ("agent: hybrid vs suffix", ">= 1.0x")]
    if report is None:
        return [_missing(name, threshold, "agent") for name, threshold in names]
    by_kind: dict[str, dict] = {}  # the fastest row of each kind (a report may hold several Ks)
    for row in report["summary"]:
        best = by_kind.get(row["kind"])
        if best is None or row["wall_s"] < best["wall_s"]:
            by_kind[row["kind"]] = row
    goals = []
    nocache, draft = by_kind.get("plain-nocache"), by_kind.get("draft")
    if nocache and draft:
        ratio = nocache["wall_s"] / draft["wall_s"]
        goals.append(Goal(*names[0], f"{ratio:.2f}x ({draft['method']} {draft['wall_s']:.1f} s, plain without "
                                     f"reuse {nocache['wall_s']:.1f} s)", ratio >= 2.5))
    else:
        goals.append(_missing(*names[0], "plain-nocache and draft rows in the agent"))
    hybrid, suffix = by_kind.get("hybrid"), by_kind.get("suffix")
    if hybrid and suffix:
        ratio = suffix["wall_s"] / hybrid["wall_s"]
        goals.append(Goal(*names[1], f"{ratio:.2f}x (hybrid {hybrid['wall_s']:.1f} s, suffix {suffix['wall_s']:.1f} s)",
                          ratio >= 1.0))
    else:
        goals.append(_missing(*names[1], "hybrid and suffix rows in the agent"))
    return goals


def report_flags(name: str, report: dict | None) -> list[str]:
    """Why a report's figures are void (a draftwise output that differs from plain decoding) or flagged (the
    plain passes further apart than :data:`BASELINE_SPREAD_FLAG`, an incomplete run)."""
    if report is None:
        return []
    flags = []
    if not report.get("complete", True):
        flags.append(f"{name}: incomplete run")
    rows = [row for row in report["summary"] if row.get("category", "all") == "all"]
    for row in rows:
        expected = row.get("runs", row.get("turns"))
        if not row["kind"].startswith("hf") and row.get("identical") is not None and row["identical"] != expected:
            flags.append(f"{name}: {row['method']} identical to plain in {row['identical']} of {expected} (VOID)")
    spreads: dict[str, float] = {}  # per category, the widest spread of its plain passes
    for row in report["summary"]:
        if row.get("baseline_spread") is not None:
            category = row.get("category", "all")
            spreads[category] = max(spreads.get(category, 0.0), row["baseline_spread"])
    moved = {category: spread for category, spread in spreads.items() if spread > BASELINE_SPREAD_FLAG}
    if moved:
        worst = max(moved, key=moved.get)
        where = "" if worst == "all" else f" in {len(moved)} categories, most in {worst}"
        flags.append(f"{name}: plain passes {moved[worst]:.0%} apart{where} (flagged)")
    return flags


def load_reports(directory: Path) -> dict[str, dict | None]:
    """The reports in ``directory`` by file name (None where missing).

    Raises:
        ValueError: a file that is there but not JSON (a ``costs`` run that failed mid-way).
    """
    reports = {}
    for name in (name for names in STAGE_FILES.values() for name in names):
        path = directory / name
        try:
            reports[name] = json.loads(path.read_text()) if path.exists() else None
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not a JSON report: {exc}") from None
        if reports[name] is not None:
            check_shape(path, reports[name])
        if name in PROMPT_REPORTS and reports[name] is not None and "runs" in reports[name]:
            reports[name]["summary"] += category_rows(path)
    if not any(reports.values()):
        raise ValueError(f"no reports in {directory} (expected {', '.join(reports)})")
    return reports


def check_shape(path: Path, report: object) -> None:
    """Raise ValueError unless ``report`` has the fields the goals read: a ``costs`` JSON its cost ratio and
    timings (seconds > 0), a ``bench`` report a summary of rows with a method, a kind and, for agent reports,
    a wall time > 0."""
    def bad(why: str) -> ValueError:
        return ValueError(f"{path} is not a {'costs' if path.name.startswith('costs') else 'bench'} report: {why}")

    if not isinstance(report, dict):
        raise bad("not a JSON object")
    if path.name.startswith("costs"):
        try:
            if min(report["cost_ratio_c"], report["draft_1_token_s"], report["seconds"]["1"]) <= 0:
                raise bad("a time or ratio <= 0")
        except (KeyError, TypeError):
            raise bad("no cost_ratio_c, draft_1_token_s and seconds (run costs with --draft and --json)") from None
        return
    rows = report.get("summary")
    if not isinstance(rows, list) or not all(isinstance(r, dict) and "method" in r and "kind" in r for r in rows):
        raise bad("no summary rows with a method and a kind")
    if path.name == "agent.json" and not all(isinstance(r.get("wall_s"), (int, float)) and r["wall_s"] > 0
                                             for r in rows):
        raise bad("a summary row without a wall time > 0")


def category_rows(path: Path) -> list[dict]:
    """A prompts report's summary rows per category (the JSON holds the rows over all prompts; the per-category
    ones are computed from its runs, as ``bench``'s Markdown report does)."""
    from draftwise.benchmark import load_results, summarize

    _, runs, _ = load_results(path)
    return summarize(runs, by_category=True)


def evaluate(reports: dict[str, dict | None]) -> tuple[list[Goal], list[str]]:
    """Every goal of issue 23 from the reports (:func:`load_reports`), and the reports' flags."""
    goals = cost_goals({200: reports["costs-200.json"], 1000: reports["costs-1000.json"]})
    goals += coding_goals(reports["coding.json"])
    goals += category_goals(reports["categories.json"])
    goals += agent_goals(reports["agent.json"])
    flags = [flag for name in ("coding.json", "categories.json", "agent.json")
             for flag in report_flags(name, reports[name])]
    return goals, flags


def goal_table(goals: Sequence[Goal]) -> str:
    """A Markdown table of the goals: goal, threshold, figure, met (yes / no / n/a)."""
    lines = ["| goal | threshold | figure | met |", "|---|---|---|---|"]
    for goal in goals:
        met = "n/a" if goal.met is None else ("yes" if goal.met else "**no**")
        lines.append(f"| {goal.name} | {goal.threshold} | {goal.figure} | {met} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None, cpu_line: Callable[[], str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the stages (idle machine), then evaluate")
    run.add_argument("--out", type=Path, default=Path("bench_results/goals"),
                     help="folder for the reports (default bench_results/goals)")
    run.add_argument("--stages", default=",".join(STAGE_FILES), help=f"comma-separated of {','.join(STAGE_FILES)}")
    run.add_argument("--again", action="store_true", help="rerun stages whose reports exist")
    run.add_argument("--draftwise", default=str(Path(sys.executable).with_name("draftwise")),
                     help="the draftwise command (default: the one beside this Python)")
    evaluate_parser = sub.add_parser("evaluate", help="the goal table from a folder's reports")
    evaluate_parser.add_argument("directory", type=Path)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    directory = args.out if args.command == "run" else args.directory
    if args.command == "run":
        stages = [s.strip() for s in args.stages.split(",") if s.strip()]
        unknown = sorted(set(stages) - set(STAGE_FILES))
        if unknown:
            parser.error(f"unknown stage(s) {', '.join(unknown)}; choose from {', '.join(STAGE_FILES)}")
        directory.mkdir(parents=True, exist_ok=True)
        commands = stage_commands(directory, args.draftwise)
        for stage in stages:
            if not args.again and stage_done(directory, stage):
                log.info("stage %s: reports there, skipped (--again reruns it)", stage)
                continue
            try:
                run_stage(stage, commands[stage], directory)
            except RuntimeError as exc:
                print(f"draft_goals: error: {exc}", file=sys.stderr)
                return 1
    elif not directory.is_dir():
        parser.error(f"{directory} is not a folder")
    try:
        goals, flags = evaluate(load_reports(directory))
    except ValueError as exc:
        parser.error(str(exc))
    if cpu_line is None:
        from draftwise.machine import cpu_description as cpu_line
    print(f"CPU: {cpu_line()}")
    print(goal_table(goals))
    for flag in flags:
        print(f"- {flag}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
