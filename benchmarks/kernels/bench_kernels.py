"""Micro-benchmark of the Triton attention kernels on a GPU, at Llama-3-8B shapes (32 query / 8
KV heads, head dim 128, 16-token blocks, bf16 queries; bf16 and fp8 caches):

    python benchmarks/kernels/bench_kernels.py                                  # the tables
    python benchmarks/kernels/bench_kernels.py --sweep decode --sweep prefill   # plus tuning sweeps
    python benchmarks/kernels/bench_kernels.py --no-prefill --sweep configs     # decode only, config sweep
    python benchmarks/kernels/bench_kernels.py --no-prefill --batches 1 --contexts 1024 8192 \
        --max-model-len 32768                            # batch 1 with splits sized for 32K

Decode reports achieved bandwidth: bytes of K/V read (every context token of every KV head,
once, at the cache's element size: 2 bytes for bf16, 1 for fp8) plus q read and out written,
over the median time of a step replayed from a CUDA graph (as the engine runs decode); the
ceiling printed beside it is a device-to-device copy measured at start. Each row shows a bf16
cache beside an fp8 one at the same batch and context. The split count is the one decode_attention
chooses for the row's context, or with --max-model-len for contexts up to that length (what a CUDA
graph captured for that length would launch; the engine's graphs are captured per context bound,
see cuda_graphs): at batch 1 and a short context most of those splits are empty. Prefill reports causal attention TFLOP/s
(4 * heads * head_dim per visible query-key pair) beside PyTorch's SDPA on the same shape,
contiguous.
Times are triton.testing.do_bench medians, which flush the L2 between repetitions.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from lab.engine.kernels.decode_attention import decode_attention, num_splits_for
from lab.engine.kernels.prefill_attention import prefill_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DECODE_BATCHES = (1, 64, 256)
DECODE_CONTEXTS = (1024, 4096, 16384, 32768)
PREFILL_LENGTHS = (2048, 8192, 32768)
# Bytes of distinct KV that one timed decode graph reads: several times the H200's 60 MB L2.
ROTATION_BYTES = 512 << 20


def median_ms(fn: Callable[[], object], rep: int = 200) -> float:
    return do_bench(fn, warmup=25, rep=rep, return_mode="median")


def copy_bandwidth() -> float:
    """Bytes/s of a 4 GiB device-to-device copy, read plus written: the practical ceiling."""
    src = torch.empty(1 << 31, dtype=torch.int16, device="cuda").random_()
    dst = torch.empty_like(src)
    seconds = median_ms(lambda: dst.copy_(src)) / 1e3
    return 2 * src.numel() * src.element_size() / seconds


def paged_kv(context_lens: list[int], cache_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Random caches holding exactly these contexts in shuffled blocks, their block tables and
    lengths."""
    blocks = [math.ceil(c / BLOCK_SIZE) for c in context_lens]
    order = torch.randperm(sum(blocks), device="cuda", dtype=torch.int32)
    width = max(blocks)
    tables = torch.zeros(len(blocks), width, dtype=torch.int32, device="cuda")
    used = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = order[used:used + n]
        used += n
    shape = (sum(blocks), BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, dtype=torch.bfloat16, device="cuda").to(cache_dtype)
    v_cache = torch.randn(shape, dtype=torch.bfloat16, device="cuda").to(cache_dtype)
    lens = torch.tensor(context_lens, dtype=torch.int32, device="cuda")
    return k_cache, v_cache, tables, lens


class DecodeCase:
    """One decode step's inputs over `batch` contexts of `context`: enough distinct caches that
    their sum far exceeds the L2 (a graph replays the step over all of them)."""

    def __init__(self, batch: int, context: int, cache_dtype: torch.dtype, max_model_len: int | None = None) -> None:
        self.batch, self.context, self.cache_dtype = batch, context, cache_dtype
        # The longest context the split count is sized for.
        self.split_context = max(context, max_model_len or 0)
        self.kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * torch.empty((), dtype=cache_dtype).element_size()
        self.copies = max(1, math.ceil(ROTATION_BYTES / self.kv_bytes))
        self.caches = [paged_kv([context] * batch, cache_dtype) for _ in range(self.copies)]
        self.q = torch.randn(batch, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        self.out = torch.empty_like(self.q)
        self.io_bytes = 2 * self.q.numel() * self.q.element_size()

    def default_splits(self) -> int:
        """The split count decode_attention chooses for this step (for split_context)."""
        return num_splits_for(self.batch, KV_HEADS, self.split_context, torch.device("cuda"), self.cache_dtype)

    def step(self, i: int, splits: int, config: dict[str, int] | None) -> None:
        k_cache, v_cache, tables, lens = self.caches[i]
        decode_attention(self.q, k_cache, v_cache, tables, lens, HEAD_DIM ** -0.5, self.out, num_splits=splits,
                         config=config)

    def time(self, num_splits: int | None = None, config: dict[str, int] | None = None,
             eager: bool = True, rep: int = 200) -> tuple[float, float, float, int]:
        """(graph us, eager us or NaN, bytes/s from the graph time, splits). The engine replays
        decode steps as CUDA graphs, so the graph time is the kernels' own; eager adds Python
        and launch overhead."""
        splits = num_splits or self.default_splits()
        self.step(0, splits, config)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(self.copies):
                self.step(i, splits, config)
        graph_us = median_ms(graph.replay, rep) * 1e3 / self.copies
        eager_us = median_ms(lambda: self.step(0, splits, config)) * 1e3 if eager else float("nan")
        return graph_us, eager_us, (self.kv_bytes + self.io_bytes) / (graph_us / 1e6), splits


def bench_decode(batch: int, context: int, cache_dtype: torch.dtype, num_splits: int | None = None,
                 config: dict[str, int] | None = None) -> tuple[float, float, float, int]:
    """(graph us, eager us, bytes/s from the graph time, splits) of one decode step over `batch`
    contexts of `context` (see DecodeCase.time)."""
    return DecodeCase(batch, context, cache_dtype).time(num_splits, config)


def bench_prefill(query_len: int, context: int, config: dict[str, int] | None = None) -> tuple[float, float]:
    """(milliseconds, FLOP/s) of one causal prefill of `query_len` tokens ending a `context`."""
    k_cache, v_cache, tables, lens = paged_kv([context], torch.bfloat16)
    q = torch.randn(query_len, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    starts = torch.tensor([0, query_len], dtype=torch.int32, device="cuda")
    ms = median_ms(lambda: prefill_attention(q, k_cache, v_cache, tables, starts, lens, HEAD_DIM ** -0.5, out,
                                             first_seq=0, num_seqs=1, max_query_len=query_len, config=config))
    return ms, causal_flops(query_len, context) / (ms / 1e3)


def causal_flops(query_len: int, context: int) -> float:
    prefix = context - query_len
    pairs = query_len * prefix + query_len * (query_len + 1) / 2
    return 4 * HEADS * HEAD_DIM * pairs


def bench_sdpa(length: int) -> float | None:
    """FLOP/s of PyTorch's SDPA (flash where it applies) on a contiguous causal prefill."""
    q = torch.randn(1, HEADS, length, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(1, KV_HEADS, length, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    try:
        ms = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    except RuntimeError:
        return None
    return causal_flops(length, length) / (ms / 1e3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", action="append", choices=("decode", "configs", "prefill"), default=[],
                        help="also time launch configs (and split counts) of this kernel (configs: the decode "
                             "SWEEP_CONFIGS); repeatable")
    parser.add_argument("--batches", type=int, nargs="+", default=DECODE_BATCHES, help="decode table batches")
    parser.add_argument("--contexts", type=int, nargs="+", default=DECODE_CONTEXTS, help="decode table contexts")
    parser.add_argument("--max-model-len", type=int,
                        help="decode table: size the split count for contexts up to this length, as the engine's "
                             "CUDA graphs do (default: each row's own context)")
    parser.add_argument("--best", help="with --sweep configs: write the fastest config of each dtype here (JSON)")
    parser.add_argument("--no-decode-table", dest="decode_table", action="store_false", help="skip the decode table")
    parser.add_argument("--no-prefill", dest="prefill", action="store_false", help="skip the prefill table")
    args = parser.parse_args()
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    ceiling = copy_bandwidth()
    print(f"{props.name}, {props.multi_processor_count} SMs; device copy {ceiling / 1e12:.2f} TB/s")

    if args.decode_table:
        decode_table(args.batches, args.contexts, ceiling, args.max_model_len)

    if args.prefill:
        print("\nprefill (Llama-3-8B shapes, bf16), causal")
        print(f"{'query':>6} {'context':>7} {'ms':>8} {'TFLOP/s':>8} {'SDPA TFLOP/s':>13}")
        for length in PREFILL_LENGTHS:
            ms, flops = bench_prefill(length, length)
            sdpa = bench_sdpa(length)
            print(f"{length:>6} {length:>7} {ms:>8.2f} {flops / 1e12:>8.1f} "
                  f"{(f'{sdpa / 1e12:.1f}' if sdpa else '-'):>13}")
        ms, flops = bench_prefill(2048, 32768)
        print(f"{2048:>6} {32768:>7} {ms:>8.2f} {flops / 1e12:>8.1f} {'-':>13}")

    if "decode" in args.sweep:
        sweep_decode()
    if "configs" in args.sweep:
        sweep_configs(ceiling, args.best)
    if "prefill" in args.sweep:
        sweep_prefill()


def decode_table(batches: list[int], contexts: list[int], ceiling: float, max_model_len: int | None = None) -> None:
    print("\ndecode (Llama-3-8B shapes): batch x context, bf16 cache | fp8 cache; K/V (at the cache's element "
          "size) + q/out bytes over the graph time")
    print(f"{'batch':>5} {'context':>7} | {'splits':>6} {'graph us':>9} {'eager us':>9} {'TB/s':>6} {'of copy':>7} "
          f"| {'splits':>6} {'graph us':>9} {'eager us':>9} {'TB/s':>6} {'of copy':>7} | {'fp8 speedup':>11}")
    for batch in batches:
        for context in contexts:
            cells, times = [], []
            for cache_dtype in (torch.bfloat16, torch.float8_e4m3fn):
                graph_us, eager_us, bandwidth, splits = DecodeCase(batch, context, cache_dtype, max_model_len).time()
                cells.append(f"{splits:>6} {graph_us:>9.1f} {eager_us:>9.1f} {bandwidth / 1e12:>6.2f} "
                             f"{bandwidth / ceiling:>7.0%}")
                times.append(graph_us)
                torch.cuda.empty_cache()
            print(f"{batch:>5} {context:>7} | {cells[0]} | {cells[1]} | {times[0] / times[1]:>10.2f}x")


def sweep_decode() -> None:
    print("\nsweep: decode launch configs, graph us at batch x context")
    shapes = ((1, 32768), (64, 8192), (256, 4096))
    print(f"{'kv':>5} {'BLOCK_N':>7} {'warps':>5} " + " ".join(f"{f'{b}x{c}':>9}" for b, c in shapes))
    for cache_dtype, label in ((torch.bfloat16, "bf16"), (torch.float8_e4m3fn, "fp8")):
        for block_n in (64, 128, 256):
            for warps in (4, 8):
                config = {"BLOCK_N": block_n, "num_warps": warps, "num_stages": 2}
                times = [bench_decode(b, c, cache_dtype, config=config)[0] for b, c in shapes]
                print(f"{label:>5} {block_n:>7} {warps:>5} " + " ".join(f"{t:>9.1f}" for t in times))

    print("\nsweep: decode split counts, graph us")
    for batch, context in ((1, 1024), (1, 4096), (1, 32768), (4, 16384), (8, 16384), (16, 8192), (32, 4096)):
        row = [f"{s}:{bench_decode(batch, context, torch.bfloat16, num_splits=s)[0]:.1f}"
               for s in (1, 2, 4, 8, 16, 33, 64)]
        chosen = num_splits_for(batch, KV_HEADS, context, torch.device("cuda"), torch.bfloat16)
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
    torch.float8_e4m3fn: {
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
            case = DecodeCase(batch, context, dtype)
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
                label = f"{batch}x{context}/{splits or '*'} {'fp8' if dtype == torch.float8_e4m3fn else 'bf16'}"
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
                        rates = [f"{bench_prefill(q, c, config)[1] / 1e12:>11.1f}" for q, c in shapes]
                    except Exception as error:  # out of shared memory or registers for this config
                        rates = [f"{type(error).__name__:>11}"]
                    print(f"{block_m:>7} {block_n:>7} {warps:>5} {stages:>6} " + " ".join(rates))


if __name__ == "__main__":
    main()
