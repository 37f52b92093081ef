"""Owns the weights on the device and the KV pool; turns a scheduled step into one forward pass
over a flat varlen batch, then samples."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field

import torch

from lab.engine.core import prompt_logprobs, sampler
from lab.engine.core.config import ConfigError, EngineConfig
from lab.engine.core.cuda_graphs import DecodeGraphs
from lab.engine.core.overlap import InflightStep
from lab.engine.core.scheduler import ScheduledSeq
from lab.engine.core.sequence import TokenLogprob
from lab.engine.model.attention import AttentionBackend, TorchAttention
from lab.engine.model.attention_metadata import AttentionMetadata, build_metadata
from lab.engine.model.host_copy import to_device
from lab.engine.model.model import Model, Ops, SkinnyOps
from lab.engine.spec import rejection_sampler
from lab.engine.weights.loader import LoadedModel

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_DEFAULT_KV_BYTES = 1 << 30


def resolve_device(config: EngineConfig) -> torch.device:
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available")
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(config.device)


def resolve_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    if config.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[config.dtype]


def kv_cache_dtype(config: EngineConfig, model_dtype: torch.dtype) -> torch.dtype:
    return torch.float8_e4m3fn if config.kv_cache_dtype == "fp8" else model_dtype


def make_backends(config: EngineConfig, device: torch.device, max_model_len: int | None = None,
                  num_layers: int = 1) -> tuple[AttentionBackend, Ops]:
    choice = config.attention_backend
    if choice == "auto":
        choice = "triton" if device.type == "cuda" else "torch"
    if config.gemv_backend == "triton" and choice != "triton":
        raise ConfigError("--gemv-backend triton needs --attention-backend triton on --device cuda")
    if config.pdl and (choice != "triton" or device.type != "cuda"
                       or torch.cuda.get_device_capability(device) < (9, 0)):
        raise ConfigError("--pdl needs --attention-backend triton on a CUDA GPU of compute capability 9.0 or newer")
    if config.prefill_attention != "auto" and (choice != "triton" or device.type != "cuda"):
        raise ConfigError(f"--prefill-attention {config.prefill_attention} needs --attention-backend triton on "
                          "--device cuda (the CPU path has one attention kernel)")
    if choice == "torch":
        return TorchAttention(), Ops()
    if device.type != "cuda":
        raise ConfigError("--attention-backend triton needs --device cuda (use torch on the CPU)")
    from lab.engine.kernels import gemv, rmsnorm, silu_mul
    from lab.engine.kernels.rope_kv_write import rope_and_write_kv
    from lab.engine.model.chunk_attention import PrefillKernels
    from lab.engine.model.triton_attention import TritonAttention

    budgets = (config.max_num_batched_tokens, config.lone_prefill_tokens, config.long_prefill_token_threshold)
    kernels = PrefillKernels(config.prefill_attention, num_layers,
                             frozenset(b for b in budgets if b > 0))
    attention = TritonAttention(max_model_len=max_model_len, pdl=config.pdl, prefill_kernels=kernels)

    def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # In place: q and k are views of this layer's qkv product, which nothing else reads.
        return rope_and_write_kv(q, k, v, rows, k_cache, v_cache, slots, attention.k_scale, attention.v_scale)

    ops = Ops(rms_norm=rmsnorm.rms_norm, silu_and_mul=silu_mul.silu_and_mul, rope_write_kv=rope_write_kv)
    if config.gemv_backend != "torch":
        def qkv_rope_kv(x: torch.Tensor, w: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                        rows: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slots: torch.Tensor) -> torch.Tensor:
            rope = gemv.RopeKV(rows, k_cache, v_cache, slots, attention.k_scale, attention.v_scale)
            return gemv.skinny_linear(x, w, norm_weight=norm_weight, eps=eps, rope=rope, pdl=config.pdl)

        ops.skinny = SkinnyOps(rows=gemv.MAX_ROWS, linear=functools.partial(gemv.skinny_linear, pdl=config.pdl),
                               silu_mul_linear=functools.partial(gemv.skinny_silu_mul_linear, pdl=config.pdl),
                               qkv_rope_kv=qkv_rope_kv)
    return attention, ops


@dataclass
class StepResult:
    sampled: dict[int, tuple[int, TokenLogprob | None]] = field(default_factory=dict)
    prompt_logprobs: dict[int, list[TokenLogprob | None]] = field(default_factory=dict)
    # Sequences that carried a draft: the kept draft tokens then one more, with their logprobs.
    verified: dict[int, list[tuple[int, TokenLogprob | None]]] = field(default_factory=dict)
    graphed: bool = False  # the step replayed a CUDA graph


class ModelRunner:
    def __init__(self, config: EngineConfig, loaded: LoadedModel, device: torch.device, dtype: torch.dtype,
                 max_model_len: int) -> None:
        self.config = config
        self.device = device
        self.dtype = dtype
        self.model_config = loaded.config
        self.max_model_len = max_model_len
        self.block_size = config.block_size
        self.eos_token_ids = tuple(loaded.tokenizer.eos_token_ids)  # masked before a request's min_tokens
        self.attention, ops = make_backends(config, device, max_model_len, loaded.config.num_layers)
        self.model = Model(loaded.config, loaded.weights, self.attention, max_positions=max_model_len, ops=ops,
                           cpu_products=config.cpu_products)
        self.kv_dtype = kv_cache_dtype(config, dtype)
        self.num_blocks = self._num_blocks()
        mc = loaded.config
        # One block past the pool is the null block: padding rows of a CUDA-graph batch write and
        # read there. Zeroed, not empty: padded positions of a gathered context are masked, but
        # 0 * NaN from uninitialised memory would still poison the weighted sum.
        self.null_block = self.num_blocks
        self.kv_cache = torch.zeros(mc.num_layers, 2, self.num_blocks + 1, self.block_size, mc.num_kv_heads,
                                    mc.head_dim, dtype=self.kv_dtype, device=device)
        self.kv_layers = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(mc.num_layers)]
        torch.manual_seed(config.seed)
        self.graphs: DecodeGraphs | None = None
        if device.type == "cuda" and config.cuda_graphs and self.attention.name == "triton":
            max_batch = min(config.cuda_graph_max_batch_size, config.max_num_seqs)
            k_cache = self.kv_layers[0][0]
            self.graphs = DecodeGraphs(self.model, self.kv_layers, self.null_block, self.block_size,
                                       max_model_len, max_batch,
                                       lambda bs: self.attention.context_bounds(bs, k_cache, max_model_len))
            self.graphs.capture()
        if device.type == "cuda" and self.attention.name == "triton":
            self.attention.warm_up(*self.kv_layers[0], self.null_block, mc.num_heads, dtype)
        # Two sets of pinned buffers for sampled tokens (and, in the graphs, for each step's
        # inputs), used alternately by consecutive steps: with overlapped decode step N+1 fills
        # one set while step N may still be copying from, or into, the other. One parity for both,
        # flipped by every step that uses them (`_next_parity`).
        rows = max(config.max_num_seqs, 1)
        pin = device.type == "cuda"
        self._host_tokens = [torch.zeros(rows, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self._parity = 0

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        return self.model_config.kv_bytes_per_token(elem) * self.block_size

    @property
    def kv_pool_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def _num_blocks(self) -> int:
        cfg = self.config
        if cfg.num_kv_blocks:
            return cfg.num_kv_blocks
        if cfg.kv_cache_memory_bytes:
            budget = cfg.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free  # weights, CUDA context, anything else on the device
            mc = self.model_config
            elem = torch.empty((), dtype=self.dtype).element_size()
            # Activations of the largest step (the gate|up product dominates, plus its SiLU
            # output and the attention temporaries), the LM head's logits for every decode
            # row, and slack for graphs and the allocator.
            tokens = max(cfg.max_num_batched_tokens, cfg.lone_prefill_tokens)
            activations = tokens * (3 * mc.intermediate_size + 6 * mc.hidden_size) * elem
            logits = max(cfg.max_num_seqs, 1) * mc.vocab_size * (elem + 4)
            budget = int(total * cfg.gpu_memory_utilization) - used - activations - logits - (2 << 30)
        else:
            budget = CPU_DEFAULT_KV_BYTES
        blocks = budget // self.bytes_per_block
        if blocks <= 0:
            raise ConfigError(f"no memory left for the KV cache (budget {budget} bytes); lower the model size "
                              "or raise --kv-cache-memory-bytes / --gpu-memory-utilization")
        return int(blocks)

    # -- one step ----------------------------------------------------------------------------

    def prepare(self, scheduled: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata,
                                                                list[int]]:
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens, context_lens, tables = [], [], []
        logit_rows: list[int] = []
        for s in scheduled:
            seq, n = s.seq, s.num_tokens
            start = seq.num_computed_tokens
            base = len(input_ids)
            known = n - len(s.draft)
            input_ids.extend(seq.token_ids[start:start + known])
            input_ids.extend(s.draft)
            positions.extend(range(start, start + n))
            query_lens.append(n)
            context_lens.append(start + n)
            tables.append(seq.block_table)
            if (seq.wants_prompt_logprobs and start < seq.num_prompt_tokens) or s.draft:
                logit_rows.extend(range(base, base + n))
            elif s.samples:
                logit_rows.append(base + n - 1)
        meta = build_metadata(query_lens, context_lens, tables, self.block_size, device=self.device)
        ids = to_device(input_ids, torch.long, self.device)
        pos = to_device(positions, torch.long, self.device)
        return ids, pos, meta, logit_rows

    def _decode_rows(self, scheduled: list[ScheduledSeq]) -> tuple[list[int], list[int], list[list[int]]] | None:
        """(token ids, positions, block tables) of a step that a decode graph can run, one row per
        token, or None. A verify step qualifies: each draft token is one more decode row of its
        sequence (the same block table, the next position), so every row writes its K/V and
        attends to the context up to itself, as causal attention over the draft would; the logits
        come out in the rows `prepare` would have chosen. Eager, such a step launches every
        kernel of every layer, many times a replayed graph's cost on a small batch."""
        graphs = self.graphs
        if graphs is None:
            return None
        ids: list[int] = []
        positions: list[int] = []
        tables: list[list[int]] = []
        for s in scheduled:
            seq, start = s.seq, s.seq.num_computed_tokens
            if s.num_tokens - len(s.draft) != 1 or not (s.samples or s.draft) or (
                    seq.wants_prompt_logprobs and start < seq.num_prompt_tokens):
                return None
            ids.append(seq.token_ids[start])
            ids.extend(s.draft)
            positions.extend(range(start, start + s.num_tokens))
            tables.extend([seq.block_table] * s.num_tokens)
        return (ids, positions, tables) if len(ids) <= graphs.max_batch else None

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq]) -> StepResult:
        rows = self._decode_rows(scheduled)
        if rows is not None:
            assert self.graphs is not None
            result = self._postprocess(scheduled, self.graphs.run(self._next_parity(), *rows))
            result.graphed = True
            return result
        ids, pos, meta, logit_rows = self.prepare(scheduled)
        hidden = self.model.forward(ids, pos, meta, self.kv_layers)
        logits = None
        if logit_rows:
            logits = self.model.logits(hidden.index_select(0, to_device(logit_rows, torch.long, self.device)))
        return self._postprocess(scheduled, logits)

    @torch.inference_mode()
    def launch_decode(self, scheduled: list[ScheduledSeq], prev: InflightStep | None) -> InflightStep:
        """Start a decode step (one token per sequence, no logprobs) and return without waiting
        for it. A sequence with a pending token takes it from `prev` on the device as its input,
        so this step can be queued while `prev` still runs."""
        seqs = [s.seq for s in scheduled]
        src = [prev.rows[q.seq_id] if q.num_pending else -1 for q in seqs] if prev is not None else None
        host_ids = [q.last_known_token if not q.num_pending else 0 for q in seqs]
        parity = self._next_parity()
        graphs = self.graphs
        if graphs is not None and len(seqs) <= graphs.max_batch:
            logits = graphs.run(parity, host_ids, [q.num_tokens - 1 for q in seqs], [q.block_table for q in seqs],
                                prev.tokens if prev is not None else None, src)
        else:
            ids, pos, meta, _ = self.prepare(scheduled)
            if prev is not None:
                src_t = torch.tensor(src, dtype=torch.long, device=self.device)
                ids = torch.where(src_t >= 0, prev.tokens.index_select(0, src_t.clamp(min=0)), ids)
            logits = self.model.logits(self.model.forward(ids, pos, meta, self.kv_layers))
        tokens = sampler.sample(logits, [q.params for q in seqs], [q.generator for q in seqs])
        host = self._host_tokens[parity][:len(seqs)]
        event = None
        if self.device.type == "cuda":
            host.copy_(tokens, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host.copy_(tokens)
        return InflightStep(seqs, tokens, host, event, {q.seq_id: i for i, q in enumerate(seqs)})

    def _next_parity(self) -> int:
        parity = self._parity
        self._parity ^= 1
        return parity

    def _postprocess(self, scheduled: list[ScheduledSeq], logits: torch.Tensor | None) -> StepResult:
        result = StepResult()
        if logits is None:
            return result
        if not any(s.seq.wants_prompt_logprobs or s.draft for s in scheduled):
            # The usual step: one logits row per sequence that samples, already in order.
            return self._sample(scheduled if len(logits) == len(scheduled) else
                                [s for s in scheduled if s.samples], logits, result)
        sample_rows: list[int] = []
        sample_seqs: list[ScheduledSeq] = []
        row = 0
        for s in scheduled:
            seq, n = s.seq, s.num_tokens
            start = seq.num_computed_tokens
            if seq.wants_prompt_logprobs and start < seq.num_prompt_tokens:
                result.prompt_logprobs[seq.seq_id] = prompt_logprobs.of_chunk(seq, start, n, logits[row:row + n])
                if s.samples:
                    sample_rows.append(row + n - 1)
                    sample_seqs.append(s)
                row += n
            elif s.draft:
                self._verify(s, logits[row:row + n], result)
                row += n
            elif s.samples:
                sample_rows.append(row)
                sample_seqs.append(s)
                row += 1
        if not sample_seqs:
            return result
        return self._sample(sample_seqs, logits[sample_rows], result)

    def _sample(self, sample_seqs: list[ScheduledSeq], rows: torch.Tensor, result: StepResult) -> StepResult:
        params = [s.seq.params for s in sample_seqs]
        tokens = sampler.sample(rows, params, [s.seq.generator for s in sample_seqs], [s.seq for s in sample_seqs],
                                self.eos_token_ids)
        want = [p.logprobs for p in params]
        lps: list[TokenLogprob | None] = [None] * len(sample_seqs)
        if any(w is not None for w in want):
            computed = sampler.logprobs_of(rows, tokens, [w or 0 for w in want])
            lps = [lp if w is not None else None for lp, w in zip(computed, want)]
        for s, token, lp in zip(sample_seqs, tokens.tolist(), lps):
            result.sampled[s.seq.seq_id] = (token, lp)
        return result

    def _verify(self, s: ScheduledSeq, rows: torch.Tensor, result: StepResult) -> None:
        seq = s.seq
        tokens = rejection_sampler.verify(rows, s.draft, seq.params, seq.generator, seq.num_output_tokens,
                                          self.eos_token_ids)
        lps: list[TokenLogprob | None] = [None] * len(tokens)
        if seq.params.logprobs is not None:
            chosen = torch.tensor(tokens, dtype=torch.long, device=rows.device)
            lps = list(sampler.logprobs_of(rows[:len(tokens)], chosen, [seq.params.logprobs] * len(tokens)))
        result.verified[seq.seq_id] = list(zip(tokens, lps))
