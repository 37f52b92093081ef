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
decode is `generate` of N tokens minus `generate` of 1 token, greedy, with its KV cache.

With `served`, the same decode workloads (the same prompt token ids) also go through the engine's
own HTTP server, booted as a subprocess with the same knobs: streamed `/v1/completions` with
`ignore_eos`, timed by the client at each SSE chunk's arrival. Per-stream decode tok/s is
(tokens - 1) / (last chunk - first chunk); the aggregate is the tokens that arrived after every
stream had its first one, over the time from then to the last token. What the served figures lose
against the offline ones is the server's per-token cost: HTTP, SSE framing, detokenization and
the hand-off between the engine thread and the event loop."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import json
import logging
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

import httpx
import torch

from lab.engine.core.config import KNOBS, EngineConfig, flag_name
from lab.engine.core.model_runner import resolve_device, resolve_dtype
from lab.engine.core.sampling_params import SamplingParams
from lab.engine.model_config import ModelConfig
from lab.engine.model.roofline import (Ceilings, decode_step_floor_s, measure_ceilings, prefill_floor_s)
from lab.engine.serve.llm import LLM
from lab.engine.weights.loader import load_model

log = logging.getLogger(__name__)

# Longest prefill warmed up at its full length; a longer one (1M) warms up on two chunks.
WARM_FULL_MAX = 131072


@dataclass
class BenchOptions:
    prefill_lengths: list[int] = field(default_factory=lambda: [512, 2048])
    decode_tokens: int = 64
    decode_temperature: float = 0.0  # > 0: sampled decode (seeded per prompt), e.g. where drafts must miss
    prompt_tokens: int = 128
    concurrency: int = 8
    reference: str = "hf"
    repeats: int = 3
    throughput: list[int] = field(default_factory=list)
    throughput_tokens: int = 1024
    reference_prefill_max: int = 32768  # longer prompts are too big for eager attention's score matrix
    json_out: str | None = None
    served: bool = False  # also run the decode workloads through the engine's own server
    server_log: str | None = None  # the served engine's output (default: a new temporary file)
    server_timeout_s: float = 600.0  # longest wait for the served engine to answer /health


@dataclass
class Figure:
    name: str
    unit: str
    # What it measures, for a program reading the JSON (the lab's offline instrument): "prefill"
    # {length}, "decode" {batch}, "throughput" {requests, phase: output|decode}.
    kind: str = ""
    params: dict[str, int | str] = field(default_factory=dict)
    ours: float | None = None
    reference: dict[str, float] = field(default_factory=dict)  # implementation -> value
    floor_fraction: float | None = None  # share of the physical floor reached (1 = at the floor)
    note: str = ""
    runs: list[float] = field(default_factory=list)  # every repeat behind `ours`
    served: float | None = None  # the same workload through the engine's server
    served_runs: list[float] = field(default_factory=list)
    served_note: str = ""


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


def spec_totals(llm: LLM) -> tuple[int, int, int]:
    """Prompt lookup's (drafts, drafted, accepted) so far; zeros when it is off."""
    drafter = llm.engine.drafter
    if drafter is None:
        return 0, 0, 0
    return drafter.counters.drafts, drafter.counters.draft_tokens, drafter.counters.accepted_tokens


def spec_note(llm: LLM, before: tuple[int, int, int]) -> str:
    """What prompt lookup did since `before`, for a figure's note; empty when it is off."""
    if llm.engine.drafter is None:
        return ""
    drafts, drafted, accepted = (now - was for now, was in zip(spec_totals(llm), before))
    return f", prompt lookup: {accepted} of {drafted} drafted tokens accepted in {drafts} drafts"


def engine_decode(llm: LLM, prompts: list[list[int]], new_tokens: int, ceilings: Ceilings | None,
                  temperature: float = 0.0) -> DecodeRun:
    """Run the prompts together; time the steps after every sequence has its first token."""
    engine = llm.engine
    for i, ids in enumerate(prompts):
        params = SamplingParams(max_tokens=new_tokens, temperature=temperature, seed=i if temperature else None,
                                ignore_eos=True, detokenize=False)
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


# -- the engine through its server ------------------------------------------------------------

_PR_SET_PDEATHSIG = 1  # prctl option, from <linux/prctl.h>


class ServerError(RuntimeError):
    """The served engine did not come up, died, or answered a request with an error."""


def engine_flags(cfg: EngineConfig) -> list[str]:
    """Every knob as an explicit flag, so the served engine runs exactly `cfg` whatever
    LAB_ENGINE_* variables it inherits (flags win)."""
    flags = []
    for name in KNOBS:
        value = getattr(cfg, name)
        flags += [flag_name(name), str(value).lower() if isinstance(value, bool) else str(value)]
    return flags


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _last_line(path: Path) -> str:
    try:
        lines = path.read_text("utf-8", errors="replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1][-300:] if lines else ""


@contextmanager
def served_engine(cfg: EngineConfig, log_path: Path, timeout_s: float) -> Iterator[str]:
    """`python -m lab.engine serve` with `cfg` on a free loopback port, in its own process group,
    output to `log_path`; yields its base URL once /health answers and its config hash is `cfg`'s.
    Stopped (SIGTERM, then SIGKILL) on the way out, whatever happened; sent SIGTERM by the kernel
    if the bench itself is killed."""
    port = _free_port()
    argv = [sys.executable, "-m", "lab.engine", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "warning", *engine_flags(cfg)]
    url = f"http://127.0.0.1:{port}"
    log.info("booting the served engine on %s, output in %s", url, log_path)
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=_stop_with_parent)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise ServerError(f"the served engine exited with {proc.returncode} before answering /health "
                                  f"(log {log_path}): {_last_line(log_path)}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise ServerError(f"the served engine did not answer /health in {timeout_s:g} s (log {log_path})")
            time.sleep(0.2)
        served_hash = httpx.get(f"{url}/v1/stats", timeout=30).json().get("config_hash")
        if served_hash != cfg.hash:
            raise ServerError(f"the served engine runs config {served_hash}, not the bench's {cfg.hash}")
        yield url
    finally:
        _stop(proc)


def _stop_with_parent() -> None:
    """In the served engine's process before it runs: SIGTERM when the bench dies, so a bench that
    is killed (no `finally` runs on SIGKILL or an unhandled SIGTERM) leaves no engine behind."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass  # not Linux: the `finally` of served_engine is then the only guard


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)
    except subprocess.TimeoutExpired:
        log.warning("the served engine ignored SIGTERM for 10 s; killing it")
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


@dataclass
class Stream:
    """One streamed completion as the client saw it."""
    chunk_times: list[float]  # perf_counter at each chunk carrying text
    tokens: int  # completion tokens, from the final usage chunk


@dataclass
class ServedDecode:
    per_stream_tok_s: float  # median over the streams of (tokens - 1) / (last chunk - first chunk)
    agg_tok_s: float  # tokens arriving after every stream started, over the time from then to the end
    tokens_per_chunk: float  # 1.0 when every token came in its own chunk, as the timing assumes


async def _stream(client: httpx.AsyncClient, url: str, ids: list[int], new_tokens: int) -> Stream:
    body = {"prompt": ids, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    times: list[float] = []
    tokens = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise ServerError(f"/v1/completions answered {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            now = time.perf_counter()
            data = line[6:]
            if data == "[DONE]":
                break
            payload = json.loads(data)
            if "error" in payload:
                raise ServerError(f"/v1/completions streamed an error: {payload['error']}")
            if payload.get("usage"):
                tokens = payload["usage"]["completion_tokens"]
            if any(c.get("text") for c in payload["choices"]):
                times.append(now)
    if tokens != new_tokens:
        raise ServerError(f"asked for {new_tokens} tokens with ignore_eos, got {tokens}")
    return Stream(times, tokens)


async def _served_decode_async(url: str, prompts: list[list[int]], new_tokens: int) -> list[Stream]:
    limits = httpx.Limits(max_connections=len(prompts) + 2, max_keepalive_connections=len(prompts) + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30), limits=limits) as client:
        return await asyncio.gather(*[_stream(client, url, ids, new_tokens) for ids in prompts])


def served_decode(url: str, prompts: list[list[int]], new_tokens: int) -> ServedDecode:
    """The prompts streamed together; decode speed as the client saw it."""
    streams = asyncio.run(_served_decode_async(url, prompts, new_tokens))
    chunks = sum(len(s.chunk_times) for s in streams)
    per_chunk = sum(s.tokens for s in streams) / max(1, chunks)
    if per_chunk != 1.0:
        log.warning("%d tokens came in %d chunks: some chunks carried more than one token (text that "
                    "completes only with the next token), so the served timing is approximate",
                    sum(s.tokens for s in streams), chunks)
    per_stream = [(s.tokens - 1) / (s.chunk_times[-1] - s.chunk_times[0]) for s in streams
                  if len(s.chunk_times) > 1 and s.chunk_times[-1] > s.chunk_times[0]]
    all_started = max(s.chunk_times[0] for s in streams)
    end = max(s.chunk_times[-1] for s in streams)
    after = sum(sum(t > all_started for t in s.chunk_times) for s in streams) * per_chunk
    return ServedDecode(per_stream_tok_s=statistics.median(per_stream) if per_stream else float("nan"),
                        agg_tok_s=after / (end - all_started) if end > all_started else float("nan"),
                        tokens_per_chunk=per_chunk)


def _run_served(cfg: EngineConfig, opts: BenchOptions, b1_prompts: list[list[int]], bc_prompts: list[list[int]],
                figures: list[Figure], warmup_prompt: list[int]) -> str:
    """The decode figures through the served engine; returns the server log's path."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request would bury the figures
    if opts.server_log:
        log_path = Path(opts.server_log)
    else:
        fd, name = tempfile.mkstemp(prefix="lab-bench-serve-", suffix=".log")
        os.close(fd)
        log_path = Path(name)
    by_name = {f.name: f for f in figures}
    b1_fig, bc_fig = by_name["decode batch 1"], by_name[f"decode batch {opts.concurrency} (aggregate)"]
    with served_engine(cfg, log_path, opts.server_timeout_s) as url:
        served_decode(url, [warmup_prompt], 8)  # warm-up, as offline
        b1 = [served_decode(url, b1_prompts, opts.decode_tokens) for _ in range(opts.repeats)]
        bc = [served_decode(url, bc_prompts, opts.decode_tokens) for _ in range(opts.repeats)]
    b1_fig.served_runs = [r.per_stream_tok_s for r in b1]
    b1_fig.served = _median(b1_fig.served_runs)
    bc_fig.served_runs = [r.agg_tok_s for r in bc]
    bc_fig.served = _median(bc_fig.served_runs)
    bc_fig.served_note = f"per stream {_median([r.per_stream_tok_s for r in bc]):,.1f} tok/s"
    for fig, runs in ((b1_fig, b1), (bc_fig, bc)):
        per_chunk = max(r.tokens_per_chunk for r in runs)
        if per_chunk != 1.0:
            fig.served_note = ", ".join(x for x in (fig.served_note, f"{per_chunk:.2f} tokens/chunk") if x)
        log.info("figure: %s served = %.1f tok/s (%.2fx offline)", fig.name, fig.served,
                 fig.served / fig.ours if fig.ours else float("nan"))
    return str(log_path)


# -- the run ---------------------------------------------------------------------------------

def _median(values: list[float]) -> float:
    return statistics.median(values)


def _median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


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
    budget = max(cfg.max_num_batched_tokens, cfg.lone_prefill_tokens)
    for n, sets in prefill_sets.items():
        # Warm-up at this length, as the reference's: the first call of a shape pays for kernel
        # compiles, allocator growth, lazy module loads and cuDNN's plan for each (chunk, prefix)
        # shape, which are not prefill speed. Past WARM_FULL_MAX two chunks' worth: a warm-up as
        # long as the prefill would double minutes of it, beside which those plans are noise.
        engine_prefill_s(llm, prompts(n if n <= WARM_FULL_MAX else min(n, 2 * budget + 1)))
        secs = _median([engine_prefill_s(llm, ids) for ids in sets])
        figures.append(Figure(f"prefill {n} tok", "tok/s", "prefill", {"length": n}, ours=n / secs,
                              floor_fraction=prefill_floor_s(mc, n, ceilings) / secs))

    decode_b1_prompts = [prompts(opts.prompt_tokens)]
    decode_bc_prompts = [prompts(opts.prompt_tokens) for _ in range(opts.concurrency)]
    warmup_prompt = prompts(opts.prompt_tokens)
    engine_decode(llm, [warmup_prompt], 8, None)  # warm-up (graphs, allocator)
    before = spec_totals(llm)
    b1 = [engine_decode(llm, decode_b1_prompts, opts.decode_tokens, ceilings, opts.decode_temperature)
          for _ in range(opts.repeats)]
    b1_spec, before = spec_note(llm, before), spec_totals(llm)
    bc = [engine_decode(llm, decode_bc_prompts, opts.decode_tokens, ceilings, opts.decode_temperature)
          for _ in range(opts.repeats)]
    figures.append(Figure("decode batch 1", "tok/s", "decode", {"batch": 1}, ours=_median([r.tok_s for r in b1]),
                          floor_fraction=_median_or_none([r.floor_fraction for r in b1 if r.floor_fraction]),
                          note=f"step {1e3 * _median([r.step_s for r in b1]):.2f} ms{b1_spec}",
                          runs=[r.tok_s for r in b1]))
    figures.append(Figure(f"decode batch {opts.concurrency} (aggregate)", "tok/s", "decode",
                          {"batch": opts.concurrency}, ours=_median([r.tok_s for r in bc]),
                          floor_fraction=_median_or_none([r.floor_fraction for r in bc if r.floor_fraction]),
                          note=f"step {1e3 * _median([r.step_s for r in bc]):.2f} ms{spec_note(llm, before)}",
                          runs=[r.tok_s for r in bc]))
    for n in opts.throughput:
        run = engine_decode(llm, [prompts(opts.throughput_tokens) for _ in range(n)], opts.throughput_tokens,
                            ceilings)
        figures.append(Figure(f"throughput {n} req: output (prefill incl.)", "tok/s", "throughput",
                              {"requests": n, "phase": "output"}, ours=run.overall_tok_s))
        figures.append(Figure(f"throughput {n} req: decode phase", "tok/s", "throughput",
                              {"requests": n, "phase": "decode"}, ours=run.tok_s,
                              floor_fraction=run.floor_fraction,
                              note=f"step {1e3 * run.step_s:.2f} ms"))

    # The offline engine goes before the served one boots or transformers loads: its KV pool holds
    # most of the device's memory, and on a small CPU its threads would compete with the server's.
    del llm, engine
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        log.info("engine released: %.1f GiB still allocated", torch.cuda.memory_allocated(device) / 2**30)
    server_log = None
    if opts.served:
        server_log = _run_served(cfg, opts, decode_b1_prompts, decode_bc_prompts, figures, warmup_prompt)
    if opts.reference == "hf":
        _run_reference(cfg, opts, mc, device, dtype, prefill_sets, decode_b1_prompts, decode_bc_prompts, figures)

    _print(figures, cfg, device, dtype, ceilings, server_log)
    if opts.json_out:
        with open(opts.json_out, "w") as f:
            json.dump({"config": cfg.to_dict(), "config_hash": cfg.hash, "device": str(device),
                       "dtype": str(dtype), "ceilings": asdict(ceilings), "torch_threads": torch.get_num_threads(),
                       "server_log": server_log, "figures": [asdict(f) for f in figures]}, f, indent=2)
    return 0


def _run_reference(cfg: EngineConfig, opts: BenchOptions, mc: ModelConfig, device: torch.device,
                   dtype: torch.dtype, prefill_sets: dict[int, list[list[int]]], b1_prompts: list[list[int]],
                   bc_prompts: list[list[int]], figures: list[Figure]) -> None:
    from lab.engine.tools.hf_reference import build_hf_model

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
           ceilings: Ceilings, server_log: str | None) -> None:
    from rich.console import Console
    from rich.table import Table

    impls = sorted({k for f in figures for k in f.reference})
    table = Table(title=f"lab engine bench — {cfg.model} on {device} ({str(dtype).removeprefix('torch.')}), "
                        f"config {cfg.hash}")
    served = any(f.served is not None for f in figures)
    table.add_column("figure")
    table.add_column("lab", justify="right")
    if served:
        table.add_column("lab served", justify="right")
        table.add_column("served / lab", justify="right")
    for impl in impls:
        table.add_column(impl, justify="right")
        table.add_column(f"lab / {impl}", justify="right")
    table.add_column("of floor", justify="right")
    table.add_column("note")
    for f in figures:
        row = [f.name, f"{f.ours:,.1f}" if f.ours is not None else "-"]
        if served:
            row.append(f"{f.served:,.1f}" if f.served is not None else "-")
            row.append(f"{f.served / f.ours:.2f}x" if f.served is not None and f.ours else "-")
        for impl in impls:
            ref = f.reference.get(impl)
            row.append(f"{ref:,.1f}" if ref else "-")
            row.append(f"{f.ours / ref:.2f}x" if ref and f.ours else "-")
        row.append(f"{100 * f.floor_fraction:.0f}%" if f.floor_fraction else "-")
        row.append("; ".join(x for x in (f.note, _spread(f.runs), f.served_note and f"served: {f.served_note}",
                                          _spread(f.served_runs) and f"served {_spread(f.served_runs)}") if x))
        table.add_row(*row)
    console = Console(width=160)
    console.print(table)
    console.print(f"ceilings measured on {ceilings.device}: copy {ceilings.copy_bytes_per_s / 1e9:,.1f} GB/s "
                  f"(read+write), matmul {ceilings.matmul_flops_per_s / 1e12:,.2f} TFLOP/s ({ceilings.dtype}); "
                  "'of floor' = floor time / measured time (bytes for decode, FLOPs for prefill)")
    if server_log:
        console.print(f"lab served: the same decode prompts streamed through `lab engine serve` (log {server_log}); "
                      "batch 1 is per-stream tok/s, the batch figure aggregate tok/s, both timed by the client")


def _spread(runs: list[float]) -> str:
    return f"range {min(runs):,.1f}-{max(runs):,.1f}" if len(runs) > 1 else ""
