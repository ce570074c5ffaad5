"""Benchmark reports: a Markdown summary and PNG plots (matplotlib, headless)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from draftwise.speculation import measurement
from draftwise.benchmark import PromptRun, doubts_of
from draftwise.stats import hybrid_steps_line

__all__ = ["markdown_table", "write_markdown", "write_plots", "agent_method_rows", "agent_session_rows",
           "write_agent_markdown", "write_agent_plots", "hybrid_lines"]


def _fmt(value, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def hybrid_lines(rows: Sequence[dict]) -> list[str]:
    """One line per summary row whose method ran the hybrid (``row["hybrid_steps"]``): its passes by side."""
    return [f"{row['method']}: {hybrid_steps_line(row['hybrid_steps'])}" for row in rows if row.get("hybrid_steps")]


def _hybrid_markdown(summary: Sequence[dict]) -> list[str]:
    """The :func:`hybrid_lines` as a Markdown list after a table (nothing when no hybrid ran)."""
    found = hybrid_lines(summary)
    return ["", *(f"- {line}" for line in found)] if found else []


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """A GitHub Markdown table as lines: header, separator, one line per row (cells as given; ``|`` escaped).

    Raises:
        ValueError: a row with another number of cells than ``columns``.
    """
    for row in rows:
        if len(row) != len(columns):
            raise ValueError(f"a table row has {len(row)} cells for {len(columns)} columns: {row!r}")

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(str(cell).replace("|", "\\|") for cell in cells) + " |"

    return [line(columns), "|" + "---|" * len(columns)] + [line(row) for row in rows]


def _prefill_note(calibration: dict) -> str:
    """The draft's calibrated prefill rate, which the predicted column prices each prompt's catch-up with (older
    reports have none: their predictions leave the catch-up out)."""
    seconds = calibration.get("draft_prefill_token_s")
    if not seconds:
        return ""
    return f"; draft prefill: {1 / seconds:.0f} tokens/s (the predicted column prices each prompt's catch-up at it)"


def write_markdown(path: Path, config: dict, summary: list[dict], by_category: list[dict], calibration: dict,
                   runs: Sequence[PromptRun]) -> Path:
    """Write the benchmark summary (overall and per category) and any exactness failures as Markdown."""
    lines = [f"# draftwise bench: {config.get('target')} (draft: {config.get('draft')})", "",
             f"Prompts: {config.get('prompts')} categories={config.get('categories')} limit={config.get('limit')}, "
             f"max_tokens={config.get('max_tokens')}, greedy={config.get('greedy')}", ""]
    columns = ("!", "category", "method", "tokens/s", "speedup (total)", "decode speedup", "speedup median [min, max]",
               "alpha", "tau", "mean K", "identical", "overhead", "peak RSS (GB)", "predicted")
    rows = []
    for row in summary + by_category:
        spread = f"{_fmt(row['speedup_median'])} [{_fmt(row['speedup_min'])}, {_fmt(row['speedup_max'])}]"
        rows.append((measurement.marker(row.get("warnings", [])), row["category"], row["method"],
                     _fmt(row["tokens_per_s"]), _fmt(row["speedup_total"]),
                     _fmt(row.get("decode_speedup_total")), spread, _fmt(row["acceptance_rate"], ".3f"),
                     _fmt(row["mean_accepted_length"]), _fmt(row["mean_k"], ".1f"), f"{row['identical']}/{row['runs']}",
                     _fmt(row["overhead_share"], ".1%"), f"{row['peak_rss_bytes'] / 1e9:.1f}",
                     _fmt(row.get("predicted_speedup"))))
    lines += ["## Results", ""] + markdown_table(columns, rows)
    lines += _hybrid_markdown(summary)
    lines += ["", "## Measurement", ""] + measurement_lines(doubts_of(summary + by_category, calibration), summary)
    if calibration:
        rel = calibration.get("target", {}).get("relative", {})
        lines += ["", "## Calibration", "",
                  f"target one-token forward: {calibration['target']['seconds']['1'] * 1000:.0f} ms; "
                  f"draft one-token forward: {calibration.get('draft_1_token_s', 0) * 1000:.0f} ms; "
                  f"c = {_fmt(calibration.get('cost_ratio_c'))}" + _prefill_note(calibration),
                  "", "verify cost v_k (k-token pass / one-token pass): "
                  + ", ".join(f"v{k} = {float(v):.2f}" for k, v in rel.items())]
    failures = [r for r in runs if not r.identical_to_plain]
    lines += ["", "## Exactness", ""]
    lines += [f"- {r.method} on prompt {r.prompt_id} turn {r.turn}: first differing token {r.first_difference}"
              for r in failures] or ["All outputs identical to plain decoding."]
    path.write_text("\n".join(lines) + "\n")
    return path


def measurement_lines(doubts: Sequence[tuple[str, dict]], summary: Sequence[dict]) -> list[str]:
    """Markdown lines: the baseline passes' spread, then the legend, the closing warning and every doubt, or a
    line saying that no figure is in doubt (``doubts``: ``(what, doubt dict)``; ``summary``: rows with
    ``baseline_spread``)."""
    lines = []
    spread = next((row.get("baseline_spread") for row in summary if row.get("baseline_spread") is not None), None)
    lines.append("Baseline passes (before and after the other methods) " + (
        f"{spread:.0%} apart; speed-ups are over their mean." if spread is not None else "not repeated."))
    lines.append("")
    if not doubts:
        return [*lines, ("No figure in doubt by the rules of `draftwise.speculation.measurement` (baseline moved, machine "
                         "busy, far from prediction).")]
    lines += [measurement.legend(d for _, d in doubts) or "", "", measurement.warning_line(doubts) or "", ""]
    return lines + [f"- {what}: {d['code']} {d['reason']}: {d['detail']}" for what, d in doubts]


def write_plots(directory: Path, runs: Sequence[PromptRun], by_category: list[dict], summary: list[dict]) -> list[Path]:
    """Speed-up by category and method; acceptance by draft position; tokens/s over time with the K used."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    written = [_plot_speedup(plt, directory / "speedup_by_category.png", by_category),
               _plot_acceptance(plt, directory / "acceptance_by_position.png", summary),
               _plot_timeline(plt, directory / "tokens_per_s_over_time.png", runs)]
    return [p for p in written if p is not None]


def _plot_speedup(plt, path: Path, rows: list[dict]) -> Path:
    return _grouped_speedup_bars(plt, path, rows, "category", "speedup_median", "median speedup over plain",
                                 inch_per_bar=1.2)


def _grouped_speedup_bars(plt, path: Path, rows: Sequence[dict], group_key: str, value_key: str, ylabel: str, *,
                          inch_per_bar: float, tick_fontsize: float | None = None) -> Path:
    """One bar per (group, method) from ``rows`` (``row[value_key]``, None drawn as 0), groups along x, a line
    at 1.0: the speed-up plots of both workloads."""
    groups = list(dict.fromkeys(r[group_key] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(6, inch_per_bar * len(groups) * max(1, len(methods)) / 2), 4))
    width = 0.8 / max(1, len(methods))
    for j, method in enumerate(methods):
        values = [next((r[value_key] or 0 for r in rows if r[group_key] == g and r["method"] == method), 0)
                  for g in groups]
        ax.bar([i + j * width for i in range(len(groups))], values, width, label=method)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([i + width * (len(methods) - 1) / 2 for i in range(len(groups))], groups, fontsize=tick_fontsize)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)
    return _save(plt, fig, path)


def _plot_acceptance(plt, path: Path, summary: list[dict]) -> Path | None:
    rows = [r for r in summary if r.get("acceptance_by_position")]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for row in rows:
        values = row["acceptance_by_position"]
        ax.plot(range(1, len(values) + 1), values, marker="o", label=row["method"])
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance (accepted / drafted at that position)")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=7)
    return _save(plt, fig, path)


def _plot_timeline(plt, path: Path, runs: Sequence[PromptRun]) -> Path | None:
    """Per method, the first prompt's cumulative tokens/s over the request, with the K of each step."""
    firsts: dict[str, PromptRun] = {}
    for run in runs:
        if run.stats.get("step_end_s") and run.method not in firsts:
            firsts[run.method] = run
    if not firsts:
        return None
    fig, (ax_rate, ax_k) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    for label, run in firsts.items():
        times, tokens = run.stats["step_end_s"], run.stats["step_tokens"]
        cumulative, rate = 0, []
        for t, n in zip(times, tokens):
            cumulative += n
            rate.append(cumulative / t if t > 0 else 0.0)
        ax_rate.plot(times, rate, label=label)
        ax_k.step(times, run.stats["k_history"], where="post", label=label)
    ax_rate.set_ylabel("tokens/s so far")
    ax_k.set_ylabel("K used")
    ax_k.set_xlabel("seconds since request start")
    ax_rate.legend(fontsize=7)
    return _save(plt, fig, path)


def _save(plt, fig, path: Path) -> Path:
    """Lay out, write (110 dpi PNG) and close a figure."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------- agent-loop workload
AGENT_METHOD_COLUMNS = ("!", "method", "sessions", "turns", "wall s", "speedup", "TTFT first turn s",
                        "TTFT later turns s (mean)", "decode tok/s", "prompt tokens", "cached", "alpha", "identical")
AGENT_SESSION_COLUMNS = ("method", "session", "turns", "context tokens (last turn)", "wall s", "speedup", "TTFT s",
                         "decode tok/s", "identical")
AGENT_TURN_COLUMNS = ("method", "session", "turn", "prompt tokens", "cached", "TTFT s", "decode tok/s", "wall s",
                      "output tokens", "identical")


def _cached_cell(row: dict) -> str:
    if row.get("cached_tokens") is None:
        return "-"
    return f"{row['cached_tokens']} ({_fmt(row.get('cached_share'), '.0%')})"


def agent_method_rows(summary: Sequence[dict]) -> list[tuple[str, ...]]:
    """Table cells (in :data:`AGENT_METHOD_COLUMNS` order) of :func:`draftwise.agent_bench.summarize_agent` rows."""
    return [(measurement.marker(r.get("warnings", [])), r["method"], str(r["sessions"]), str(r["turns"]),
             _fmt(r["wall_s"]), _fmt(r["speedup"]),
             _fmt(r["ttft_first_turn_mean_s"]), _fmt(r["ttft_later_turns_mean_s"]), _fmt(r["decode_tokens_per_s"]),
             _fmt(r["prompt_tokens"], "d"), _cached_cell(r), _fmt(r["acceptance_rate"], ".3f"),
             f"{r['identical']}/{r['turns']}") for r in summary]


def agent_session_rows(sessions: Sequence[dict]) -> list[tuple[str, ...]]:
    """Table cells (in :data:`AGENT_SESSION_COLUMNS` order) of :func:`draftwise.agent_bench.session_totals` rows."""
    return [(r["method"], r["session_id"], str(r["turns"]), _fmt(r["max_prompt_tokens"], "d"), _fmt(r["wall_s"]),
             _fmt(r["speedup"]), _fmt(r["ttft_s"]), _fmt(r["decode_tokens_per_s"]), f"{r['identical']}/{r['turns']}")
            for r in sessions]


#: Columns of the tool-using workload's table (:func:`tool_agent_rows`); "grammar s/token" only when a row has it.
TOOL_AGENT_COLUMNS = ("method", "wall s", "speedup", "tok/s", "valid calls", "tool turns", "alpha tool",
                      "tau tool", "alpha other", "tau other", "grammar s/token", "transcript")


def tool_agent_columns(summary: Sequence[dict]) -> tuple[str, ...]:
    """:data:`TOOL_AGENT_COLUMNS`, without "grammar s/token" when no row of ``summary`` reports it."""
    if any(r.get("grammar_s_per_token") is not None for r in summary):
        return TOOL_AGENT_COLUMNS
    return tuple(c for c in TOOL_AGENT_COLUMNS if c != "grammar s/token")


def tool_agent_rows(summary: Sequence[dict]) -> list[tuple[str, ...]]:
    """Table cells (in :func:`tool_agent_columns` order) of :func:`draftwise.tool_agent_bench.summarize_tool_agent`
    rows; a transcript that differs from the baseline's reads "DIFFERS (bug)"."""
    grammar = "grammar s/token" in tool_agent_columns(summary)
    rows = []
    for r in summary:
        cells = [r["method"], _fmt(r["wall_s"]), _fmt(r["speedup"]), _fmt(r["tokens_per_s"], ".1f"),
                 f"{r['valid_calls']}/{r['calls']}", f"{r['tool_turns']}/{r['turns']}", _fmt(r["alpha_tool"], ".3f"),
                 _fmt(r["tau_tool"]), _fmt(r["alpha_other"], ".3f"), _fmt(r["tau_other"])]
        if grammar:
            cells.append(_fmt(r.get("grammar_s_per_token"), ".2e"))
        cells.append("identical" if r["transcript_identical"] else "DIFFERS (bug)")
        rows.append(tuple(cells))
    return rows


def tool_agent_markdown(summary: Sequence[dict]) -> list[str]:
    """The tool-using workload's section of the Markdown report (lines)."""
    return ["## Tool calls", "",
            "Each turn is one model call with `tools`; a tool-call turn is a reply with `tool_calls`. alpha: "
            "accepted / drafted tokens; tau: 1 + accepted / target passes. transcript: every reply's content and "
            "tool calls equal the baseline's (a difference is a bug of the method).", ""] + \
        markdown_table(tool_agent_columns(summary), tool_agent_rows(summary))


def write_agent_markdown(path: Path, config: dict, summary: Sequence[dict], sessions: Sequence[dict], turns,
                         extra_sections: Sequence[str] = ()) -> Path:
    """Write the agent-loop report: per method, per session and per turn tables, and any output that differs
    from the baseline (``turns``: :class:`draftwise.agent_bench.AgentTurn` objects); ``extra_sections``: lines
    put after the methods' table (e.g. :func:`tool_agent_markdown`)."""
    source = config.get("urls") or f"{config.get('target')} (draft: {config.get('draft')})"
    lines = [f"# draftwise bench --workload agent: {source}", "",
             f"Sessions: {config.get('sessions')} ({config.get('num_sessions')} sessions, up to "
             f"{config.get('max_turns')} turns), max_tokens={config.get('max_tokens')}, greedy={config.get('greedy')}, "
             f"concurrency={config.get('concurrency')}" + (f" ({config['concurrency_note']})"
                                                           if config.get("concurrency_note") else ""),
             "", "Each turn carries the whole conversation so far, with the method's own earlier answers. "
             "Speed-up: the baseline's (first method's) wall time / the method's, summed over the turns.", ""]
    lines += ["## Methods", ""] + markdown_table(AGENT_METHOD_COLUMNS, agent_method_rows(summary))
    lines += ["", *extra_sections] if extra_sections else []
    lines += _hybrid_markdown(summary)
    doubts = [(row["method"], d) for row in summary for d in row.get("warnings", [])]
    lines += ["", "## Measurement", ""] + measurement_lines(doubts, summary)
    lines += ["", "## Sessions", ""] + markdown_table(AGENT_SESSION_COLUMNS, agent_session_rows(sessions))
    turn_rows = [(t.method, t.session_id, str(t.turn), _fmt(t.prompt_tokens, "d"), _fmt(t.cached_tokens, "d"),
                  _fmt(t.ttft_s), _fmt(t.decode_tokens_per_s), _fmt(t.wall_s), str(t.output_tokens),
                  "yes" if t.identical_to_plain else f"no (from {t.first_difference})") for t in turns]
    lines += ["", "## Turns", ""] + markdown_table(AGENT_TURN_COLUMNS, turn_rows)
    failures = [t for t in turns if not t.identical_to_plain]
    lines += ["", "## Exactness", ""]
    lines += [f"- {t.method}, session {t.session_id} turn {t.turn}: first difference at "
              f"{'token' if t.token_ids is not None else 'character'} {t.first_difference}" for t in failures] or [
        "All outputs identical to the baseline's, turn by turn."]
    path.write_text("\n".join(lines) + "\n")
    return path


def write_agent_plots(directory: Path, turns, sessions: Sequence[dict]) -> list[Path]:
    """``agent_turns.png``: mean TTFT and wall time per turn index, per method; ``agent_speedup_by_session.png``:
    each method's speed-up over the baseline per session."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    return [_plot_agent_turns(plt, directory / "agent_turns.png", turns),
            _plot_agent_speedup(plt, directory / "agent_speedup_by_session.png", sessions)]


def _plot_agent_turns(plt, path: Path, turns) -> Path:
    fig, (ax_ttft, ax_wall) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    for method in dict.fromkeys(t.method for t in turns):
        by_turn: dict[int, list] = {}
        for t in turns:
            if t.method == method:
                by_turn.setdefault(t.turn, []).append(t)
        indices = sorted(by_turn)
        ttft = [_mean([t.ttft_s for t in by_turn[i] if t.ttft_s is not None]) for i in indices]
        wall = [_mean([t.wall_s for t in by_turn[i]]) for i in indices]
        ax_ttft.plot(indices, ttft, marker="o", label=method)
        ax_wall.plot(indices, wall, marker="o", label=method)
    ax_ttft.set_ylabel("time to first token (s)")
    ax_wall.set_ylabel("turn wall time (s)")
    ax_wall.set_xlabel("turn (mean over sessions)")
    ax_ttft.legend(fontsize=7)
    return _save(plt, fig, path)


def _plot_agent_speedup(plt, path: Path, sessions: Sequence[dict]) -> Path:
    return _grouped_speedup_bars(plt, path, sessions, "session_id", "speedup", "session speed-up over the baseline",
                                 inch_per_bar=0.8, tick_fontsize=7)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")
