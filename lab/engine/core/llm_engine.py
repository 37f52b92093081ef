"""The synchronous engine: admit requests, run steps (schedule → forward → sample → outputs).
Single-threaded by design; the async server drives it from one thread."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import torch

from lab.engine.core import cpu_threads, draft_probe, prompt_logprobs
from lab.engine.core.config import ConfigError, EngineConfig
from lab.engine.core.known_cost import KnownCost
from lab.engine.core.model_runner import ModelRunner, resolve_device, resolve_dtype
from lab.engine.core.output_processor import OutputProcessor, RequestOutput
from lab.engine.core.overlap import InflightStep, overlap_enabled, overlappable, trim_certain_finishers
from lab.engine.core.sampling_params import BadRequestError, SamplingParams
from lab.engine.core.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from lab.engine.core.sequence import Sequence, Status, TokenLogprob
from lab.engine.core.warm_caches import BuiltCaches
from lab.engine.kv.block_manager import BlockManager
from lab.engine.kv.kv_tiers import build_tiers
from lab.engine.model import cpu_linear
from lab.engine.spec.prompt_lookup import PromptLookup
from lab.engine.weights.loader import LoadedModel, load_model

log = logging.getLogger(__name__)


class EngineBusyError(RuntimeError):
    """The waiting queue is full; the server answers 503."""


@dataclass
class Counters:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    requests_refused: int = 0  # not queued: the waiting queue was full
    steps: int = 0
    overlapped_steps: int = 0  # decode steps queued before the previous step's tokens were read


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.device = resolve_device(config)
        self.dtype = resolve_dtype(config, self.device)
        started = time.monotonic()
        # Before the load, whose timed CPU products (cpu_linear) depend on the thread count.
        self.cpu_threads = cpu_threads.apply(config.cpu_threads, self.device.type)
        # Before the load and the runner's warm-up, which are what may build a cache.
        self.caches = BuiltCaches.snapshot()
        products_before = len(cpu_linear.choice_writes())
        self.loaded = loaded or load_model(config.model, self.dtype, self.device, seed=config.seed)
        self.caches.record_weights(self.loaded.cache_path if self.loaded.cold else None)
        self.model_config = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        self.tokenizer.piece_chars = config.tokenize_piece_chars
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        if self.max_model_len > self.model_config.max_position_embeddings:
            raise ConfigError(f"--max-model-len {self.max_model_len} exceeds the model's context of "
                              f"{self.model_config.max_position_embeddings} tokens")
        self.runner = ModelRunner(config, self.loaded, self.device, self.dtype, self.max_model_len)
        self.caches.record_products(cpu_linear.choice_writes()[products_before:])
        self.loaded.weights = {}  # the model holds its own (fused) references now
        pool_tokens = self.runner.num_blocks * config.block_size
        if pool_tokens < self.max_model_len:
            raise ConfigError(f"the KV pool holds {pool_tokens} tokens ({self.runner.num_blocks} blocks of "
                              f"{config.block_size}), less than one full-length request of {self.max_model_len}; "
                              "raise --num-kv-blocks/--kv-cache-memory-bytes or lower --max-model-len")
        self.tiers = build_tiers(config, self.runner.kv_cache,
                                 {"model": config.model, "source_hash": self.loaded.source_hash})
        if self.tiers is not None and self.tiers.file is not None:
            self.caches.watch_file_tier(self.tiers.file)
        self.blocks = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching,
                                   config.prefix_cache_retention, self.tiers)
        self.drafter: PromptLookup | None = None  # set once its costs are measured, below
        self.scheduler = Scheduler(config, self.blocks)
        self.outputs = OutputProcessor(self.tokenizer, self.max_model_len)
        self.requests: dict[str, Sequence] = {}
        self.counters = Counters()
        self._ids = itertools.count()
        self.overlap = overlap_enabled(config, self.device)
        self._inflight: InflightStep | None = None
        self.known_cost = KnownCost(config.inject_step_delay_ms, self.device)
        if config.prompt_lookup:
            costs = draft_probe.measure(self)
            self.drafter = PromptLookup(config, self.max_model_len, costs)
            log.info("prompt lookup is on; its step costs measured on this device: %s", costs.summary())
            if self.overlap:
                log.info("prompt lookup: a decode step gives up overlapping only where its drafts pay for that")
            if self.runner.graphs is not None:
                log.info("prompt lookup: a verify step replays the decode graphs, one row per token, while its "
                         "rows fit the largest graph (%d); larger ones run eagerly", self.runner.graphs.max_batch)
        self.load_seconds = time.monotonic() - started
        log.info("engine ready in %.1f s: %s on %s (%s), KV pool %d blocks x %d = %d tokens (%.1f MiB)",
                 self.load_seconds, config.model, self.device, str(self.dtype).removeprefix("torch."),
                 self.runner.num_blocks, config.block_size, pool_tokens, self.runner.kv_pool_bytes / 2**20)

    # -- requests ----------------------------------------------------------------------------

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise BadRequestError for a request the engine can never serve."""
        params.validate(self.config.max_logprobs, self.model_config.vocab_size)
        n = len(prompt_token_ids)
        if n == 0:
            raise BadRequestError("the prompt is empty", param="prompt")
        if n >= self.max_model_len:
            raise BadRequestError(f"the prompt has {n} tokens; this model's context is {self.max_model_len} "
                                  "tokens including at least one generated token", param="prompt")
        if n + params.max_tokens > self.max_model_len:
            raise BadRequestError(f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) = "
                                  f"{n + params.max_tokens} exceeds this model's context of "
                                  f"{self.max_model_len} tokens", param="max_tokens")
        vocab = self.model_config.vocab_size
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:  # in C: the prompt is checked twice
            bad = next(t for t in prompt_token_ids if not 0 <= t < vocab)
            raise BadRequestError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})", param="prompt")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    admitted: bool = False) -> Sequence:
        """Queue a request; EngineBusyError when `max_waiting` requests already wait, unless it is
        `admitted` (a further choice of a request already queued, which must not fail half-way)."""
        self.check_request(prompt_token_ids, params)
        if request_id in self.requests:
            raise BadRequestError(f"request id {request_id!r} is already in use")
        if not admitted and len(self.scheduler.waiting) >= self.config.max_waiting:
            self.counters.requests_refused += 1
            raise EngineBusyError(f"{len(self.scheduler.waiting)} requests are already waiting "
                                  f"(--max-waiting {self.config.max_waiting}); retry later")
        seq = Sequence(next(self._ids), request_id, list(prompt_token_ids), params)
        if params.seed is not None and not params.greedy:
            # On the engine's device, so that drawing a token never copies the distribution to the host.
            seq.generator = torch.Generator(device=self.device).manual_seed(params.seed)
        self.requests[request_id] = seq
        if self.drafter is not None:
            self.drafter.admit(seq)
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return None
        if self.drafter is not None:
            self.drafter.forget(seq)
        seq.drop_pending()
        self.scheduler.remove(seq)
        seq.status = Status.FINISHED
        self.counters.requests_aborted += 1
        return self.outputs.finish_without_token(seq, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None

    # -- the step ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step and return the outputs it produced. With overlapped decode, a decode step
        is queued on the device and its tokens are read one call later, after the next step has
        been queued behind it, so the host's work (scheduling, inputs, outputs) hides behind the
        device's; a step that cannot overlap first collects the step in flight."""
        plan = self.scheduler.schedule()
        inflight = self._inflight
        if self.overlap and overlappable(plan) and not (
                self.drafter is not None and self.drafter.pays_to_sync([s.seq for s in plan.scheduled])):
            trim_certain_finishers(plan, self.max_model_len)
            if plan.scheduled:
                self.known_cost(overlapped=True)
                self._inflight = self.runner.launch_decode(plan.scheduled, inflight)
                self.counters.steps += 1
                self.counters.overlapped_steps += inflight is not None
                for s in plan.scheduled:
                    s.seq.num_computed_tokens += 1
                    s.seq.add_pending()
                return self._collect(inflight) if inflight is not None else []
        outputs: list[RequestOutput] = []
        if inflight is not None:
            self._inflight = None
            outputs = self._collect(inflight)
            # Sequences that stopped on the collected tokens leave this step's plan; their
            # blocks are already free and their rows would compute nothing anyone reads.
            plan.scheduled = [s for s in plan.scheduled if not s.seq.is_finished]
        if not plan.scheduled:
            if not outputs and self.scheduler.waiting and not self.scheduler.running:
                # Nothing runs and the head of the queue does not fit: cannot happen with a pool of
                # at least one full-length request, so refuse loudly rather than spin.
                seq = self.scheduler.waiting[0]
                raise RuntimeError(f"request {seq.request_id} cannot be scheduled with an empty engine")
            return outputs
        if self.drafter is not None:
            self.scheduler.add_drafts(plan, self.drafter)
        self.known_cost(overlapped=False)
        return outputs + self._run_sync(plan)

    def _collect(self, inflight: InflightStep) -> list[RequestOutput]:
        """Read a launched step's tokens and turn them into outputs, as `_run_sync` does."""
        outputs: list[RequestOutput] = []
        for seq, token in zip(inflight.seqs, inflight.read_tokens()):
            if seq.is_finished:
                continue  # aborted, or stopped by its previous token, while this step ran
            seq.resolve_pending(token)
            self.blocks.register_full_blocks(seq)
            outputs.append(self._on_sampled(seq, None))
        return outputs

    def _run_sync(self, plan: SchedulerOutput) -> list[RequestOutput]:
        result = self.runner.execute(plan.scheduled)
        self.counters.steps += 1
        if result.graphed and self.drafter is not None and any(s.draft for s in plan.scheduled):
            self.drafter.counters.graph_verify_steps += 1
        outputs: list[RequestOutput] = []
        for s in plan.scheduled:
            seq = s.seq
            if s.draft:
                outputs.append(self._accept(s, result.verified[seq.seq_id]))
                continue
            samples = s.samples  # read before num_computed_tokens moves on
            if seq.wants_prompt_logprobs and seq.seq_id in result.prompt_logprobs:
                prompt_logprobs.keep(seq, seq.num_computed_tokens, result.prompt_logprobs[seq.seq_id])
            seq.num_computed_tokens += s.num_tokens
            if seq.num_computed_tokens <= seq.num_prompt_tokens:
                self.counters.prompt_tokens += s.num_tokens
            self.blocks.register_full_blocks(seq)
            if not samples:
                continue
            if seq.params.max_tokens == 0:
                outputs.append(self._finish(seq, self.outputs.finish_without_token(seq, "length")))
                continue
            token, lp = result.sampled[seq.seq_id]
            seq.token_ids.append(token)
            outputs.append(self._on_sampled(seq, lp))
        return outputs

    def _accept(self, s: ScheduledSeq, verified: list[tuple[int, TokenLogprob | None]]) -> RequestOutput:
        """Append a verify step's tokens one at a time, each checked against every stop rule as a
        plain decode step would, so nothing past a stop is ever emitted."""
        seq = s.seq
        kept = len(verified) - 1
        self.drafter.counters.record(len(s.draft), kept)  # type: ignore[union-attr]
        start = seq.num_computed_tokens
        appended = 0
        for token, lp in verified:
            seq.token_ids.append(token)
            appended += 1
            if lp is not None:
                seq.logprobs.append(lp)
            if seq.first_token_time is None:
                seq.first_token_time = time.monotonic()
            self.counters.generation_tokens += 1
            if self.outputs.advance(seq):
                break
        # K/V is valid for the last known token and the kept drafts (not the token sampled after them).
        seq.num_computed_tokens = start + 1 + min(appended, kept)
        self.blocks.register_full_blocks(seq)
        out = self.outputs.emit(seq)
        return self._finish(seq, out) if out.finished else out

    def _on_sampled(self, seq: Sequence, lp: TokenLogprob | None) -> RequestOutput:
        """Account for the token just made known on `seq` (its logprob when asked for)."""
        if lp is not None:
            seq.logprobs.append(lp)
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        self.counters.generation_tokens += 1
        out = self.outputs.on_token(seq)
        return self._finish(seq, out) if out.finished else out

    def _finish(self, seq: Sequence, out: RequestOutput) -> RequestOutput:
        if self.drafter is not None:
            self.drafter.forget(seq)
        seq.drop_pending()
        self.scheduler.remove(seq)
        seq.status = Status.FINISHED
        self.requests.pop(seq.request_id, None)
        self.counters.requests_finished += 1
        return out

    def flush_tiers(self) -> None:
        """Every KV block handed to the file tier is in the file: a restarted engine finds it."""
        if self.tiers is not None:
            self.tiers.flush()

    def close(self) -> None:
        """Flush the KV tiers and stop the file tier's writer thread."""
        if self.tiers is not None:
            self.tiers.close()

    # -- introspection -----------------------------------------------------------------------

    def reset_prefix_cache(self) -> int:
        return self.blocks.reset_prefix_cache()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)
