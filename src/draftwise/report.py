"""Benchmark reports: a Markdown summary and PNG plots (matplotlib, headless)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from draftwise.benchmark import PromptRun

__all__ = ["markdown_table", "write_markdown", "write_plots"]


def _fmt(value, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


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


def write_markdown(path: Path, config: dict, summary: list[dict], by_category: list[dict], calibration: dict,
                   runs: Sequence[PromptRun]) -> Path:
    """Write the benchmark summary (overall and per category) and any exactness failures as Markdown."""
    lines = [f"# draftwise bench: {config.get('target')} (draft: {config.get('draft')})", "",
             f"Prompts: {config.get('prompts')} categories={config.get('categories')} limit={config.get('limit')}, "
             f"max_tokens={config.get('max_tokens')}, greedy={config.get('greedy')}", ""]
    columns = ("category", "method", "tokens/s", "speedup (total)", "decode speedup", "speedup median [min, max]",
               "alpha", "tau", "mean K", "identical", "overhead", "peak RSS (GB)", "predicted")
    rows = []
    for row in summary + by_category:
        spread = f"{_fmt(row['speedup_median'])} [{_fmt(row['speedup_min'])}, {_fmt(row['speedup_max'])}]"
        rows.append((row["category"], row["method"], _fmt(row["tokens_per_s"]), _fmt(row["speedup_total"]),
                     _fmt(row.get("decode_speedup_total")), spread, _fmt(row["acceptance_rate"], ".3f"),
                     _fmt(row["mean_accepted_length"]), _fmt(row["mean_k"], ".1f"), f"{row['identical']}/{row['runs']}",
                     _fmt(row["overhead_share"], ".1%"), f"{row['peak_rss_bytes'] / 1e9:.1f}",
                     _fmt(row.get("predicted_speedup"))))
    lines += ["## Results", ""] + markdown_table(columns, rows)
    if calibration:
        rel = calibration.get("target", {}).get("relative", {})
        lines += ["", "## Calibration", "",
                  f"target one-token forward: {calibration['target']['seconds']['1'] * 1000:.0f} ms; "
                  f"draft one-token forward: {calibration.get('draft_1_token_s', 0) * 1000:.0f} ms; "
                  f"c = {_fmt(calibration.get('cost_ratio_c'))}",
                  "", "verify cost v_k (k-token pass / one-token pass): "
                  + ", ".join(f"v{k} = {float(v):.2f}" for k, v in rel.items())]
    failures = [r for r in runs if not r.identical_to_plain]
    lines += ["", "## Exactness", ""]
    lines += [f"- {r.method} on prompt {r.prompt_id} turn {r.turn}: first differing token {r.first_difference}"
              for r in failures] or ["All outputs identical to plain decoding."]
    path.write_text("\n".join(lines) + "\n")
    return path


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
    categories = list(dict.fromkeys(r["category"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(categories) * max(1, len(methods)) / 2), 4))
    width = 0.8 / max(1, len(methods))
    for j, method in enumerate(methods):
        values = [next((r["speedup_median"] or 0 for r in rows if r["category"] == c and r["method"] == method), 0)
                  for c in categories]
        ax.bar([i + j * width for i in range(len(categories))], values, width, label=method)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([i + width * (len(methods) - 1) / 2 for i in range(len(categories))], categories)
    ax.set_ylabel("median speedup over plain")
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

