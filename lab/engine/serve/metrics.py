"""Prometheus metrics at `/metrics`, under vLLM's names, labels and counting rules, so the
dashboards, alerts and autoscalers written for vLLM read this engine unchanged:

- every series carries `model_name` and `engine` (always "0": one engine per server);
- a request is what vLLM's engine calls one: a choice of a prompt (a request with n=2 is two);
  each one that ends, finished or aborted, is observed exactly once in
  `vllm:request_success_total{finished_reason}` (`stop`, `length` or `abort`) and in every
  per-request histogram (e2e, queue, prefill, decode, inference, time per output token, prompt
  and generation tokens, max_tokens), at the moment the engine reports its end, its KV blocks
  already freed; a request the engine refused (queue full) counts nowhere;
- `vllm:request_params_n` and `vllm:request_max_num_generation_tokens` are observed once per
  prompt (vLLM's parent request) once all of its choices have ended;
- `vllm:time_to_first_token_seconds` is observed at a request's first token (one aborted before
  it has none), `vllm:inter_token_latency_seconds` and the deprecated
  `vllm:time_per_output_token_seconds` at each later output;
- `vllm:prompt_tokens_total` counts each request's whole prompt once, when its first token is
  out, prefix-cache hits included (the engine's own `/v1/stats` counts computed tokens instead);
- `vllm:iteration_tokens_total` observes each engine step's computed tokens (prompt + generated);
- `vllm:prefix_cache_hits_total` counts hits in the device KV pool only and
  `vllm:external_prefix_cache_{queries,hits}_total` the tokens asked of and found in the tiers
  under it (host memory, file), as vLLM counts its local cache and a KV connector's apart; the
  split by tier is in `/v1/stats`.
- with prompt lookup on, `vllm:spec_decode_num_drafts_total`, `..._num_draft_tokens_total`,
  `..._num_accepted_tokens_total` and `..._num_accepted_tokens_per_pos_total{position}` count
  as vLLM's do (a draft is one sequence's proposal in one step); with it off they are absent;
- `vllm:cache_config_info` is a gauge at 1 whose labels carry the KV cache's config.

Gauges and engine counters are read at scrape time."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from lab.engine.core.llm_engine import LLMEngine
from lab.engine.core.output_processor import RequestOutput, RequestPhases

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


@dataclass
class Parent:
    """One prompt of a request and its n choices (vLLM's parent request): `request_params_n` and
    `request_max_num_generation_tokens` are observed once all of its choices have ended."""
    n: int
    unsettled: int = 0  # choices not yet ended, refused or skipped
    finished: int = 0  # choices that ended in the engine
    max_generation_tokens: int = 0

    def __post_init__(self) -> None:
        self.unsettled = self.n


@dataclass
class _Live:
    arrival: float  # at the server, time.monotonic()
    max_tokens: int
    parent: Parent


class EngineMetrics:
    """The Prometheus registry, and the bookkeeping that observes each engine request's
    histograms exactly once: when the engine says it ended (finished, or aborted with its KV
    blocks freed), on the event loop, so a scrape never counts an abort whose blocks the gauges
    still show in use."""

    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        disable_created_metrics()  # as vLLM: no `_created` series beside each counter and histogram
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model_name))
        values = (model_name, ENGINE)
        self.live: dict[str, _Live] = {}

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"{PREFIX}:{name}", doc, LABELS, buckets=buckets, registry=self.registry).labels(*values)

        self.ttft = histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             LATENCY_BUCKETS)
        self.tpot_old = histogram("time_per_output_token_seconds", "Histogram of time per output token in seconds. "
                                  "DEPRECATED: Use vllm:inter_token_latency_seconds instead.", LATENCY_BUCKETS)
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
        self.tpot = histogram("request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.", LATENCY_BUCKETS)
        lengths = token_buckets(engine.max_model_len)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Number of prefill tokens processed.",
                                               lengths)
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "Number of generation tokens processed.", lengths)
        self.request_max_generation_tokens = histogram("request_max_num_generation_tokens",
                                                       "Histogram of maximum number of requested generation "
                                                       "tokens.", lengths)
        self.request_params_n = histogram("request_params_n", "Histogram of the n request parameter.",
                                          [1, 2, 5, 10, 20])
        self.request_params_max_tokens = histogram("request_params_max_tokens",
                                                   "Histogram of the max_tokens request parameter.", lengths)
        self.iteration_tokens = histogram("iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                          iteration_buckets(engine.config.max_num_batched_tokens))
        self.prompt_tokens = Counter(f"{PREFIX}:prompt_tokens", "Number of prefill tokens processed.", LABELS,
                                     registry=self.registry).labels(*values)
        success = Counter(f"{PREFIX}:request_success", "Count of successfully processed requests.",
                          LABELS + ["finished_reason"], registry=self.registry)
        # Every reason is exported from the start, at zero, as vLLM does.
        self.request_success = {r: success.labels(*values, r) for r in FINISH_REASONS}
        cache = cache_config(engine)
        Gauge(f"{PREFIX}:cache_config_info", "Information of the LLMEngine CacheConfig", LABELS + sorted(cache),
              registry=self.registry).labels(*values, *(cache[k] for k in sorted(cache))).set(1)

    # -- per engine request --------------------------------------------------------------------

    def submitted(self, request_id: str, arrival: float, max_tokens: int, parent: Parent) -> None:
        """A sequence is on its way to the engine; exactly one `ended` follows for it."""
        self.live[request_id] = _Live(arrival, max_tokens, parent)

    def skipped(self, parent: Parent) -> None:
        """A choice that was never submitted (its request ended before the choice's turn)."""
        self._settle(parent)

    def inter_token(self, seconds: float) -> None:
        """One sequence's time per token since its previous output (vLLM observes the deprecated
        `time_per_output_token_seconds` with the same values)."""
        self.itl.observe(seconds)
        self.tpot_old.observe(seconds)

    def step(self, tokens: int) -> None:
        """One engine step's computed tokens; called on the engine thread (a histogram's
        observe takes a lock, so it may be)."""
        if tokens:
            self.iteration_tokens.observe(tokens)

    def first_token(self, seconds: float, num_prompt_tokens: int) -> None:
        """A request's first token, `seconds` after its arrival: its prompt is counted now, cache
        hits included."""
        self.ttft.observe(seconds)
        self.prompt_tokens.inc(num_prompt_tokens)

    def ended(self, request_id: str, out: RequestOutput | None) -> None:
        """The engine finished or aborted `request_id` (`out`, its last output), or refused it
        (`out` None: it never ran, and counts nowhere)."""
        live = self.live.pop(request_id, None)
        if live is None:
            return
        if out is not None:
            self._observe(live, out)
            live.parent.finished += 1
            live.parent.max_generation_tokens = max(live.parent.max_generation_tokens, out.num_output_tokens)
        self._settle(live.parent)

    def _observe(self, live: _Live, out: RequestOutput) -> None:
        self.request_success[out.finish_reason if out.finish_reason in self.request_success else "abort"].inc()
        self.e2e.observe(time.monotonic() - live.arrival)
        self.request_prompt_tokens.observe(out.num_prompt_tokens)
        self.request_generation_tokens.observe(out.num_output_tokens)
        self.request_params_max_tokens.observe(live.max_tokens)
        queue, prefill, decode = phase_times(out.phases)
        self.queue_time.observe(queue)
        self.prefill_time.observe(prefill)
        self.decode_time.observe(decode)
        self.inference_time.observe(prefill + decode)
        # vLLM's mean time per output token: the decode phase over the tokens after the first.
        self.tpot.observe(decode / (out.num_output_tokens - 1) if out.num_output_tokens > 1 else 0.0)

    def _settle(self, parent: Parent) -> None:
        parent.unsettled -= 1
        if parent.unsettled == 0 and parent.finished:
            self.request_params_n.observe(parent.n)
            self.request_max_generation_tokens.observe(parent.max_generation_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def phase_times(phases: RequestPhases | None) -> tuple[float, float, float]:
    """(queue, prefill, decode) seconds of an ended request. One aborted before its first step
    queued until the end; one aborted before its first token prefilled until the end."""
    if phases is None:
        return 0.0, 0.0, 0.0
    if phases.scheduled is None:
        return phases.finished - phases.arrival, 0.0, 0.0
    queue = phases.scheduled - phases.arrival
    if phases.first_token is None:
        return queue, phases.finished - phases.scheduled, 0.0
    return queue, phases.first_token - phases.scheduled, phases.finished - phases.first_token


def iteration_buckets(max_num_batched_tokens: int) -> list[int]:
    """1, 8, 16, 32... up to the step budget, as vLLM's (1, 8 and its CUDA-graph sizes)."""
    out = [1, 8]
    while out[-1] < max_num_batched_tokens:
        out.append(min(out[-1] * 2, max_num_batched_tokens))
    return out


def cache_config(engine: LLMEngine) -> dict[str, str]:
    """The labels of `vllm:cache_config_info`: vLLM's CacheConfig fields where this engine has
    the same knob, as strings."""
    c = engine.config
    tiers = engine.tiers.stats() if engine.tiers is not None else {}
    return {
        "block_size": str(c.block_size),
        "num_gpu_blocks": str(engine.runner.num_blocks),  # the KV pool, on whichever device holds it
        "num_cpu_blocks": str(tiers.get("host", {}).get("capacity_blocks", 0)),  # the host-memory tier
        "cache_dtype": c.kv_cache_dtype,
        "enable_prefix_caching": str(c.enable_prefix_caching),
        "gpu_memory_utilization": str(c.gpu_memory_utilization),
        "prefix_caching_hash_algo": "blake2b",
    }
