"""Micro-benchmark of the Triton attention kernels (decode, prefill) at Llama-3-8B shapes on a GPU.

    python benchmarks/kernels/bench_kernels.py                                  # the tables
    python benchmarks/kernels/bench_kernels.py --sweep decode --sweep prefill   # plus tuning sweeps
    python benchmarks/kernels/bench_kernels.py --no-prefill --sweep configs     # decode only, config sweep
    python benchmarks/kernels/bench_kernels.py --no-prefill --batches 1 --contexts 1024 8192 \
        --max-model-len 32768                            # batch 1 with splits sized for 32K
    TRITON_INTERPRET=1 python benchmarks/kernels/bench_kernels.py --device cpu  # tiny shapes: a check that it runs

Shapes: 32 query / 8 KV heads, head dim 128, 16-token blocks, bf16 queries; bf16 and fp8 caches.
Decode reports achieved bandwidth: bytes of K/V read (every context token of every KV head,
once, at the cache's element size: 2 bytes for bf16, 1 for fp8) plus q read and out written,
over the median time of a step replayed from a CUDA graph (as the engine runs decode); the
ceiling printed beside it is a device-to-device copy measured at start. Each row shows a bf16
cache beside an fp8 one at the same batch and context. The split count is the one decode_attention
chooses for the row's context, or with --max-model-len for contexts up to that length (what a CUDA
graph captured for that length would launch; the engine's graphs are captured per context bound,
see cuda_graphs): at batch 1 and a short context most of those splits are empty. Prefill reports
causal attention TFLOP/s (4 * heads * head_dim per visible query-key pair) beside PyTorch's SDPA
on the same shape, contiguous. Every row also gives the kernel's relative error against
PyTorch's attention (lab.engine.model.attention.causal_attention, float32) on the same inputs (for
decode, over the first two sequences; for prefill, over the last 512 query rows). Times are
triton.testing.do_bench medians, which flush the L2 between repetitions.

On the CPU (`--device cpu`, run with TRITON_INTERPRET=1) Triton's interpreter runs the kernels on
CPU tensors at tiny shapes (4 query / 2 KV heads of 16, float32 queries; float32 and fp8 caches):
each time is the median wall time of a few eager calls of the interpreter, which says nothing
about a GPU; the error column is what such a run checks. The sweeps need a GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lab.engine.kernels.decode_attention import decode_attention, num_splits_for
from lab.engine.kernels.prefill_attention import prefill_attention
from lab.engine.model.attention import causal_attention

BLOCK_SIZE = 16
# Bytes of distinct KV that one timed decode graph reads: several times the H200's 60 MB L2.
ROTATION_BYTES = 512 << 20
FP8 = torch.float8_e4m3fn
# Query rows of a prefill whose output is checked against float32 attention.
REFERENCE_ROWS = 512


@dataclass(frozen=True)
class Target:
    """Where the kernels run and at what shapes: Llama-3-8B's heads in bf16 on a GPU, tiny float32
    ones in Triton's interpreter on the CPU."""

    device: torch.device
    dtype: torch.dtype  # the queries' and the plain cache's
    heads: int
    kv_heads: int
    head_dim: int
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    prefills: tuple[tuple[int, int], ...]  # (query length, context)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def median_ms(self, fn: Callable[[], object], rep: int = 200) -> float:
        """Median milliseconds of one call: do_bench on a GPU (L2 flushed between repetitions);
        a few synchronous wall-clock calls after one warm-up in the interpreter."""
        if self.cuda:
            from triton.testing import do_bench

            return do_bench(fn, warmup=25, rep=rep, return_mode="median")
        fn()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3

    def randn(self, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.randn(*shape, dtype=self.dtype, device=self.device).to(dtype or self.dtype)


GPU = Target(torch.device("cuda"), torch.bfloat16, 32, 8, 128, batches=(1, 64, 256),
             contexts=(1024, 4096, 16384, 32768),
             prefills=((2048, 2048), (8192, 8192), (32768, 32768), (2048, 32768)))
CPU = Target(torch.device("cpu"), torch.float32, 4, 2, 16, batches=(1, 3), contexts=(40, 100),
             prefills=((16, 16), (40, 40), (16, 72)))


def dtype_name(dtype: torch.dtype) -> str:
    return "fp8" if dtype == FP8 else str(dtype).removeprefix("torch.").replace("bfloat16", "bf16")


def copy_bandwidth() -> float:
    """Bytes/s of a 4 GiB device-to-device copy, read plus written: the practical ceiling."""
    src = torch.empty(1 << 31, dtype=torch.int16, device="cuda").random_()
    dst = torch.empty_like(src)
    seconds = GPU.median_ms(lambda: dst.copy_(src)) / 1e3
    return 2 * src.numel() * src.element_size() / seconds


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref))


def paged_kv(target: Target, context_lens: list[int], cache_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Random caches holding exactly these contexts in shuffled blocks, their block tables and
    lengths."""
    blocks = [math.ceil(c / BLOCK_SIZE) for c in context_lens]
    order = torch.randperm(sum(blocks), device=target.device, dtype=torch.int32)
    width = max(blocks)
    tables = torch.zeros(len(blocks), width, dtype=torch.int32, device=target.device)
    used = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = order[used:used + n]
        used += n
    shape = (sum(blocks), BLOCK_SIZE, target.kv_heads, target.head_dim)
    k_cache, v_cache = target.randn(*shape, dtype=cache_dtype), target.randn(*shape, dtype=cache_dtype)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=target.device)
    return k_cache, v_cache, tables, lens


def gathered(cache: torch.Tensor, table: torch.Tensor, context: int) -> torch.Tensor:
    """One sequence's [context, KVH, D] out of a paged cache, in float32."""
    blocks = table[:math.ceil(context / BLOCK_SIZE)].long()
    return cache[blocks].float().flatten(0, 1)[:context]


class DecodeCase:
    """One decode step's inputs over `batch` contexts of `context`: on a GPU, enough distinct
    caches that their sum far exceeds the L2 (a graph replays the step over all of them)."""

    def __init__(self, target: Target, batch: int, context: int, cache_dtype: torch.dtype,
                 max_model_len: int | None = None) -> None:
        self.target, self.batch, self.context, self.cache_dtype = target, batch, context, cache_dtype
        # The longest context the split count is sized for.
        self.split_context = max(context, max_model_len or 0)
        item = torch.empty((), dtype=cache_dtype).element_size()
        self.kv_bytes = 2 * batch * context * target.kv_heads * target.head_dim * item
        self.copies = max(1, math.ceil(ROTATION_BYTES / self.kv_bytes)) if target.cuda else 1
        self.caches = [paged_kv(target, [context] * batch, cache_dtype) for _ in range(self.copies)]
        self.q = target.randn(batch, target.heads, target.head_dim)
        self.out = torch.empty_like(self.q)
        self.io_bytes = 2 * self.q.numel() * self.q.element_size()

    def default_splits(self) -> int:
        """The split count decode_attention chooses for this step (for split_context)."""
        return num_splits_for(self.batch, self.target.kv_heads, self.split_context, self.target.device,
                              self.cache_dtype)

    def step(self, i: int, splits: int, config: dict[str, int] | None) -> None:
        k_cache, v_cache, tables, lens = self.caches[i]
        decode_attention(self.q, k_cache, v_cache, tables, lens, self.target.head_dim ** -0.5, self.out,
                         num_splits=splits, config=config)

    def error(self, splits: int, config: dict[str, int] | None = None) -> float:
        """Relative error of the first two sequences' output against PyTorch's attention."""
        self.step(0, splits, config)
        k_cache, v_cache, tables, _ = self.caches[0]
        rows = range(min(2, self.batch))
        ref = torch.cat([causal_attention(self.q[i:i + 1].float(), gathered(k_cache, tables[i], self.context),
                                          gathered(v_cache, tables[i], self.context), self.target.head_dim ** -0.5)
                         for i in rows])
        return relative_error(self.out[:len(rows)], ref)

    def time(self, num_splits: int | None = None, config: dict[str, int] | None = None,
             eager: bool = True, rep: int = 200) -> tuple[float, float, float, int]:
        """(graph us, eager us or NaN, bytes/s from the graph time, splits). The engine replays
        decode steps as CUDA graphs, so the graph time is the kernels' own; eager adds Python
        and launch overhead. The interpreter has no graphs: graph us and bytes/s are NaN."""
        splits = num_splits or self.default_splits()
        eager_us = self.target.median_ms(lambda: self.step(0, splits, config)) * 1e3 if eager else math.nan
        if not self.target.cuda:
            return math.nan, eager_us, math.nan, splits
        self.step(0, splits, config)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(self.copies):
                self.step(i, splits, config)
        graph_us = self.target.median_ms(graph.replay, rep) * 1e3 / self.copies
        return graph_us, eager_us, (self.kv_bytes + self.io_bytes) / (graph_us / 1e6), splits


def bench_decode(batch: int, context: int, cache_dtype: torch.dtype, num_splits: int | None = None,
                 config: dict[str, int] | None = None) -> tuple[float, float, float, int]:
    """(graph us, eager us, bytes/s from the graph time, splits) of one decode step on the GPU over
    `batch` contexts of `context` (see DecodeCase.time)."""
    return DecodeCase(GPU, batch, context, cache_dtype).time(num_splits, config)


def bench_prefill(target: Target, query_len: int, context: int,
                  config: dict[str, int] | None = None) -> tuple[float, float, float]:
    """(milliseconds, FLOP/s, relative error against PyTorch's attention) of one causal prefill of
    `query_len` tokens ending a `context`."""
    k_cache, v_cache, tables, lens = paged_kv(target, [context], target.dtype)
    q = target.randn(query_len, target.heads, target.head_dim)
    out = torch.empty_like(q)
    starts = torch.tensor([0, query_len], dtype=torch.int32, device=target.device)
    scale = target.head_dim ** -0.5

    def run() -> None:
        prefill_attention(q, k_cache, v_cache, tables, starts, lens, scale, out, first_seq=0, num_seqs=1,
                          max_query_len=query_len, config=config)

    ms = target.median_ms(run)
    # The last rows are exactly the bottom-right causal attention of those rows alone, and a
    # handful keep the float32 reference cheap at a 32K context.
    rows = min(query_len, REFERENCE_ROWS)
    ref = causal_attention(q[-rows:].float(), gathered(k_cache, tables[0], context),
                           gathered(v_cache, tables[0], context), scale)
    return ms, causal_flops(target, query_len, context) / (ms / 1e3), relative_error(out[-rows:], ref)


def causal_flops(target: Target, query_len: int, context: int) -> float:
    prefix = context - query_len
    pairs = query_len * prefix + query_len * (query_len + 1) / 2
    return 4 * target.heads * target.head_dim * pairs


def bench_sdpa(length: int) -> float | None:
    """FLOP/s of PyTorch's SDPA on the GPU (flash where it applies) on a contiguous causal prefill."""
    q = GPU.randn(1, GPU.heads, length, GPU.head_dim)
    k = GPU.randn(1, GPU.kv_heads, length, GPU.head_dim)
    v = torch.randn_like(k)
    try:
        ms = GPU.median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    except RuntimeError:
        return None
    return causal_flops(GPU, length, length) / (ms / 1e3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: tiny shapes in Triton's interpreter (run with TRITON_INTERPRET=1)")
    parser.add_argument("--sweep", action="append", choices=("decode", "configs", "prefill"), default=[],
                        help="also time launch configs (and split counts) of this kernel (configs: the decode "
                             "SWEEP_CONFIGS); repeatable; GPU only")
    parser.add_argument("--batches", type=int, nargs="+", help="decode table batches (default: the device's)")
    parser.add_argument("--contexts", type=int, nargs="+", help="decode table contexts (default: the device's)")
    parser.add_argument("--max-model-len", type=int,
                        help="decode table: size the split count for contexts up to this length, as the engine's "
                             "CUDA graphs do (default: each row's own context)")
    parser.add_argument("--splits", type=int, help="decode table: this split count instead of decode_attention's")
    parser.add_argument("--best", help="with --sweep configs: write the fastest config of each dtype here (JSON)")
    parser.add_argument("--no-decode-table", dest="decode_table", action="store_false", help="skip the decode table")
    parser.add_argument("--no-prefill", dest="prefill", action="store_false", help="skip the prefill table")
    args = parser.parse_args()
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if args.device == "cpu" and not interpreted:
        parser.error("--device cpu runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1")
    if args.device == "cuda" and interpreted:
        parser.error("TRITON_INTERPRET=1 runs the kernels on the CPU: unset it, or pass --device cpu")
    if args.device == "cpu" and args.sweep:
        parser.error("--sweep times launch configs on a GPU; the interpreter ignores them")
    target = GPU if args.device == "cuda" else CPU
    torch.manual_seed(0)
    if target.cuda:
        props = torch.cuda.get_device_properties(0)
        ceiling = copy_bandwidth()
        print(f"{props.name}, {props.multi_processor_count} SMs; device copy {ceiling / 1e12:.2f} TB/s")
    else:
        ceiling = math.nan
        print("cpu: Triton's interpreter, tiny shapes; the times say nothing about a GPU, the errors are the check")

    if args.decode_table:
        decode_table(target, args.batches or target.batches, args.contexts or target.contexts, ceiling,
                     args.max_model_len, args.splits)

    if args.prefill:
        print(f"\nprefill ({target.heads} query / {target.kv_heads} KV heads of {target.head_dim}, "
              f"{dtype_name(target.dtype)}), causal; error against PyTorch's attention")
        print(f"{'query':>6} {'context':>7} {'ms':>8} {'TFLOP/s':>8} {'SDPA TFLOP/s':>13} {'rel err':>8}")
        for length, context in target.prefills:
            ms, flops, err = bench_prefill(target, length, context)
            sdpa = bench_sdpa(length) if length == context and target.cuda else None
            tflops = f"{flops / 1e12:.1f}" if target.cuda else "-"
            sdpa_tflops = f"{sdpa / 1e12:.1f}" if sdpa and target.cuda else "-"
            print(f"{length:>6} {context:>7} {ms:>8.2f} {tflops:>8} {sdpa_tflops:>13} {err:>8.1e}", flush=True)

    if "decode" in args.sweep:
        sweep_decode()
    if "configs" in args.sweep:
        sweep_configs(ceiling, args.best)
    if "prefill" in args.sweep:
        sweep_prefill()


def decode_table(target: Target, batches: list[int], contexts: list[int], ceiling: float,
                 max_model_len: int | None = None, splits: int | None = None) -> None:
    cache_dtypes = (target.dtype, FP8)
    print(f"\ndecode ({target.heads} query / {target.kv_heads} KV heads of {target.head_dim}): batch x context, "
          f"{' cache | '.join(dtype_name(d) for d in cache_dtypes)} cache; K/V (at the cache's element size) + "
          "q/out bytes over the graph time; error against PyTorch's attention")
    cell = (f"{'splits':>6} {'graph us':>9} {'eager us':>9} {'TB/s':>6} {'of copy':>7} {'rel err':>8}")
    print(f"{'batch':>5} {'context':>7} | {cell} | {cell} | {'fp8 speedup':>11}")
    for batch in batches:
        for context in contexts:
            cells, times = [], []
            for cache_dtype in cache_dtypes:
                case = DecodeCase(target, batch, context, cache_dtype, max_model_len)
                graph_us, eager_us, bandwidth, used = case.time(splits)
                err = case.error(used)
                cells.append(f"{used:>6} {graph_us:>9.1f} {eager_us:>9.1f} {bandwidth / 1e12:>6.2f} "
                             f"{bandwidth / ceiling:>7.0%} {err:>8.1e}" if target.cuda else
                             f"{used:>6} {'-':>9} {eager_us:>9.1f} {'-':>6} {'-':>7} {err:>8.1e}")
                times.append(graph_us)
                del case
                if target.cuda:
                    torch.cuda.empty_cache()
            speedup = f"{times[0] / times[1]:.2f}x" if target.cuda else "-"
            print(f"{batch:>5} {context:>7} | {cells[0]} | {cells[1]} | {speedup:>11}", flush=True)


def sweep_decode() -> None:
    print("\nsweep: decode launch configs, graph us at batch x context")
    shapes = ((1, 32768), (64, 8192), (256, 4096))
    print(f"{'kv':>5} {'BLOCK_N':>7} {'warps':>5} " + " ".join(f"{f'{b}x{c}':>9}" for b, c in shapes))
    for cache_dtype, label in ((torch.bfloat16, "bf16"), (FP8, "fp8")):
        for block_n in (64, 128, 256):
            for warps in (4, 8):
                config = {"BLOCK_N": block_n, "num_warps": warps, "num_stages": 2}
                times = [bench_decode(b, c, cache_dtype, config=config)[0] for b, c in shapes]
                print(f"{label:>5} {block_n:>7} {warps:>5} " + " ".join(f"{t:>9.1f}" for t in times))

    print("\nsweep: decode split counts, graph us")
    for batch, context in ((1, 1024), (1, 4096), (1, 32768), (4, 16384), (8, 16384), (16, 8192), (32, 4096)):
        row = [f"{s}:{bench_decode(batch, context, torch.bfloat16, num_splits=s)[0]:.1f}"
               for s in (1, 2, 4, 8, 16, 33, 64)]
        chosen = num_splits_for(batch, GPU.kv_heads, context, torch.device("cuda"), torch.bfloat16)
        print(f"{batch}x{context} (chosen {chosen}): " + " ".join(row))


# Decode configurations to sweep, by cache dtype (keys as decode_attention's `config` takes them):
# BLOCK_N-token tiles; PAGES_AHEAD (block-table entries looked up a tile ahead, so Triton
# multi-buffers the K/V copies num_stages - 1 deep); V_FP8_PAIRS (False: fp8 V widened as Triton
# lowers it by itself, the path before pairs); maxnreg (register cap). None: the default.
SWEEP_CONFIGS = {
    torch.bfloat16: {
        "bf16": None,
        "bf16-pa64-s3": {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "PAGES_AHEAD": True},
        "bf16-pa32-s4": {"BLOCK_N": 32, "num_warps": 4, "num_stages": 4, "PAGES_AHEAD": True},
        "bf16-pa32-s3": {"BLOCK_N": 32, "num_warps": 4, "num_stages": 3, "PAGES_AHEAD": True},
    },
    FP8: {
        "fp8": None,
        "fp8-bytes": {"BLOCK_N": 128, "num_warps": 4, "num_stages": 2, "V_FP8_PAIRS": False},
        "fp8-p128-s3": {"BLOCK_N": 128, "num_warps": 4, "num_stages": 3},
        "fp8-pa64-s4": {"BLOCK_N": 64, "num_warps": 4, "num_stages": 4, "PAGES_AHEAD": True},
        "fp8-pa128-s3": {"BLOCK_N": 128, "num_warps": 4, "num_stages": 3, "PAGES_AHEAD": True},
        "fp8-pa32-s5": {"BLOCK_N": 32, "num_warps": 4, "num_stages": 5, "PAGES_AHEAD": True},
        "fp8-pa32-s4-r96": {"BLOCK_N": 32, "num_warps": 4, "num_stages": 4, "PAGES_AHEAD": True, "maxnreg": 96},
        "fp8-pa64-s3-w8": {"BLOCK_N": 64, "num_warps": 8, "num_stages": 3, "PAGES_AHEAD": True},
    },
}
# (batch, context): split counts to time (None: the heuristic's).
SWEEP_SHAPES = {(64, 1024): (1, 2), (64, 4096): (1, 2), (64, 32768): (1, 2), (256, 1024): (1,), (256, 2048): (1,),
                (256, 4096): (1,), (256, 32768): (1,), (1, 4096): (None,), (1, 32768): (None, 64)}


def sweep_configs(ceiling: float, best_path: str | None = None) -> None:
    """Graph-replay time and fraction of the copy bandwidth (K/V at the cache's element size) of
    each SWEEP_CONFIGS entry at each shape and split count, printed as measured (one line per
    shape, split count and cache dtype); each config's output against its dtype's default; the
    fastest config of each dtype (geometric mean over the shapes of its time at the shape's best
    split count), also written as JSON to `best_path`; then the compiled kernels' registers,
    spills and shared memory."""
    print("\nsweep: decode configs, fraction of copy bandwidth / graph us, by batch x context / splits (* = the "
          "heuristic's)")
    for dtype, configs in SWEEP_CONFIGS.items():
        print(f"{'shape':>19} " + " ".join(f"{name:>16}" for name in configs), flush=True)
    errors: dict[str, float] = {}
    log_times: dict[str, float] = {}
    for (batch, context), split_list in SWEEP_SHAPES.items():
        for dtype, configs in SWEEP_CONFIGS.items():
            case = DecodeCase(GPU, batch, context, dtype)
            cells: dict[int | None, list[str]] = {splits: [] for splits in split_list}
            reference = None
            for name, config in configs.items():
                if name not in errors:
                    # Each config against its dtype's default, at 1 and 3 splits, at the first shape.
                    for splits in (1, 3):
                        try:
                            case.step(0, splits, config)
                        except Exception:
                            break
                        if reference is None:
                            reference = case.out.double().clone()
                        errors[name] = max(errors.get(name, 0.0),
                                           float((case.out.double() - reference).norm() / reference.norm()))
                best_us = math.inf
                for splits in split_list:
                    try:
                        graph_us, _, bandwidth, _ = case.time(splits, config, eager=False, rep=60)
                        cells[splits].append(f"{bandwidth / ceiling:.0%}/{graph_us:.0f}")
                        best_us = min(best_us, graph_us)
                    except Exception as error:  # out of resources for this config
                        cells[splits].append(type(error).__name__[:16])
                log_times[name] = log_times.get(name, 0.0) + math.log(best_us)
            del case
            torch.cuda.empty_cache()
            for splits, row in cells.items():
                label = f"{batch}x{context}/{splits or '*'} {dtype_name(dtype)}"
                print(f"{label:>19} " + " ".join(f"{c:>16}" for c in row), flush=True)
    print("largest relative difference from the dtype's default output: "
          + ", ".join(f"{name} {err:.1e}" for name, err in errors.items()))
    best = {}
    for dtype, configs in SWEEP_CONFIGS.items():
        ranked = sorted(configs, key=lambda name: log_times[name])
        base = log_times[ranked[0]]
        print(f"{str(dtype)[6:]}: geometric-mean time over the shapes, relative to the fastest: "
              + ", ".join(f"{name} {math.exp((log_times[name] - base) / len(SWEEP_SHAPES)):.3f}" for name in ranked))
        best[str(dtype)[6:]] = {"name": ranked[0], "config": configs[ranked[0]]}
    if best_path:
        with open(best_path, "w") as f:
            json.dump(best, f)
    try:
        from lab.engine.kernels.decode_attention import _decode_split_kernel
        for cache in _decode_split_kernel.device_caches.values():
            for kernel in cache[0].values():
                constants = {k: v for k, v in kernel.src.constants.items()} if hasattr(kernel, "src") else {}
                print(f"kernel regs {kernel.n_regs} spills {kernel.n_spills} shared {kernel.metadata.shared} "
                      f"warps {kernel.metadata.num_warps} stages {kernel.metadata.num_stages} "
                      f"maxnreg {getattr(kernel.metadata, 'maxnreg', None)} {constants}")
    except Exception as error:  # the cache layout is Triton's internals
        print(f"(no kernel stats: {error!r})")


def sweep_prefill() -> None:
    print("\nsweep: prefill launch configs, TFLOP/s at query/context")
    shapes = ((8192, 8192), (2048, 32768))
    header = " ".join(f"{f'{q}/{c}':>11}" for q, c in shapes)
    print(f"{'BLOCK_M':>7} {'BLOCK_N':>7} {'warps':>5} {'stages':>6} {header}")
    for block_m in (64, 128):
        for block_n in (32, 64, 128):
            for warps in (4, 8):
                for stages in (2, 3):
                    config = {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}
                    try:
                        rates = [f"{bench_prefill(GPU, q, c, config)[1] / 1e12:>11.1f}" for q, c in shapes]
                    except Exception as error:  # out of shared memory or registers for this config
                        rates = [f"{type(error).__name__:>11}"]
                    print(f"{block_m:>7} {block_n:>7} {warps:>5} {stages:>6} " + " ".join(rates))


if __name__ == "__main__":
    main()
