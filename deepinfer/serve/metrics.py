"""``GET /metrics``: the engine's counters and the server's latency histograms in Prometheus text.

Counters and gauges are read from the engine at scrape time (one snapshot per
scrape, taken on the stepping thread); the latency histograms are observed by
the server as each request finishes, from the times its outputs were delivered.
Names follow vLLM's (``vllm:`` becomes ``deepinfer:``), so existing dashboards
carry over.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ..stats import EngineLoad
from .async_engine import StreamTiming

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)

#: engine counter -> (metric name, help)
_COUNTERS = {
    "prompt_tokens": ("prompt_tokens", "Prompt tokens scheduled"),
    "generated_tokens": ("generation_tokens", "Tokens generated"),
    "cached_tokens": ("prefix_cache_hits", "Prompt tokens served from the prefix cache"),
    "preemptions": ("num_preemptions", "Requests preempted (recomputed) because the cache ran out of blocks"),
    "kv_store_hit_tokens": ("kv_store_hits", "Prompt tokens served from the KV store"),
    "kv_store_lookups": ("kv_store_queries", "Lookups in the KV store"),
    "spec_verified_tokens": ("spec_decode_num_draft_tokens", "Drafted tokens verified"),
    "spec_accepted_tokens": ("spec_decode_num_accepted_tokens", "Drafted tokens accepted"),
    "steps": ("engine_steps", "Engine steps"),
    "prefill_tokens": ("prefill_tokens_computed", "Prompt (and recomputed) tokens run through the model"),
    "kv_transfers": ("kv_transfers", "Prompt states fetched from a prefill server (decode role)"),
    "kv_transfer_bytes": ("kv_transfer_bytes", "Bytes of prompt state fetched from prefill servers"),
    "kv_transfer_seconds": ("kv_transfer_seconds", "Seconds spent fetching prompt state"),
    "kv_transfer_failures": ("kv_transfer_failures", "Fetches of prompt state that failed (the request failed, or was recomputed here)"),
    "kv_transfers_recomputed": ("kv_transfers_recomputed", "Requests whose fetch failed and whose prompt was computed here instead"),
    "kv_transfers_expired": ("kv_transfers_expired", "Published prompt states no decode server fetched in time (prefill role)"),
}


class _EngineCollector(Collector):
    """Yields the last engine snapshot the server fetched (``update`` before each scrape)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.counters: dict[str, Any] = {}
        self.load = EngineLoad()

    def collect(self) -> Iterator[Any]:
        labels = ["model_name"]
        value = [self.model_name]
        for help_name, figure, text in (
            ("num_requests_running", self.load.num_running, "Requests in the running batch"),
            ("num_requests_waiting", self.load.num_waiting, "Requests waiting to be scheduled"),
            ("kv_cache_usage_perc", self.load.kv_cache_usage, "Share of KV-cache blocks in use (1 = full)"),
        ):
            g = GaugeMetricFamily(f"deepinfer:{help_name}", text, labels=labels)
            g.add_metric(value, figure)
            yield g
        for key, (name, text) in _COUNTERS.items():
            c = CounterMetricFamily(f"deepinfer:{name}", text, labels=labels)
            c.add_metric(value, float(self.counters.get(key, 0) or 0))
            yield c
        c = CounterMetricFamily("deepinfer:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", labels=labels)
        c.add_metric(value, float(self.counters.get("prompt_tokens", 0) or 0))
        yield c
        g = GaugeMetricFamily("deepinfer:spec_decode_mean_accepted_length", "Tokens a verification emits per request (accepted drafts + 1)", labels=labels)
        g.add_metric(value, float(self.counters.get("spec_mean_accepted_length", 0.0) or 0.0))
        yield g


class ServerMetrics:
    """The server's Prometheus registry: engine figures at scrape time, latencies as requests finish."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.engine = _EngineCollector(model_name)
        self.registry.register(self.engine)
        labels = ["model_name"]
        self.model_name = model_name
        self.ttft = Histogram("deepinfer:time_to_first_token_seconds", "Time from arrival to the first token",
                              labels, buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("deepinfer:inter_token_latency_seconds", "Time between consecutive output tokens",
                             labels, buckets=_TOKEN_GAP_BUCKETS, registry=self.registry)
        self.e2e = Histogram("deepinfer:e2e_request_latency_seconds", "Time from arrival to the last token",
                             labels, buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.finished = Counter("deepinfer:request_success", "Requests finished, by finish reason",
                                ["model_name", "finished_reason"], registry=self.registry)
        self.failed = Counter("deepinfer:request_failure", "Requests that failed (engine errors, aborts)",
                              labels, registry=self.registry)
        self.preprocess = Histogram("deepinfer:request_preprocess_time_seconds",
                                    "Server time before a request reaches the engine: validation, rendering, tokenizing",
                                    labels, buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.queue = Histogram("deepinfer:request_queue_time_seconds", "Time a request waited in the engine before its first step",
                               labels, buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.in_engine = Histogram("deepinfer:request_engine_time_seconds", "Time from a request's arrival in the engine to its end there",
                                   labels, buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.postprocess = Histogram("deepinfer:request_postprocess_time_seconds",
                                     "Server time turning a request's outputs into its response (parsing, detokenized text, chunks)",
                                     labels, buckets=_LATENCY_BUCKETS, registry=self.registry)

        #: this model's series, looked up once (every finished request observes each)
        self._series = {h: h.labels(model_name) for h in (self.ttft, self.itl, self.e2e, self.preprocess, self.queue, self.in_engine,
                                                            self.postprocess, self.failed)}

    def observe(self, timing: StreamTiming, finish_reasons: list[str | None]) -> None:
        """A request finished: its latencies and why it stopped."""
        series = self._series
        if timing.first_token is not None:
            series[self.ttft].observe(timing.first_token - timing.arrival)
        itl = series[self.itl]
        for gap in timing.token_gaps:
            itl.observe(gap)
        if timing.finished is not None:
            series[self.e2e].observe(timing.finished - timing.arrival)
        if timing.received is not None:
            series[self.preprocess].observe(max(0.0, timing.arrival - timing.received))
        if timing.queue is not None:
            series[self.queue].observe(max(0.0, timing.queue))
        if timing.in_engine is not None:
            series[self.in_engine].observe(max(0.0, timing.in_engine))
        if timing.postprocess:
            series[self.postprocess].observe(timing.postprocess)
        for reason in finish_reasons:
            if reason in ("stop", "length", "tool_calls"):
                self.finished.labels(self.model_name, reason).inc()
            else:
                series[self.failed].inc()

    def observe_postprocess(self, seconds: float) -> None:
        """A whole (non-streamed) response was built in ``seconds``."""
        self._series[self.postprocess].observe(seconds)

    def render(self, counters: dict[str, Any], load: EngineLoad) -> bytes:
        self.engine.counters = counters
        self.engine.load = load
        return generate_latest(self.registry)
