"""Micro-benchmark of the skinny Triton products (lab.engine.kernels.gemv) against cuBLAS
(F.linear) at Llama-3-8B's weight shapes, bf16, on a GPU:

    python benchmarks/kernels/bench_gemv.py            # per-shape table and the 32-layer chain
    python benchmarks/kernels/bench_gemv.py --sweep    # first time launch configs per (shape, M)
    python benchmarks/kernels/bench_gemv.py --sweep-only --shapes qkv,o   # the sweep alone

Bandwidth is weight bytes read over time (x and y are a rounding error at M <= 16), printed
beside its fraction of a 4 GiB device-to-device copy measured at start (bytes read plus written,
bench_kernels.copy_bandwidth). Every figure is a median over replays of one CUDA graph, as the
engine runs decode: per shape, the graph calls the product once for each of enough distinct
weight copies to pass 512 MB (over 8x the H200's 60 MB L2), so no call finds its weights in L2;
the chain graph runs 32 x [qkv, o, gate_up, down] + lm_head over 15 GB of distinct weights.

The chain comes in two forms: "plain" is the products alone, bf16 out, the same on both sides;
"fused" is what the engine would run: the down projection takes the gate_up output through
SiLU-and-multiply (fused into the Triton kernel; silu_and_mul then F.linear for cuBLAS) and the
logits come out in float32 (written directly by Triton; F.linear then .float() for cuBLAS). A
last table adds a decoder step's RMSNorms, residual adds and RoPE + KV writes to the Triton chain,
as separate kernels against folded into the products.

--sweep times every candidate config per (shape, M) (M = 1, 2, 4, 8, 16; split-K counts that
keep the grid under eight programs per SM), prints the best few beside cuBLAS and the table's
own pick, then the winners as a table for gemv._TABLE, and installs them for the tables that
follow in the same run (not with --sweep-only).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from bench_kernels import copy_bandwidth

from lab.engine.kernels import gemv
from lab.engine.kernels.gemv import GemvConfig, RopeKV, skinny_linear, skinny_silu_mul_linear
from lab.engine.model.layers import silu_and_mul

HIDDEN, INTERMEDIATE, VOCAB, LAYERS = 4096, 14336, 128256, 32
SHAPES = {"qkv": (6144, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INTERMEDIATE, HIDDEN),
          "down": (HIDDEN, INTERMEDIATE), "lm_head": (VOCAB, HIDDEN)}
ROWS = (1, 2, 4, 8, 16)
CHAIN_ROWS = (1, 2, 4, 8, 16)
ROTATION_BYTES = 512 << 20
DTYPE = torch.bfloat16

# (block_n, block_k, num_warps, num_stages); FMA by block_m. Every FMA entry keeps the
# accumulator at 64 fp32 registers per thread or fewer.
FMA_CANDIDATES = {
    1: [(8, 512, 4, 1), (8, 512, 4, 3), (16, 512, 4, 1), (16, 512, 4, 3), (16, 512, 4, 4), (32, 256, 4, 3),
        (8, 1024, 4, 3), (16, 1024, 8, 3), (4, 1024, 4, 3), (8, 512, 2, 3), (4, 512, 2, 3), (8, 512, 4, 5),
        (8, 256, 2, 4)],
    2: [(8, 512, 4, 3), (16, 256, 4, 1), (16, 256, 4, 3), (16, 512, 8, 3), (4, 512, 2, 3), (8, 256, 2, 3),
        (8, 512, 4, 4)],
    4: [(8, 256, 4, 3), (16, 128, 4, 1), (16, 128, 4, 3), (16, 256, 8, 3), (4, 256, 2, 3), (4, 512, 4, 3),
        (8, 256, 4, 4)],
}
DOT_CANDIDATES = [(16, 256, 4, 3), (16, 512, 4, 3), (16, 256, 2, 4), (32, 256, 4, 4), (32, 512, 4, 3),
                  (64, 128, 4, 4), (64, 256, 4, 3), (64, 256, 8, 3), (128, 128, 4, 3), (128, 128, 8, 3),
                  (16, 128, 4, 6), (32, 128, 4, 6), (64, 64, 4, 8), (64, 128, 4, 6), (32, 256, 2, 4),
                  (16, 256, 4, 5), (128, 64, 4, 6), (64, 128, 8, 5), (64, 128, 4, 7), (64, 128, 4, 8),
                  (64, 256, 4, 4), (64, 256, 4, 5), (128, 128, 4, 5), (128, 64, 4, 8), (32, 128, 4, 8)]
SPLITS = (1, 2, 4, 8)


def replay_ms(graph: torch.cuda.CUDAGraph, reps: int = 30) -> float:
    """Median milliseconds of one replay, each timed by its own pair of events."""
    for _ in range(3):
        graph.replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def graph_of(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    fn()  # compile, and allocate split-K counters, outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def per_call_us(calls: list[Callable[[], object]], reps: int = 30) -> float:
    graph = graph_of(lambda: [call() for call in calls])
    us = replay_ms(graph, reps) * 1e3 / len(calls)
    del graph
    return us


def rotation(n: int, k: int) -> list[torch.Tensor]:
    copies = max(1, -(-ROTATION_BYTES // (n * k * 2)))
    return [torch.randn(n, k, dtype=DTYPE, device="cuda") * 0.02 for _ in range(copies)]


def inputs(m: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x[m, k] and a gate_up[m, 2k] for the fused down projection."""
    return (torch.randn(m, k, dtype=DTYPE, device="cuda"), torch.randn(m, 2 * k, dtype=DTYPE, device="cuda"))


def time_shape(weights: list[torch.Tensor], m: int, config: GemvConfig | None, silu: bool = False,
               cublas: bool = False) -> float:
    k = weights[0].shape[1]
    x, gate_up = inputs(m, k)
    if cublas:
        if silu:
            calls = [lambda w=w: F.linear(silu_and_mul(gate_up), w) for w in weights]
        else:
            calls = [lambda w=w: F.linear(x, w) for w in weights]
    elif silu:
        calls = [lambda w=w: skinny_silu_mul_linear(gate_up, w, config=config) for w in weights]
    else:
        calls = [lambda w=w: skinny_linear(x, w, config=config) for w in weights]
    return per_call_us(calls)


def fmt_config(c: GemvConfig) -> str:
    kind = "dot" if c.use_dot else "fma"
    return f"{kind} n{c.block_n} k{c.block_k} s{c.split_k} w{c.num_warps} st{c.num_stages}"


def candidates(m: int, n: int, k: int, sms: int) -> list[GemvConfig]:
    out = []
    block_m = 1 << (m - 1).bit_length()
    fma = FMA_CANDIDATES.get(block_m, []) if m <= gemv.MAX_FMA_ROWS else []
    for use_dot, table in ((False, fma), (True, DOT_CANDIDATES)):
        for block_n, block_k, warps, stages in table:
            tiles = -(-n // block_n)
            # FMA configs already fill every SM with 8-row tiles: no split ever won in the H200 sweeps.
            for split in SPLITS if use_dot else (1,):
                if split > 1 and (tiles * split > 8 * sms or -(-k // block_k) < 2 * split):
                    continue
                out.append(GemvConfig(block_n, block_k, split, warps, stages, use_dot))
    return out


def sweep(ceiling: float, budget_s: float, shapes: list[str], install: bool) -> None:
    """Time the candidates, print the best beside cuBLAS and the table's pick, and (`install`)
    put the winners into gemv._TABLE for the tables that follow."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    began = time.time()
    winners: dict[tuple[int, int, bool], dict[int, GemvConfig]] = {}
    print("\nsweep: us per call (fraction of copy bandwidth); cuBLAS, the table's pick, the best five")
    for name in shapes:
        n, k = SHAPES[name]
        weights = rotation(n, k)
        nbytes = n * k * 2
        for m in ROWS:
            base = time_shape(weights, m, None, cublas=True)
            picked = gemv.pick_config(m, n, k, sms)
            print(f"{name:>8} M={m:<2} table {fmt_config(picked)}: {time_shape(weights, m, picked):.1f}", flush=True)
            results = []
            for config in candidates(m, n, k, sms):
                if time.time() - began > budget_s:
                    break
                try:
                    results.append((time_shape(weights, m, config), config))
                except Exception as error:  # out of shared memory or registers
                    print(f"  {name} M={m} {fmt_config(config)}: {type(error).__name__}: {str(error)[:120]}")
            results.sort(key=lambda r: r[0])
            top = "  ".join(f"{fmt_config(c)}: {us:.1f} ({nbytes / us * 1e6 / ceiling:.0%})" for us, c in results[:5])
            print(f"{name:>8} M={m:<2} cuBLAS {base:.1f} ({nbytes / base * 1e6 / ceiling:.0%}) | {top}", flush=True)
            if results:
                winners.setdefault((n, k, False), {})[m] = results[0][1]
            if name == "down":
                # The fused SiLU costs per loaded x element, so re-rank the best plain configs and
                # the table's fused pick.
                base_silu = time_shape(weights, m, None, silu=True, cublas=True)
                contenders = list(dict.fromkeys([c for _, c in results[:6]] +
                                                [gemv.pick_config(m, n, k, sms, silu_mul=True)]))
                fused = sorted((time_shape(weights, m, c, silu=True), c) for c in contenders)
                top = "  ".join(f"{fmt_config(c)}: {us:.1f} ({nbytes / us * 1e6 / ceiling:.0%})" for us, c in fused[:5])
                print(f"{'down+silu':>8} M={m:<2} cuBLAS+silu_and_mul {base_silu:.1f} | {top}", flush=True)
                if fused:
                    winners.setdefault((n, k, True), {})[m] = fused[0][1]
        del weights
        torch.cuda.empty_cache()
    print(f"\nsweep took {time.time() - began:.0f} s; winners (gemv._TABLE):")
    for key, by_m in winners.items():
        print(f"    {key}: {{" + ", ".join(f"{m}: GemvConfig{tuple(c)}" for m, c in by_m.items()) + "},")
    if install:
        gemv._TABLE.update(winners)


def rel_err(w: torch.Tensor, m: int, silu: bool) -> float:
    """||triton - ref|| / ||ref|| of the picked config, ref in fp32 from the same bf16 inputs."""
    k = w.shape[1]
    x, gate_up = inputs(m, k)
    if silu:
        ours, ref = skinny_silu_mul_linear(gate_up, w), F.linear(silu_and_mul(gate_up).float(), w.float())
    else:
        ours, ref = skinny_linear(x, w), F.linear(x.float(), w.float())
    return float(torch.linalg.vector_norm(ours.double() - ref.double()) / torch.linalg.vector_norm(ref.double()))


def shape_table(ceiling: float) -> None:
    print("\nper shape: us per call, GB/s of weights, fraction of copy bandwidth, relative error of the Triton "
          "output against fp32 (Triton config as picked)")
    print(f"{'shape':>9} {'M':>2} {'triton us':>9} {'cuBLAS us':>9} {'triton GB/s':>11} {'cuBLAS GB/s':>11} "
          f"{'triton':>6} {'cuBLAS':>6} {'speedup':>7} {'rel err':>7}  config")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name, (n, k) in SHAPES.items():
        weights = rotation(n, k)
        nbytes = n * k * 2
        for silu in (False, True) if name == "down" else (False,):
            for m in ROWS:
                ours = time_shape(weights, m, None, silu=silu)
                theirs = time_shape(weights, m, None, silu=silu, cublas=True)
                print(f"{name + ('+silu' if silu else ''):>9} {m:>2} {ours:>9.1f} {theirs:>9.1f} "
                      f"{nbytes / ours / 1e3:>11.0f} {nbytes / theirs / 1e3:>11.0f} "
                      f"{nbytes / ours * 1e6 / ceiling:>6.1%} {nbytes / theirs * 1e6 / ceiling:>6.1%} "
                      f"{theirs / ours:>7.2f} {rel_err(weights[0], m, silu):>7.4f}  "
                      f"{fmt_config(gemv.pick_config(m, n, k, sms, silu_mul=silu))}", flush=True)
        del weights
        torch.cuda.empty_cache()


def chain_table(ceiling: float) -> None:
    layers = [{name: torch.randn(*SHAPES[name], dtype=DTYPE, device="cuda") * 0.02
               for name in ("qkv", "o", "gate_up", "down")} for _ in range(LAYERS)]
    lm_head = torch.randn(*SHAPES["lm_head"], dtype=DTYPE, device="cuda") * 0.02
    nbytes = sum(w.numel() * 2 for layer in layers for w in layer.values()) + lm_head.numel() * 2
    print(f"\nchain: {LAYERS} x [qkv, o, gate_up, down] + lm_head in one CUDA graph, {nbytes / 1e9:.2f} GB of "
          "weights; ms per chain, tokens/s at one chain per token, fraction of copy bandwidth")
    print(f"{'M':>2} {'form':>6} {'triton ms':>9} {'cuBLAS ms':>9} {'triton tok/s':>12} {'cuBLAS tok/s':>12} "
          f"{'triton':>6} {'cuBLAS':>6} {'speedup':>7}")
    for m in CHAIN_ROWS:
        x = torch.randn(m, HIDDEN, dtype=DTYPE, device="cuda")
        h = torch.randn(m, INTERMEDIATE, dtype=DTYPE, device="cuda")  # the down projection's input
        gate_up = torch.randn(m, 2 * INTERMEDIATE, dtype=DTYPE, device="cuda")

        def plain(linear: Callable[..., torch.Tensor]) -> None:
            for layer in layers:
                linear(x, layer["qkv"])
                linear(x, layer["o"])
                linear(x, layer["gate_up"])
                linear(h, layer["down"])
            linear(x, lm_head)

        def fused_triton() -> None:
            for layer in layers:
                skinny_linear(x, layer["qkv"])
                skinny_linear(x, layer["o"])
                skinny_linear(x, layer["gate_up"])
                skinny_silu_mul_linear(gate_up, layer["down"])
            skinny_linear(x, lm_head, out_dtype=torch.float32)

        def fused_cublas() -> None:
            for layer in layers:
                F.linear(x, layer["qkv"])
                F.linear(x, layer["o"])
                F.linear(x, layer["gate_up"])
                F.linear(silu_and_mul(gate_up), layer["down"])
            F.linear(x, lm_head).float()

        for form, ours_fn, theirs_fn in (("plain", lambda: plain(skinny_linear), lambda: plain(F.linear)),
                                         ("fused", fused_triton, fused_cublas)):
            ours = per_call_us([ours_fn], reps=20) / 1e3
            theirs = per_call_us([theirs_fn], reps=20) / 1e3
            print(f"{m:>2} {form:>6} {ours:>9.3f} {theirs:>9.3f} {1e3 / ours:>12.0f} {1e3 / theirs:>12.0f} "
                  f"{nbytes / ours * 1e3 / ceiling:>6.1%} {nbytes / theirs * 1e3 / ceiling:>6.1%} "
                  f"{theirs / ours:>7.2f}", flush=True)
    norms_table(layers, lm_head, nbytes, ceiling)


def norms_table(layers: list[dict[str, torch.Tensor]], lm_head: torch.Tensor, nbytes: int, ceiling: float) -> None:
    """The chain as a decoder step runs it, with its 65 RMSNorms, residual adds and 32 RoPE + KV
    writes: as separate kernels (rmsnorm.rms_norm with the residual fused, before each qkv, gate_up
    and the head; rope_and_write_kv after each qkv) or folded into the products (skinny_linear's
    norm_weight, residual and rope)."""
    from lab.engine.kernels.rmsnorm import rms_norm
    from lab.engine.kernels.rope_kv_write import rope_and_write_kv

    norm = torch.rand(HIDDEN, dtype=DTYPE, device="cuda") + 0.5
    heads, kv_heads, head_dim = 32, 8, 128
    kv_cache = torch.zeros(2, 64, 16, kv_heads, head_dim, dtype=DTYPE, device="cuda")
    print("\nnorms: the fused chain plus a step's RMSNorms, residual adds and RoPE + KV writes; ms per chain, "
          "fraction of copy bandwidth")
    print(f"{'M':>2} {'separate ms':>11} {'folded ms':>9} {'separate':>8} {'folded':>6} {'speedup':>7}")
    for m in CHAIN_ROWS:
        embedded = torch.randn(m, HIDDEN, dtype=DTYPE, device="cuda")
        attn = torch.randn(m, HIDDEN, dtype=DTYPE, device="cuda")  # stands in for attention's output
        rows = torch.rand(m, head_dim, device="cuda")
        slots = torch.arange(m, device="cuda") * 7
        rope = RopeKV(rows, kv_cache[0], kv_cache[1], slots)

        def separate() -> None:
            hidden, residual = embedded, None
            for layer in layers:
                h, residual = rms_norm(hidden, norm, 1e-5, residual)
                qkv = skinny_linear(h, layer["qkv"]).view(m, -1, head_dim)
                rope_and_write_kv(*qkv.split([heads, kv_heads, kv_heads], dim=1), *rope)
                hidden = skinny_linear(attn, layer["o"])
                h, residual = rms_norm(hidden, norm, 1e-5, residual)
                hidden = skinny_silu_mul_linear(skinny_linear(h, layer["gate_up"]), layer["down"])
            h, _ = rms_norm(hidden, norm, 1e-5, residual)
            skinny_linear(h, lm_head, out_dtype=torch.float32)

        def folded() -> None:
            hidden = embedded
            for layer in layers:
                skinny_linear(hidden, layer["qkv"], norm_weight=norm, eps=1e-5, rope=rope)
                hidden = skinny_linear(attn, layer["o"], residual=hidden)
                gate_up = skinny_linear(hidden, layer["gate_up"], norm_weight=norm, eps=1e-5)
                hidden = skinny_silu_mul_linear(gate_up, layer["down"], residual=hidden)
            h, _ = rms_norm(hidden, norm, 1e-5)
            skinny_linear(h, lm_head, out_dtype=torch.float32)

        ours = per_call_us([folded], reps=20) / 1e3
        theirs = per_call_us([separate], reps=20) / 1e3
        print(f"{m:>2} {theirs:>11.3f} {ours:>9.3f} {nbytes / theirs * 1e3 / ceiling:>8.1%} "
              f"{nbytes / ours * 1e3 / ceiling:>6.1%} {theirs / ours:>7.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", action="store_true", help="time candidate configs first and use the winners")
    parser.add_argument("--sweep-only", action="store_true", help="the sweep alone, the table left as it is")
    parser.add_argument("--sweep-budget", type=float, default=120.0, help="seconds the sweep may take")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated shapes to sweep")
    args = parser.parse_args()
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    ceiling = copy_bandwidth()
    torch.cuda.empty_cache()
    print(f"{props.name}, {props.multi_processor_count} SMs; device copy {ceiling / 1e12:.2f} TB/s", flush=True)
    if args.sweep or args.sweep_only:
        sweep(ceiling, args.sweep_budget, args.shapes.split(","), install=not args.sweep_only)
    if not args.sweep_only:
        shape_table(ceiling)
        chain_table(ceiling)


if __name__ == "__main__":
    main()
