"""Rich tables for a :class:`~draftwise.check.report.CheckReport` (the CLI's human-readable output)."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from draftwise.units import format_bytes
from draftwise.check.report import CheckReport

__all__ = ["render_report"]

_VERDICT_STYLES = {"helps": "bold green", "marginal": "bold yellow", "not_measured": "bold", "unknown": "bold yellow"}


def _fmt(value, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def _models_table(report: CheckReport) -> Table:
    settings = report.settings
    target_size = settings["bytes_per_param"]
    draft_size = settings.get("draft_bytes_per_param", target_size)
    draft_dtype = settings.get("draft_dtype", settings["dtype"])
    dtypes = settings["dtype"] if draft_dtype == settings["dtype"] else f"{settings['dtype']} / {draft_dtype}"
    table = Table(title="models", title_justify="left")
    for column in ("", "target", "draft"):
        table.add_column(column)
    rows = [  # each cell from a model's description and the bytes per element it runs in
        ("model", lambda d, size: d.name),
        ("architecture", lambda d, size: d.architecture),
        ("parameters", lambda d, size: f"{d.num_parameters / 1e6:,.1f} M"),
        (f"weights ({dtypes})", lambda d, size: format_bytes(d.weight_bytes(size))),
        ("KV cache per token", lambda d, size: format_bytes(d.kv_bytes_per_token(size))),
        ("layers x KV heads x head dim", lambda d, size: f"{d.num_layers} x {max(d.kv_heads)} x {d.key_dim}"),
        ("logits width / tokenizer tokens", lambda d, size: f"{d.vocab_width} / {len(d.tokenizer.tokens)}"),
        ("context length", lambda d, size: _fmt(d.context_length, "d")),
    ]
    for label, cell in rows:
        table.add_row(label, cell(report.target, target_size), cell(report.draft, draft_size))
    return table


def _print_tokenizer(console: Console, report: CheckReport) -> None:
    tok = report.tokenizer
    status = "[green]compatible[/]" if tok.ok else "[bold red]INCOMPATIBLE[/]"
    console.print(f"tokenizer: {status} ({tok.target_tokens} target / {tok.draft_tokens} draft tokens)")
    for line in tok.errors:
        console.print(f"  [red]error:[/] {escape(line)}", highlight=False, soft_wrap=True)
    for line in tok.warnings:
        console.print(f"  [yellow]warning:[/] {escape(line)}", highlight=False, soft_wrap=True)
    for line in tok.notes:
        console.print(f"  note: {escape(line)}", highlight=False, soft_wrap=True)


def _memory_table(report: CheckReport) -> Table:
    mem = report.memory
    assert mem is not None
    tokens = f"{mem.context_len} tokens x {mem.num_seqs} seq"
    dtypes = mem.dtype if mem.draft_dtype == mem.dtype else f"target {mem.dtype}, draft {mem.draft_dtype}"
    table = Table(title=f"memory ({dtypes})", title_justify="left")
    table.add_column("")
    table.add_column("bytes", justify="right")
    for label, value in (("target weights", mem.target_weights), ("draft weights", mem.draft_weights),
                         (f"target KV cache ({tokens})", mem.target_kv), (f"draft KV cache ({tokens})", mem.draft_kv),
                         ("added by the draft", mem.draft_total), ("total", mem.total),
                         (f"budget ({mem.budget_source or 'unknown'})", mem.budget), ("headroom", mem.headroom)):
        table.add_row(label, format_bytes(value))
    return table


def _prediction_table(report: CheckReport) -> Table:
    best = report.verdict.best_k
    table = Table(title="predicted speed-up by K", title_justify="left")
    for column in ("K", "c", "v(K+1)", "tokens / target pass", "speed-up"):
        table.add_column(column, justify="right")
    for p in report.predictions:
        style = "bold" if p.k == best else None
        table.add_row(str(p.k), _fmt(p.cost_ratio), _fmt(p.verify_cost), _fmt(p.tokens_per_step),
                      f"{p.speedup:.2f}x" + (" <- best" if p.k == best else ""), style=style)
    return table


def _probe_table(report: CheckReport) -> Table:
    probe = report.probe
    assert probe is not None
    table = Table(title=f"acceptance probe (greedy, K={probe.k}, up to {probe.max_tokens} tokens)",
                  title_justify="left")
    for column in ("prompt", "category", "prompt tokens", "generated", "drafted", "accepted", "alpha"):
        table.add_column(column)
    for p in probe.prompts:
        table.add_row(p.prompt_id, p.category, str(p.prompt_tokens), str(p.generated_tokens), str(p.draft_tokens),
                      str(p.accepted_tokens), _fmt(p.acceptance_rate))
    return table


def _print_measurements(console: Console, report: CheckReport) -> None:
    costs, probe = report.costs, report.probe
    if report.draft_runtime:
        console.print(f"draft runtime: {escape(report.draft_runtime)}", highlight=False, soft_wrap=True)
    if probe is not None:
        console.print(_probe_table(report))
        console.print(f"acceptance rate = {_fmt(probe.acceptance_rate, '.3f')} "
                      f"({probe.accepted_tokens}/{probe.draft_tokens} draft tokens), "
                      f"per-token acceptance a = {_fmt(probe.token_acceptance, '.3f')}, "
                      f"tau = {_fmt(probe.mean_accepted_length)} tokens per target pass"
                      + (f"; skipped (too long): {', '.join(probe.skipped)}" if probe.skipped else ""))
    if costs is not None:
        curve = ", ".join(f"v{k}={costs.target.relative(k):.2f}" for k in sorted(costs.target.seconds))
        console.print(f"costs: target 1 token {costs.target.seconds[1] * 1000:.1f} ms, draft 1 token "
                      f"{costs.draft_1_token_s * 1000:.1f} ms, c = {costs.cost_ratio:.2f}; verify curve {curve}")
        for line in costs.warnings():
            console.print(f"  [yellow]warning:[/] {escape(line)}", highlight=False, soft_wrap=True)
    if report.predictions:
        console.print(_prediction_table(report))


def render_report(report: CheckReport, console: Console) -> None:
    """Print the report: models, tokenizer, memory, measurements, verdict."""
    console.print(_models_table(report))
    _print_tokenizer(console, report)
    if report.memory is not None:
        console.print(_memory_table(report))
        console.print(f"memory: {escape(report.memory.summary())}", highlight=False, soft_wrap=True)
    _print_measurements(console, report)
    verdict = report.verdict
    style = _VERDICT_STYLES.get(verdict.status, "bold red")
    console.print(f"[{style}]verdict: {escape(verdict.text)}[/]", highlight=False, soft_wrap=True)
    if verdict.status != "incompatible":  # the tokenizer errors above are the reason
        console.print(f"because: {escape(verdict.reason)}", highlight=False, soft_wrap=True)
