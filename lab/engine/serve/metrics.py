"""Prometheus metrics at `/metrics`, under vLLM's names, labels and counting rules, so the
dashboards, alerts and autoscalers written for vLLM read this engine unchanged:

- every series carries `model_name` and `engine` (always "0": one engine per server);
- `vllm:prompt_tokens_total` counts each request's whole prompt once, when its first token is
  out, prefix-cache hits included (the engine's own `/v1/stats` counts computed tokens instead);
- `vllm:request_success_total{finished_reason}` counts every request that ended, by why:
  `stop`, `length` or `abort` (its client went away);
- `vllm:prefix_cache_hits_total` counts hits in the device KV pool only and
  `vllm:external_prefix_cache_{queries,hits}_total` the tokens asked of and found in the tiers
  under it (host memory, file), as vLLM counts its local cache and a KV connector's apart; the
  split by tier is in `/v1/stats`.
- with prompt lookup on, `vllm:spec_decode_num_drafts_total`, `..._num_draft_tokens_total`,
  `..._num_accepted_tokens_total` and `..._num_accepted_tokens_per_pos_total{position}` count
  as vLLM's do (a draft is one sequence's proposal in one step); with it off they are absent.

Gauges and engine counters are read at scrape time; the server observes the per-request ones
once per request (arrival, first token, finish), so no work is added per streamed token beyond
the inter-token histogram."""

from __future__ import annotations

from typing import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from lab.engine.core.llm_engine import LLMEngine
from lab.engine.core.output_processor import RequestPhases

PREFIX = "vllm"
LABELS = ["model_name", "engine"]
ENGINE = "0"
FINISH_REASONS = ("stop", "length", "abort")
# vLLM's buckets for the per-request phase histograms (queue, prefill, decode, inference).
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0)


def token_buckets(max_model_len: int) -> list[int]:
    """1, 2, 5, 10, 20, 50... up to the context, as vLLM builds its token-count buckets."""
    out, exp = [], 0
    while True:
        for m in (1, 2, 5):
            value = m * 10**exp
            if value > max_model_len:
                return out
            out.append(value)
        exp += 1


class _EngineCollector(Collector):
    """Reads the engine's gauges and counters at scrape time; no bookkeeping on the step path."""

    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        self.engine = engine
        self.values = [model_name, ENGINE]

    def collect(self) -> Iterator:
        e = self.engine

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"{PREFIX}:{name}", doc, labels=LABELS)
            g.add_metric(self.values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"{PREFIX}:{name}", doc, labels=LABELS)
            c.add_metric(self.values, value)
            return c

        yield gauge("num_requests_running", "Number of requests in model execution batches.", e.num_running)
        yield gauge("num_requests_waiting", "Number of requests waiting to be processed.", e.num_waiting)
        yield gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                    e.blocks.num_used_blocks / max(1, e.blocks.num_blocks))
        yield counter("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                      e.blocks.prefix_queries)
        yield counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      e.blocks.tier_hit_blocks["device"] * e.blocks.block_size)
        yield counter("external_prefix_cache_queries", "External prefix cache queries from KV connector "
                      "cross-instance cache sharing, in terms of number of queried tokens.", e.blocks.tier_queries)
        yield counter("external_prefix_cache_hits", "External prefix cache hits from KV connector cross-instance "
                      "cache sharing, in terms of number of cached tokens.",
                      (e.blocks.tier_hit_blocks["host"] + e.blocks.tier_hit_blocks["file"]) * e.blocks.block_size)
        yield counter("num_preemptions", "Cumulative number of preemptions from the engine.",
                      e.scheduler.num_preemptions)
        yield counter("generation_tokens", "Number of generation tokens processed.", e.counters.generation_tokens)
        if e.drafter is not None:
            spec = e.drafter.counters
            yield counter("spec_decode_num_drafts", "Number of spec decoding drafts.", spec.drafts)
            yield counter("spec_decode_num_draft_tokens", "Number of draft tokens.", spec.draft_tokens)
            yield counter("spec_decode_num_accepted_tokens", "Number of accepted tokens.", spec.accepted_tokens)
            per_pos = CounterMetricFamily(f"{PREFIX}:spec_decode_num_accepted_tokens_per_pos",
                                          "Accepted tokens per draft position.", labels=LABELS + ["position"])
            for position in range(e.config.num_speculative_tokens):
                accepted = spec.accepted_per_position
                per_pos.add_metric(self.values + [str(position)], accepted[position] if position < len(accepted) else 0)
            yield per_pos


class EngineMetrics:
    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        disable_created_metrics()  # as vLLM: no `_created` series beside each counter and histogram
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model_name))
        values = (model_name, ENGINE)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"{PREFIX}:{name}", doc, LABELS, buckets=buckets, registry=self.registry).labels(*values)

        self.ttft = histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", REQUEST_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds",
                                      "Histogram of time spent in PREFILL phase for request.", REQUEST_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds",
                                     "Histogram of time spent in DECODE phase for request.", REQUEST_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds",
                                        "Histogram of time spent in RUNNING phase for request.", REQUEST_BUCKETS)
        lengths = token_buckets(engine.max_model_len)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Number of prefill tokens processed.",
                                               lengths)
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "Number of generation tokens processed.", lengths)
        self.request_params_n = histogram("request_params_n", "Histogram of the n request parameter.",
                                          [1, 2, 5, 10, 20])
        self.request_params_max_tokens = histogram("request_params_max_tokens",
                                                   "Histogram of the max_tokens request parameter.", lengths)
        self.prompt_tokens = Counter(f"{PREFIX}:prompt_tokens", "Number of prefill tokens processed.", LABELS,
                                     registry=self.registry).labels(*values)
        success = Counter(f"{PREFIX}:request_success", "Count of successfully processed requests.",
                          LABELS + ["finished_reason"], registry=self.registry)
        # Every reason is exported from the start, at zero, as vLLM does.
        self.request_success = {r: success.labels(*values, r) for r in FINISH_REASONS}

    def first_token(self, num_prompt_tokens: int) -> None:
        """Count a request's prompt once it has produced its first token, cache hits included."""
        self.prompt_tokens.inc(num_prompt_tokens)
        self.request_prompt_tokens.observe(num_prompt_tokens)

    def finished(self, reason: str | None, num_output_tokens: int, phases: RequestPhases | None = None) -> None:
        """Count one request that ended (`reason` None: aborted), and where its time went when the
        engine says (a request that never reached a step has no phases to observe)."""
        self.request_success[reason if reason in self.request_success else "abort"].inc()
        self.request_generation_tokens.observe(num_output_tokens)
        if phases is not None and phases.scheduled is not None:
            self.queue_time.observe(phases.scheduled - phases.arrival)
            self.inference_time.observe(phases.finished - phases.scheduled)
            if phases.first_token is not None:
                self.prefill_time.observe(phases.first_token - phases.scheduled)
                self.decode_time.observe(phases.finished - phases.first_token)

    def render(self) -> bytes:
        return generate_latest(self.registry)
