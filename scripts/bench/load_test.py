#!/usr/bin/env python
"""Small, bounded load test for a running draftwise (or any OpenAI-compatible) server on this machine, or for a
draftwise server this script starts in-process (``--serve TARGET``).

For each concurrency level N, N clients each send R streaming requests one after another (with
``stream_options.include_usage``) and the script reports, per level:

- time to first token (TTFT): request sent -> first chunk carrying text, seconds (mean / p50 / p95);
- per-request decode speed: (completion tokens - 1) / (last chunk - first text chunk), tokens/s;
- per-client throughput: a client's completion tokens / the time it spent on its requests, tokens/s (mean and
  slowest client);
- aggregate throughput: all completion tokens / wall time of the level, tokens/s;
- end-to-end latency and, from ``usage.speculative`` when the server sends it, the acceptance rate and the
  mean accepted length;
- from a draftwise server's ``/metrics`` (continuous batching): the mean number of sequences per target pass
  and the mean K the engine gave a decoding sequence per step during the level (the load-aware K).

Only loopback servers are accepted (127.0.0.0/8, ::1, localhost), and the request volume is capped.

Examples::

    draftwise serve qwen2.5-coder-1.5b --quantization int8 --speculative-config '{"method": "ngram"}' &
    python scripts/bench/load_test.py --base-url http://127.0.0.1:8000 --concurrency 1,8 --max-tokens 64 --ignore-eos

    # in-process: stories260K, int8 lean runtime, 8 slots, n-gram speculation with the load-aware K
    python scripts/bench/load_test.py --serve ../shared/models/stories260K/stories260K.gguf --quantization int8 \
        --speculative-config '{"method": "ngram", "k_policy": "auto"}' --max-num-seqs 8 --concurrency 1,4,8
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import logging
import re
import socket
import statistics
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from urllib.parse import urlparse

import httpx

import openai

logger = logging.getLogger("load_test")

MAX_CONCURRENCY = 64
MAX_REQUESTS_PER_CLIENT = 20
MAX_TOTAL_REQUESTS = 500
MAX_TOKENS_LIMIT = 4096

DEFAULT_PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Once upon a time, in a small village by the sea,",
    "Explain what a hash table is in two sentences.",
    "def quicksort(items):",
    "Lily and Ben went to the park. They saw",
    "List three uses of a binary search tree.",
    "The little dog ran to the door because",
    "Write a SQL query that counts the rows of a table named users.",
]


@dataclass
class RequestResult:
    """One request's client-side measurements (seconds, tokens)."""

    ttft_s: float | None
    e2e_s: float
    completion_tokens: int
    acceptance_rate: float | None
    mean_accepted_length: float | None
    error: str | None = None

    @property
    def decode_tokens_per_s(self) -> float | None:
        """(tokens - 1) / (e2e - ttft): the streaming rate after the first token."""
        if self.ttft_s is None or self.completion_tokens < 2 or self.e2e_s <= self.ttft_s:
            return None
        return (self.completion_tokens - 1) / (self.e2e_s - self.ttft_s)


@dataclass
class LevelSummary:
    """Aggregates for one concurrency level."""

    concurrency: int
    requests: int
    errors: int
    wall_s: float
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p95_s: float
    e2e_mean_s: float
    decode_tokens_per_s_mean: float
    aggregate_tokens_per_s: float
    completion_tokens: int
    acceptance_rate_mean: float | None
    mean_accepted_length_mean: float | None
    client_tokens_per_s_mean: float = float("nan")
    client_tokens_per_s_min: float = float("nan")
    batch_size_mean: float | None = None
    batch_k_mean: float | None = None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (loopback only)")
    parser.add_argument("--api-key", default="none")
    parser.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    parser.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    parser.add_argument("--concurrency", default="1,8", help="comma-separated client counts (default 1,8)")
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--ignore-eos", action="store_true", help="fixed-length outputs (vLLM extra field)")
    parser.add_argument("--prompts-file", default=None, help="one prompt per line (default: built-in prompts)")
    parser.add_argument("--warmup", type=int, default=1, help="sequential warm-up requests (not measured)")
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    parser.add_argument("--prompt-repeat", type=int, default=1,
                        help="send each prompt repeated this many times (longer prompts, e.g. for TTFT)")
    parser.add_argument("--json", dest="json_path", default=None, help="write the summaries and requests here")
    serve = parser.add_argument_group("in-process server (instead of --base-url)")
    serve.add_argument("--serve", metavar="TARGET", default=None,
                       help="start a draftwise server for TARGET in this process on a free loopback port")
    serve.add_argument("--speculative-config", default=None, help="JSON, as draftwise serve takes it")
    serve.add_argument("--quantization", default="int8", help="none or int8 (default int8: the lean runtime)")
    serve.add_argument("--runtime", default="auto", help="lean, transformers or auto")
    serve.add_argument("--max-num-seqs", type=int, default=8, help="continuous batching slots (1: one at a time)")
    serve.add_argument("--max-num-batched-tokens", type=int, default=256)
    serve.add_argument("--max-model-len", type=int, default=None)
    serve.add_argument("--torch-threads", type=int, default=None, help="torch intra-op threads of the server")
    return parser.parse_args(argv)


def check_bounds(args: argparse.Namespace, levels: list[int]) -> None:
    """Refuse non-loopback servers and oversized runs (raises SystemExit with a message)."""
    host = urlparse(args.base_url).hostname or ""
    if host != "localhost":
        try:
            if not ipaddress.ip_address(host).is_loopback:
                raise SystemExit(f"refusing non-loopback host {host!r}: this load test only targets this machine")
        except ValueError:
            raise SystemExit(f"refusing host {host!r}: use 127.0.0.1, ::1 or localhost") from None
    if not levels or min(levels) < 1 or max(levels) > MAX_CONCURRENCY:
        raise SystemExit(f"--concurrency levels must be in 1..{MAX_CONCURRENCY}")
    if not 1 <= args.requests_per_client <= MAX_REQUESTS_PER_CLIENT:
        raise SystemExit(f"--requests-per-client must be in 1..{MAX_REQUESTS_PER_CLIENT}")
    if sum(levels) * args.requests_per_client > MAX_TOTAL_REQUESTS:
        raise SystemExit(f"more than {MAX_TOTAL_REQUESTS} requests in total; lower the levels or requests")
    if not 1 <= args.max_tokens <= MAX_TOKENS_LIMIT:
        raise SystemExit(f"--max-tokens must be in 1..{MAX_TOKENS_LIMIT}")
    if not 1 <= args.prompt_repeat <= 100:
        raise SystemExit("--prompt-repeat must be in 1..100")


async def one_request(client: openai.AsyncOpenAI, args: argparse.Namespace, model: str, prompt: str) -> RequestResult:
    """Send one streaming request and time it."""
    extra = {"ignore_eos": True} if args.ignore_eos else None
    common = dict(model=model, max_tokens=args.max_tokens, temperature=args.temperature, stream=True,
                  stream_options={"include_usage": True}, extra_body=extra)
    start = time.perf_counter()
    ttft, usage = None, None
    try:
        if args.endpoint == "chat":
            stream = await client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **common)
        else:
            stream = await client.completions.create(prompt=prompt, **common)
        async for chunk in stream:
            if chunk.choices and ttft is None and _chunk_text(chunk, args.endpoint):
                ttft = time.perf_counter() - start
            if getattr(chunk, "usage", None) is not None:
                usage = chunk.usage
    except openai.OpenAIError as exc:
        return RequestResult(None, time.perf_counter() - start, 0, None, None, error=str(exc))
    e2e = time.perf_counter() - start
    spec = (getattr(usage, "model_extra", None) or {}).get("speculative") if usage is not None else None
    return RequestResult(
        ttft_s=ttft, e2e_s=e2e, completion_tokens=usage.completion_tokens if usage else 0,
        acceptance_rate=spec["acceptance_rate"] if spec and spec.get("num_draft_tokens") else None,
        mean_accepted_length=spec["mean_accepted_length"] if spec else None,
    )


def _chunk_text(chunk, endpoint: str) -> str:
    choice = chunk.choices[0]
    return (choice.delta.content or "") if endpoint == "chat" else (choice.text or "")


async def run_level(client: openai.AsyncOpenAI, args: argparse.Namespace, model: str, prompts: list[str],
                    concurrency: int) -> tuple[LevelSummary, list[RequestResult]]:
    """N clients, each sending its requests back to back; returns the summary and every request."""

    async def client_loop(index: int) -> list[RequestResult]:
        results = []
        for r in range(args.requests_per_client):
            prompt = prompts[(index * args.requests_per_client + r) % len(prompts)]
            results.append(await one_request(client, args, model, prompt))
        return results

    before = await batching_metrics(args.base_url)
    start = time.perf_counter()
    per_client = await asyncio.gather(*(client_loop(i) for i in range(concurrency)))
    wall = time.perf_counter() - start
    after = await batching_metrics(args.base_url)
    results = [r for rs in per_client for r in rs]
    summary = summarize(concurrency, results, wall)
    client_rates = [sum(r.completion_tokens for r in rs) / sum(r.e2e_s for r in rs)
                    for rs in per_client if sum(r.e2e_s for r in rs) > 0]
    summary.client_tokens_per_s_mean = _mean(client_rates)
    summary.client_tokens_per_s_min = min(client_rates) if client_rates else float("nan")
    summary.batch_size_mean = _delta_mean(before, after, "draftwise:batch_size")
    summary.batch_k_mean = _delta_mean(before, after, "draftwise:spec_decode_batch_k")
    return summary, results


async def batching_metrics(base_url: str) -> dict[str, float]:
    """``*_sum`` and ``*_count`` of a draftwise server's batching histograms (empty for other servers)."""
    wanted = ("draftwise:batch_size", "draftwise:spec_decode_batch_k")
    try:
        async with httpx.AsyncClient(timeout=10) as http:
            text = (await http.get(base_url.rstrip("/") + "/metrics")).text
    except httpx.HTTPError:
        return {}
    values: dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(r"^(\S+?)(?:\{[^}]*\})?\s+(\S+)$", line)
        if match and match.group(1).removesuffix("_sum").removesuffix("_count") in wanted and \
                match.group(1).endswith(("_sum", "_count")):
            values[match.group(1)] = values.get(match.group(1), 0.0) + float(match.group(2))
    return values


def _delta_mean(before: dict[str, float], after: dict[str, float], name: str) -> float | None:
    """Mean of a histogram's observations between two scrapes (None without any)."""
    count = after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
    if count <= 0:
        return None
    return (after.get(f"{name}_sum", 0.0) - before.get(f"{name}_sum", 0.0)) / count


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarize(concurrency: int, results: list[RequestResult], wall_s: float) -> LevelSummary:
    """Aggregate one level's requests."""
    ok = [r for r in results if r.error is None]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    rates = [r.decode_tokens_per_s for r in ok if r.decode_tokens_per_s is not None]
    accept = [r.acceptance_rate for r in ok if r.acceptance_rate is not None]
    tau = [r.mean_accepted_length for r in ok if r.mean_accepted_length is not None]
    tokens = sum(r.completion_tokens for r in ok)
    return LevelSummary(
        concurrency=concurrency, requests=len(results), errors=len(results) - len(ok), wall_s=wall_s,
        ttft_mean_s=_mean(ttfts), ttft_p50_s=_percentile(ttfts, 0.5), ttft_p95_s=_percentile(ttfts, 0.95),
        e2e_mean_s=_mean([r.e2e_s for r in ok]), decode_tokens_per_s_mean=_mean(rates),
        aggregate_tokens_per_s=tokens / wall_s if wall_s > 0 else float("nan"), completion_tokens=tokens,
        acceptance_rate_mean=_mean(accept) if accept else None, mean_accepted_length_mean=_mean(tau) if tau else None,
    )


def format_table(summaries: list[LevelSummary]) -> str:
    """A plain-text table, one row per level."""
    header = (f"{'clients':>7} {'reqs':>5} {'err':>4} {'TTFT mean':>10} {'p50':>7} {'p95':>7} {'e2e mean':>9} "
              f"{'tok/s/req':>10} {'tok/s/client':>12} {'slowest':>8} {'tok/s all':>10} {'accept':>7} {'tau':>5} "
              f"{'batch':>6} {'K':>5}")
    rows = [header]
    for s in summaries:
        accept = f"{s.acceptance_rate_mean:.3f}" if s.acceptance_rate_mean is not None else "-"
        tau = f"{s.mean_accepted_length_mean:.2f}" if s.mean_accepted_length_mean is not None else "-"
        batch = f"{s.batch_size_mean:.2f}" if s.batch_size_mean is not None else "-"
        k = f"{s.batch_k_mean:.2f}" if s.batch_k_mean is not None else "-"
        rows.append(f"{s.concurrency:>7} {s.requests:>5} {s.errors:>4} {s.ttft_mean_s:>9.3f}s {s.ttft_p50_s:>6.3f}s "
                    f"{s.ttft_p95_s:>6.3f}s {s.e2e_mean_s:>8.2f}s {s.decode_tokens_per_s_mean:>10.1f} "
                    f"{s.client_tokens_per_s_mean:>12.1f} {s.client_tokens_per_s_min:>8.1f} "
                    f"{s.aggregate_tokens_per_s:>10.1f} {accept:>7} {tau:>5} {batch:>6} {k:>5}")
    return "\n".join(rows)


def load_prompts(path: str | None, repeat: int = 1) -> list[str]:
    if path is None:
        prompts = DEFAULT_PROMPTS
    else:
        with open(path, encoding="utf-8") as handle:
            prompts = [line.rstrip("\n") for line in handle if line.strip()]
        if not prompts:
            raise SystemExit(f"no prompts in {path}")
    return [" ".join([p] * repeat) for p in prompts]


@contextmanager
def in_process_server(args: argparse.Namespace):
    """Build and run a draftwise server for ``args.serve`` in a background thread on a free loopback port
    (uvicorn, :func:`draftwise.server.serving.make_server`); yields its base URL and stops it afterwards."""
    import torch

    from draftwise.builder import build_engine
    from draftwise.commands.common import CliError, speculative_config_from_args
    from draftwise.server import ServerSettings, create_app
    from draftwise.server.serving import make_server

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    flags = argparse.Namespace(speculative_config=args.speculative_config, speculative_model=None,
                               num_speculative_tokens=None)
    try:
        spec = speculative_config_from_args(flags)
    except CliError as exc:
        raise SystemExit(str(exc)) from None
    bundle = build_engine(args.serve, spec, device="cpu", max_context=args.max_model_len,
                          quantization=args.quantization, runtime=args.runtime, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    settings = ServerSettings(max_waiting_requests=MAX_TOTAL_REQUESTS, default_max_tokens=args.max_tokens)
    server = make_server(create_app(bundle, settings), port=port, log_level="warning")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise SystemExit("the in-process server did not start")
        time.sleep(0.05)
    logger.info("in-process server for %s (%s, up to %d at once) at port %d", args.serve, bundle.method,
                bundle.core.max_num_seqs, port)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


async def main_async(args: argparse.Namespace) -> int:
    levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    check_bounds(args, levels)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    prompts = load_prompts(args.prompts_file, args.prompt_repeat)
    client = openai.AsyncOpenAI(base_url=args.base_url.rstrip("/") + "/v1", api_key=args.api_key,
                                max_retries=0, timeout=args.timeout)
    try:
        model = args.model or (await client.models.list()).data[0].id
        for i in range(args.warmup):
            await one_request(client, args, model, prompts[i % len(prompts)])
        summaries, details = [], {}
        for level in levels:
            logger.info("concurrency %d: %d requests", level, level * args.requests_per_client)
            summary, results = await run_level(client, args, model, prompts, level)
            summaries.append(summary)
            details[str(level)] = [asdict(r) for r in results]
    finally:
        await client.close()
    print(f"model {model}, endpoint {args.endpoint}, max_tokens {args.max_tokens}, temperature {args.temperature}, "
          f"{args.requests_per_client} requests per client")
    print(format_table(summaries))
    if args.json_path:
        with open(args.json_path, "w", encoding="utf-8") as handle:
            json.dump({"args": vars(args), "model": model, "summaries": [asdict(s) for s in summaries],
                       "requests": details}, handle, indent=2)
    return 1 if any(s.errors for s in summaries) else 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args = parse_args(argv)
    if args.serve is None:
        return asyncio.run(main_async(args))
    with in_process_server(args) as url:
        args.base_url = url
        return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
