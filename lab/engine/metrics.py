"""Prometheus metrics at `/metrics`. Names follow vLLM's (`vllm:num_requests_running` becomes
`lab:num_requests_running`, and so on) so dashboards and scrapers written for vLLM map one to one."""

from __future__ import annotations

from typing import Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from lab.engine.llm_engine import LLMEngine

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0)


class _EngineCollector(Collector):
    """Reads the engine's counters at scrape time; no bookkeeping on the step path."""

    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator:
        e, labels = self.engine, [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"lab:{name}", doc, labels=["model_name"])
            g.add_metric(labels, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"lab:{name}", doc, labels=["model_name"])
            c.add_metric(labels, value)
            return c

        yield gauge("num_requests_running", "Requests holding KV blocks.", e.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be admitted.", e.num_waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).",
                    e.blocks.num_used_blocks / max(1, e.blocks.num_blocks))
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", e.blocks.prefix_queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", e.blocks.prefix_hits)
        yield counter("num_preemptions", "Sequences preempted (recomputed later).", e.scheduler.num_preemptions)
        yield counter("prompt_tokens", "Prompt tokens computed.", e.counters.prompt_tokens)
        yield counter("generation_tokens", "Tokens generated.", e.counters.generation_tokens)
        yield counter("request_success", "Requests finished.", e.counters.requests_finished)
        yield counter("request_aborted", "Requests aborted (client gone or cancelled).", e.counters.requests_aborted)


class EngineMetrics:
    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model_name))
        self.model_name = model_name
        self.ttft = Histogram("lab:time_to_first_token_seconds", "Time to first token, from arrival.",
                              ["model_name"], buckets=LATENCY_BUCKETS, registry=self.registry).labels(model_name)
        self.itl = Histogram("lab:inter_token_latency_seconds", "Time between consecutive output tokens.",
                             ["model_name"], buckets=LATENCY_BUCKETS, registry=self.registry).labels(model_name)
        self.e2e = Histogram("lab:e2e_request_latency_seconds", "Arrival to last token.",
                             ["model_name"], buckets=LATENCY_BUCKETS, registry=self.registry).labels(model_name)

    def render(self) -> bytes:
        return generate_latest(self.registry)
