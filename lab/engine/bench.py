"""`lab engine bench`: offline speed of the engine against Hugging Face transformers on the same
weights, in one run, with each figure also shown against the device's physical floor.

Figures:
- cold prefill tok/s at each length: unique random prompts (no prefix-cache hit possible),
  one generated token, time from submission to that token; median of `repeats`;
- decode tok/s at batch 1 and aggregate decode tok/s at `concurrency`: only the steps after every
  sequence has its first token (the decode phase), tokens over the time those steps took;
- on request, throughput runs of N requests of `throughput_tokens` prompt and output tokens:
  overall output tok/s (prefill included) and decode-phase tok/s.
Transformers is timed the same way: prefill is one forward pass keeping only the last logits;
decode is `generate` of N tokens minus `generate` of 1 token, greedy, with its KV cache."""

from __future__ import annotations

import gc
import json
import logging
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from lab.engine.config import EngineConfig
from lab.engine.llm import LLM
from lab.engine.loader import load_model
from lab.engine.model_config import ModelConfig
from lab.engine.model_runner import resolve_device, resolve_dtype
from lab.engine.roofline import (Ceilings, decode_step_floor_s, measure_ceilings, prefill_floor_s)
from lab.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class BenchOptions:
    prefill_lengths: list[int] = field(default_factory=lambda: [512, 2048])
    decode_tokens: int = 64
    prompt_tokens: int = 128
    concurrency: int = 8
    reference: str = "hf"
    repeats: int = 3
    throughput: list[int] = field(default_factory=list)
    throughput_tokens: int = 1024
    reference_prefill_max: int = 32768  # longer prompts are too big for eager attention's score matrix
    json_out: str | None = None


@dataclass
class Figure:
    name: str
    unit: str
    ours: float | None = None
    reference: dict[str, float] = field(default_factory=dict)  # implementation -> value
    floor_fraction: float | None = None  # share of the physical floor reached (1 = at the floor)
    note: str = ""


class Figures(list):
    """The run's figures, each logged as soon as it is measured: a run cut short by a time limit
    still leaves what it measured in its log."""

    def append(self, figure: Figure) -> None:  # type: ignore[override]
        super().append(figure)
        log.info("figure: %s = %s %s%s", figure.name, f"{figure.ours:,.1f}" if figure.ours else "-", figure.unit,
                 f" ({100 * figure.floor_fraction:.0f}% of floor)" if figure.floor_fraction else "")


@dataclass
class DecodeRun:
    tok_s: float  # decode-phase tokens per second
    step_s: float  # median decode step time
    floor_fraction: float | None
    overall_tok_s: float  # output tokens over the whole run's wall time, prefill included


class PromptSource:
    """Random token ids from a seeded generator: every prompt is new to the prefix cache."""

    def __init__(self, vocab_size: int, seed: int = 1234) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.low, self.high = min(100, vocab_size // 2), vocab_size

    def __call__(self, n: int) -> list[int]:
        return torch.randint(self.low, self.high, (n,), generator=self.gen).tolist()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- the engine ------------------------------------------------------------------------------

def engine_prefill_s(llm: LLM, ids: list[int]) -> float:
    engine = llm.engine
    t0 = time.perf_counter()
    engine.add_request(f"prefill-{time.monotonic_ns()}", ids,
                       SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, detokenize=False))
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - t0


def engine_decode(llm: LLM, prompts: list[list[int]], new_tokens: int, ceilings: Ceilings | None) -> DecodeRun:
    """Run the prompts together; time the steps after every sequence has its first token."""
    engine = llm.engine
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True, detokenize=False)
    for i, ids in enumerate(prompts):
        engine.add_request(f"decode-{time.monotonic_ns()}-{i}", ids, params)
    mc, runner = engine.model_config, engine.runner
    weight_elem = torch.empty((), dtype=engine.dtype).element_size()
    kv_elem = torch.empty((), dtype=runner.kv_dtype).element_size()
    started = set()
    decode_tokens, decode_time, steps, floors = 0, 0.0, [], []
    t_start = t0 = time.perf_counter()
    while engine.has_unfinished():
        pure_decode = len(started) == len(prompts)
        context = sum(s.num_tokens for s in engine.scheduler.running)
        outs = engine.step()
        # No device sync per step: with overlapped decode a step returns the previous step's
        # tokens while the next one runs, so the time between returns is the step time.
        now = time.perf_counter()
        dt, t0 = now - t0, now
        produced = sum(len(o.new_token_ids) for o in outs)
        if pure_decode and produced:
            decode_tokens += produced
            decode_time += dt
            steps.append(dt)
            if ceilings is not None:
                floors.append(decode_step_floor_s(mc, weight_elem, kv_elem, context, ceilings) / dt)
        started.update(o.request_id for o in outs if o.new_token_ids)
    _sync(engine.device)
    wall = time.perf_counter() - t_start
    return DecodeRun(tok_s=decode_tokens / decode_time if decode_time else float("nan"),
                     step_s=statistics.median(steps) if steps else float("nan"),
                     floor_fraction=statistics.median(floors) if floors else None,
                     overall_tok_s=len(prompts) * new_tokens / wall)


# -- transformers ----------------------------------------------------------------------------

def hf_prefill_s(model, ids: list[int], device: torch.device) -> float:
    x = torch.tensor([ids], device=device)
    _sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        model(x, logits_to_keep=1)
    _sync(device)
    return time.perf_counter() - t0


def hf_generate_s(model, prompts: list[list[int]], new_tokens: int, device: torch.device) -> float:
    x = torch.tensor(prompts, device=device)
    _sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    _sync(device)
    return time.perf_counter() - t0


def hf_decode_tok_s(model, prompts: list[list[int]], new_tokens: int, device: torch.device) -> float:
    t_n = hf_generate_s(model, prompts, new_tokens, device)
    t_1 = hf_generate_s(model, prompts, 1, device)
    return len(prompts) * (new_tokens - 1) / max(1e-9, t_n - t_1)


# -- the run ---------------------------------------------------------------------------------

def _median(values: list[float]) -> float:
    return statistics.median(values)


def run_bench(cfg: EngineConfig, opts: BenchOptions) -> int:
    device = resolve_device(cfg)
    dtype = resolve_dtype(cfg, device)
    # Before the engine: its KV pool takes most of the device memory.
    ceilings = measure_ceilings(device, dtype)
    log.info("ceilings: copy %.1f GB/s, matmul %.2f TFLOP/s", ceilings.copy_bytes_per_s / 1e9,
             ceilings.matmul_flops_per_s / 1e12)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    llm = LLM(config=cfg)
    engine = llm.engine
    mc: ModelConfig = engine.model_config
    prompts = PromptSource(mc.vocab_size, seed=cfg.seed + 1234)
    log.info("bench: %s on %s (%s), attention %s, KV pool %d tokens (%s)", cfg.model, device, dtype,
             engine.runner.attention.name, engine.runner.num_blocks * cfg.block_size, engine.runner.kv_dtype)
    figures = Figures()

    prefill_sets = {n: [prompts(n) for _ in range(opts.repeats)] for n in opts.prefill_lengths}
    budget = cfg.max_num_batched_tokens
    for n, sets in prefill_sets.items():
        # Warm-up at this length (two chunks' worth at most): the first call of a shape pays for
        # kernel compiles, allocator growth and lazy module loads, which are not prefill speed.
        engine_prefill_s(llm, prompts(min(n, 2 * budget + 1)))
        secs = _median([engine_prefill_s(llm, ids) for ids in sets])
        figures.append(Figure(f"prefill {n} tok", "tok/s", ours=n / secs,
                              floor_fraction=prefill_floor_s(mc, n, ceilings) / secs))

    decode_b1_prompts = [prompts(opts.prompt_tokens)]
    decode_bc_prompts = [prompts(opts.prompt_tokens) for _ in range(opts.concurrency)]
    engine_decode(llm, [prompts(opts.prompt_tokens)], 8, None)  # warm-up (graphs, allocator)
    b1 = [engine_decode(llm, decode_b1_prompts, opts.decode_tokens, ceilings) for _ in range(opts.repeats)]
    bc = [engine_decode(llm, decode_bc_prompts, opts.decode_tokens, ceilings) for _ in range(opts.repeats)]
    figures.append(Figure("decode batch 1", "tok/s", ours=_median([r.tok_s for r in b1]),
                          floor_fraction=_median([r.floor_fraction for r in b1 if r.floor_fraction]),
                          note=f"step {1e3 * _median([r.step_s for r in b1]):.2f} ms"))
    figures.append(Figure(f"decode batch {opts.concurrency} (aggregate)", "tok/s",
                          ours=_median([r.tok_s for r in bc]),
                          floor_fraction=_median([r.floor_fraction for r in bc if r.floor_fraction]),
                          note=f"step {1e3 * _median([r.step_s for r in bc]):.2f} ms"))
    for n in opts.throughput:
        run = engine_decode(llm, [prompts(opts.throughput_tokens) for _ in range(n)], opts.throughput_tokens,
                            ceilings)
        figures.append(Figure(f"throughput {n} req: output (prefill incl.)", "tok/s", ours=run.overall_tok_s))
        figures.append(Figure(f"throughput {n} req: decode phase", "tok/s", ours=run.tok_s,
                              floor_fraction=run.floor_fraction,
                              note=f"step {1e3 * run.step_s:.2f} ms"))

    if opts.reference == "hf":
        del llm, engine
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            log.info("engine released: %.1f GiB still allocated", torch.cuda.memory_allocated(device) / 2**30)
        _run_reference(cfg, opts, mc, device, dtype, prefill_sets, decode_b1_prompts, decode_bc_prompts, figures)

    _print(figures, cfg, device, dtype, ceilings)
    if opts.json_out:
        with open(opts.json_out, "w") as f:
            json.dump({"config": cfg.to_dict(), "config_hash": cfg.hash, "device": str(device),
                       "dtype": str(dtype), "ceilings": asdict(ceilings),
                       "figures": [asdict(f) for f in figures]}, f, indent=2)
    return 0


def _run_reference(cfg: EngineConfig, opts: BenchOptions, mc: ModelConfig, device: torch.device,
                   dtype: torch.dtype, prefill_sets: dict[int, list[list[int]]], b1_prompts: list[list[int]],
                   bc_prompts: list[list[int]], figures: list[Figure]) -> None:
    from lab.engine.hf_reference import build_hf_model

    weights = load_model(cfg.model, dtype, device, seed=cfg.seed).weights
    impls = ["sdpa", "eager"] if device.type == "cuda" else ["sdpa"]
    by_name = {f.name: f for f in figures}
    for impl in impls:
        model = build_hf_model(mc, dict(weights), dtype, device, impl)
        # Eager attention materialises [heads, n, n] float32 scores: 8K is ~9 GB for 32 heads.
        longest = min(opts.reference_prefill_max, 8192) if impl == "eager" else opts.reference_prefill_max
        for n, sets in prefill_sets.items():
            if n > longest:
                continue
            hf_prefill_s(model, sets[0], device)  # warm-up at this length, as for the engine
            secs = _median([hf_prefill_s(model, ids, device) for ids in sets])
            by_name[f"prefill {n} tok"].reference[f"hf-{impl}"] = n / secs
            log.info("reference hf-%s: prefill %d tok = %.1f tok/s", impl, n, n / secs)
        hf_generate_s(model, b1_prompts, 4, device)  # warm-up
        by_name["decode batch 1"].reference[f"hf-{impl}"] = _median(
            [hf_decode_tok_s(model, b1_prompts, opts.decode_tokens, device) for _ in range(opts.repeats)])
        by_name[f"decode batch {opts.concurrency} (aggregate)"].reference[f"hf-{impl}"] = _median(
            [hf_decode_tok_s(model, bc_prompts, opts.decode_tokens, device) for _ in range(opts.repeats)])
        log.info("reference hf-%s: decode batch 1 = %.1f, batch %d = %.1f tok/s", impl,
                 by_name["decode batch 1"].reference[f"hf-{impl}"], opts.concurrency,
                 by_name[f"decode batch {opts.concurrency} (aggregate)"].reference[f"hf-{impl}"])
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _print(figures: list[Figure], cfg: EngineConfig, device: torch.device, dtype: torch.dtype,
           ceilings: Ceilings) -> None:
    from rich.console import Console
    from rich.table import Table

    impls = sorted({k for f in figures for k in f.reference})
    table = Table(title=f"lab engine bench — {cfg.model} on {device} ({str(dtype).removeprefix('torch.')}), "
                        f"config {cfg.hash}")
    table.add_column("figure")
    table.add_column("lab", justify="right")
    for impl in impls:
        table.add_column(impl, justify="right")
        table.add_column(f"lab / {impl}", justify="right")
    table.add_column("of floor", justify="right")
    table.add_column("note")
    for f in figures:
        row = [f.name, f"{f.ours:,.1f}" if f.ours is not None else "-"]
        for impl in impls:
            ref = f.reference.get(impl)
            row.append(f"{ref:,.1f}" if ref else "-")
            row.append(f"{f.ours / ref:.2f}x" if ref and f.ours else "-")
        row.append(f"{100 * f.floor_fraction:.0f}%" if f.floor_fraction else "-")
        row.append(f.note)
        table.add_row(*row)
    console = Console(width=160)
    console.print(table)
    console.print(f"ceilings measured on {ceilings.device}: copy {ceilings.copy_bytes_per_s / 1e9:,.1f} GB/s "
                  f"(read+write), matmul {ceilings.matmul_flops_per_s / 1e12:,.2f} TFLOP/s ({ceilings.dtype}); "
                  "'of floor' = floor time / measured time (bytes for decode, FLOPs for prefill)")
