"""Prometheus metrics, named like vLLM's so a vLLM dashboard needs only the ``vllm:`` -> ``draftwise:`` prefix
change. Each app owns its :class:`CollectorRegistry` (no process-global state), served at ``GET /metrics``.

Counters are exposed with prometheus-client's ``_total`` suffix, as vLLM's are. Every series carries the
labels ``model_name`` and ``engine`` (always ``"0"``: one engine per server), as vLLM's do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from draftwise.stats import SpeculativeStats

if TYPE_CHECKING:
    from draftwise.engine import StepInfo

__all__ = ["ServerMetrics", "RequestRecord", "PREFIX"]

PREFIX = "draftwise:"

# Bucket edges in seconds, close to vLLM's.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0)
_BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
_STEP_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 1024, 2048, 4096, 8192)
_K_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 64)
_TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)


@dataclass(frozen=True)
class RequestRecord:
    """What one finished (or abandoned) request contributes to the metrics.

    Attributes:
        finished_reason: ``"stop"``, ``"length"``, ``"abort"`` (the client left, or the server shut down before
            the request finished) or ``"error"`` (the engine failed).
        prompt_tokens, generation_tokens: token counts.
        queue_time_s: arrival -> start of generation (seconds).
        ttft_s: arrival -> first generated token (seconds), None when no token was generated.
        e2e_s: arrival -> end (seconds).
        stats: the engine's statistics of the request (None when it never started).
    """

    finished_reason: str
    prompt_tokens: int
    generation_tokens: int
    queue_time_s: float
    ttft_s: float | None
    e2e_s: float
    stats: SpeculativeStats | None


class ServerMetrics:
    """The server's metrics in a private registry.

    Args:
        model_name: value of the ``model_name`` label.
    """

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self._labels = {"model_name": model_name, "engine": "0"}
        names = tuple(self._labels)
        self._running = Gauge(f"{PREFIX}num_requests_running", "Requests being generated (at most 1, or "
                              "--max-num-seqs with continuous batching).", names, registry=self.registry)
        self._waiting = Gauge(f"{PREFIX}num_requests_waiting", "Requests queued for the engine.", names,
                              registry=self.registry)
        self._step_overhead = Gauge(f"{PREFIX}engine_step_overhead_seconds", "The engine's own time per step "
                                    "beyond its model passes (verification, sampling, streaming between steps; "
                                    "median of recent steps), priced into every choice of K.", names,
                                    registry=self.registry)
        self._make_counters(names)
        self._make_histograms(names)

    def track_queue(self, num_running: Callable[[], int], num_waiting: Callable[[], int]) -> None:
        """Read the two queue gauges from these callables at scrape time."""
        self._running.labels(**self._labels).set_function(lambda: float(num_running()))
        self._waiting.labels(**self._labels).set_function(lambda: float(num_waiting()))

    def _make_counters(self, names) -> None:
        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"{PREFIX}{name}", doc, names + extra, registry=self.registry)

        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens served from the prefix cache "
                                         "(KV state reused, not prefilled).")
        self.num_drafts = counter("spec_decode_num_drafts", "Verification passes that carried draft tokens.")
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed for verification.")
        self.num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each draft position (0-based).", ("position",))
        self.jump_forward_tokens = counter("spec_decode_num_jump_forward_tokens", "Tokens a request's grammar "
                                           "forced, drafted for free (jump-forward) and accepted; not in the draft "
                                           "counts.")
        self.processor_seconds = counter("structured_output_seconds", "Seconds spent masking the target's rows by "
                                         "requests' grammars.")
        self.hybrid_steps = counter("spec_decode_hybrid_steps", "Verification passes of hybrid requests by the "
                                    "side that drafted them (suffix, draft_model; plain: none).", ("side",))
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated and returned to clients.")
        self.request_success = counter("request_success", "Finished requests by finish reason (stop, length, "
                                       "abort: client gone or shutdown, error: engine failure).",
                                       ("finished_reason",))
        for metric in (self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, self.prompt_tokens,
                       self.generation_tokens):
            metric.labels(**self._labels)  # export zeros before the first request

    def _make_histograms(self, names) -> None:
        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"{PREFIX}{name}", doc, names, buckets=buckets, registry=self.registry)

        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first generated token (queueing "
                              "included).", _TTFT_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to the last token.", _LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Time spent waiting for the engine.",
                                    _LATENCY_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds", "Per request: (e2e - ttft) / (tokens - 1).",
                              _TPOT_BUCKETS)
        # continuous batching (one observation per engine step; absent from a one-request-at-a-time server)
        self.batch_size = histogram("batch_size", "Sequences in one batched target pass (decoding and "
                                    "prefilling).", _BATCH_BUCKETS)
        self.iteration_tokens = histogram("iteration_tokens_total", "Rows (tokens) in one batched target pass: "
                                          "last tokens, draft tokens and prompt chunks.", _STEP_TOKEN_BUCKETS)
        self.step_generated_tokens = histogram("step_generated_tokens", "Output tokens committed by one batched "
                                               "step (all sequences).", _STEP_TOKEN_BUCKETS)
        self.step_k = histogram("spec_decode_batch_k", "K (draft tokens verified) per decoding sequence and "
                                "batched step (0: a plain step; load-aware K falls at high batch sizes).", _K_BUCKETS)

    def record(self, record: RequestRecord) -> None:
        """Add one request's counts and latencies (thread-safe)."""
        labels = self._labels
        self.request_success.labels(**labels, finished_reason=record.finished_reason).inc()
        self.prompt_tokens.labels(**labels).inc(record.prompt_tokens)
        self.generation_tokens.labels(**labels).inc(record.generation_tokens)
        self.queue_time.labels(**labels).observe(record.queue_time_s)
        self.e2e.labels(**labels).observe(record.e2e_s)
        if record.ttft_s is not None:
            self.ttft.labels(**labels).observe(record.ttft_s)
            if record.generation_tokens > 1:
                per_token = (record.e2e_s - record.ttft_s) / (record.generation_tokens - 1)
                self.tpot.labels(**labels).observe(per_token)
        if record.stats is not None:
            self._record_speculation(record.stats)

    def record_step(self, step: StepInfo) -> None:
        """Add one batched engine step (:class:`draftwise.engine.StepInfo`) to the batching histograms."""
        labels = self._labels
        self.batch_size.labels(**labels).observe(step.num_sequences)
        self.iteration_tokens.labels(**labels).observe(step.rows)
        self.step_generated_tokens.labels(**labels).observe(step.committed_tokens)
        self._step_overhead.labels(**labels).set(step.overhead_s)
        for k in step.ks:
            self.step_k.labels(**labels).observe(k)

    def _record_speculation(self, stats: SpeculativeStats) -> None:
        labels = self._labels
        self.prefix_cache_queries.labels(**labels).inc(stats.num_prompt_tokens)
        self.prefix_cache_hits.labels(**labels).inc(stats.num_cached_prompt_tokens)
        self.num_drafts.labels(**labels).inc(stats.num_drafts)
        self.num_draft_tokens.labels(**labels).inc(stats.num_draft_tokens)
        self.num_accepted_tokens.labels(**labels).inc(stats.num_accepted_tokens)
        for position, accepted in enumerate(stats.accepted_per_position):
            self.accepted_per_pos.labels(**labels, position=str(position)).inc(accepted)
        for side, steps in (stats.hybrid_steps or {}).items():
            self.hybrid_steps.labels(**labels, side=side).inc(steps)
        self.jump_forward_tokens.labels(**labels).inc(stats.num_jump_forward_tokens)
        self.processor_seconds.labels(**labels).inc(stats.processor_time_s)

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
