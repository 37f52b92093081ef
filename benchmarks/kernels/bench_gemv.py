"""Micro-benchmark of the skinny Triton products (lab.engine.kernels.gemv) against cuBLAS at Llama-3-8B shapes.

    python benchmarks/kernels/bench_gemv.py            # per-shape table and the 32-layer chain
    python benchmarks/kernels/bench_gemv.py --sweep    # first time launch configs per (shape, M)
    python benchmarks/kernels/bench_gemv.py --sweep-only --shapes qkv,o   # the sweep alone
    TRITON_INTERPRET=1 python benchmarks/kernels/bench_gemv.py --device cpu   # tiny shapes: a check that it runs

On a GPU the products are bf16 and cuBLAS is F.linear. Bandwidth is weight bytes read over time
(x and y are a rounding error at M <= 16), printed beside its fraction of a 4 GiB device-to-device
copy measured at start (bytes read plus written, bench_kernels.copy_bandwidth). Every figure is a
median over replays of one CUDA graph, as the engine runs decode: per shape, the graph calls the
product once for each of enough distinct weight copies to pass 512 MB (over 8x the H200's 60 MB
L2), so no call finds its weights in L2; the chain graph runs 32 x [qkv, o, gate_up, down] +
lm_head over 15 GB of distinct weights. The per-shape table gives each product's relative error
against F.linear in float32 on the same inputs.

The chain comes in two forms: "plain" is the products alone, bf16 out, the same on both sides;
"fused" is what the engine would run: the down projection takes the gate_up output through
SiLU-and-multiply (fused into the Triton kernel; silu_and_mul then F.linear for cuBLAS) and the
logits come out in float32 (written directly by Triton; F.linear then .float() for cuBLAS). A
last table adds a decoder step's RMSNorms, residual adds and RoPE + KV writes to the Triton chain,
as separate kernels against folded into the products, with the relative difference of the two
forms' logits.

--sweep times every candidate config per (shape, M) (M = 1, 2, 4, 8, 16; split-K counts that
keep the grid under eight programs per SM), prints the best few beside cuBLAS and the table's
own pick, then the winners as a table for gemv._TABLE, and installs them for the tables that
follow in the same run (not with --sweep-only).

On the CPU (`--device cpu`, run with TRITON_INTERPRET=1) Triton's interpreter runs the products
on CPU tensors in float32 at a tiny model's shapes (hidden 32, two layers): each time is the
median wall time of a few eager calls, which says nothing about a GPU, and no rate is printed;
the relative errors are what such a run checks. The sweep needs a GPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from bench_kernels import copy_bandwidth

from lab.engine.kernels import gemv
from lab.engine.kernels.gemv import GemvConfig, RopeKV, skinny_linear, skinny_silu_mul_linear
from lab.engine.model.layers import silu_and_mul

ROTATION_BYTES = 512 << 20


@dataclass(frozen=True)
class Target:
    """Where the products run and at what shapes: Llama-3-8B's in bf16 on a GPU, a tiny model's in
    float32 in Triton's interpreter on the CPU."""

    device: torch.device
    dtype: torch.dtype
    hidden: int
    intermediate: int
    vocab: int
    layers: int
    heads: int
    kv_heads: int
    rows: tuple[int, ...]  # M of the per-shape and chain tables

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def shapes(self) -> dict[str, tuple[int, int]]:
        """(N, K) of each product."""
        return {"qkv": ((self.heads + 2 * self.kv_heads) * self.head_dim, self.hidden),
                "o": (self.hidden, self.hidden), "gate_up": (2 * self.intermediate, self.hidden),
                "down": (self.hidden, self.intermediate), "lm_head": (self.vocab, self.hidden)}

    def randn(self, *shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, dtype=self.dtype, device=self.device) * scale

    def per_call_us(self, calls: list[Callable[[], object]], reps: int = 30) -> float:
        """Microseconds per call of `calls`: the median replay of one CUDA graph of them all on a
        GPU; in the interpreter, the median wall time of a few eager rounds after a warm-up."""
        if self.cuda:
            graph = graph_of(lambda: [call() for call in calls])
            us = replay_ms(graph, reps) * 1e3 / len(calls)
            del graph
            return us
        for call in calls:
            call()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            for call in calls:
                call()
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e6 / len(calls)

    def free(self) -> None:
        if self.cuda:
            torch.cuda.empty_cache()


GPU = Target(torch.device("cuda"), torch.bfloat16, hidden=4096, intermediate=14336, vocab=128256, layers=32,
             heads=32, kv_heads=8, rows=(1, 2, 4, 8, 16))
CPU = Target(torch.device("cpu"), torch.float32, hidden=32, intermediate=48, vocab=80, layers=2, heads=2,
             kv_heads=1, rows=(1, 5))
SWEEP_ROWS = (1, 2, 4, 8, 16)

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


def rotation(target: Target, n: int, k: int) -> list[torch.Tensor]:
    """Distinct copies of an [n, k] weight, enough on a GPU that no call finds its weights in L2."""
    copies = max(1, -(-ROTATION_BYTES // (n * k * 2))) if target.cuda else 1
    return [target.randn(n, k, scale=0.02) for _ in range(copies)]


def inputs(target: Target, m: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x[m, k] and a gate_up[m, 2k] for the fused down projection."""
    return target.randn(m, k), target.randn(m, 2 * k)


def time_shape(target: Target, weights: list[torch.Tensor], m: int, config: GemvConfig | None, silu: bool = False,
               cublas: bool = False) -> float:
    k = weights[0].shape[1]
    x, gate_up = inputs(target, m, k)
    if cublas:
        if silu:
            calls = [lambda w=w: F.linear(silu_and_mul(gate_up), w) for w in weights]
        else:
            calls = [lambda w=w: F.linear(x, w) for w in weights]
    elif silu:
        calls = [lambda w=w: skinny_silu_mul_linear(gate_up, w, config=config) for w in weights]
    else:
        calls = [lambda w=w: skinny_linear(x, w, config=config) for w in weights]
    return target.per_call_us(calls)


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
    """Time the candidates on the GPU, print the best beside cuBLAS and the table's pick, and
    (`install`) put the winners into gemv._TABLE for the tables that follow."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    began = time.time()
    winners: dict[tuple[int, int, bool], dict[int, GemvConfig]] = {}
    print("\nsweep: us per call (fraction of copy bandwidth); cuBLAS, the table's pick, the best five")
    for name in shapes:
        n, k = GPU.shapes[name]
        weights = rotation(GPU, n, k)
        nbytes = n * k * 2
        for m in SWEEP_ROWS:
            base = time_shape(GPU, weights, m, None, cublas=True)
            picked = gemv.pick_config(m, n, k, sms)
            print(f"{name:>8} M={m:<2} table {fmt_config(picked)}: {time_shape(GPU, weights, m, picked):.1f}",
                  flush=True)
            results = []
            for config in candidates(m, n, k, sms):
                if time.time() - began > budget_s:
                    break
                try:
                    results.append((time_shape(GPU, weights, m, config), config))
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
                base_silu = time_shape(GPU, weights, m, None, silu=True, cublas=True)
                contenders = list(dict.fromkeys([c for _, c in results[:6]] +
                                                [gemv.pick_config(m, n, k, sms, silu_mul=True)]))
                fused = sorted((time_shape(GPU, weights, m, c, silu=True), c) for c in contenders)
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


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref))


def rel_err(target: Target, w: torch.Tensor, m: int, silu: bool) -> float:
    """||triton - ref|| / ||ref|| of the picked config, ref in fp32 from the same inputs."""
    x, gate_up = inputs(target, m, w.shape[1])
    if silu:
        return relative_error(skinny_silu_mul_linear(gate_up, w), F.linear(silu_and_mul(gate_up).float(), w.float()))
    return relative_error(skinny_linear(x, w), F.linear(x.float(), w.float()))


def rate(target: Target, value: float, spec: str) -> str:
    """A rate or a fraction, formatted; '-' in the interpreter, whose rates mean nothing."""
    return format(value, spec) if target.cuda else "-"


def shape_table(target: Target, ceiling: float) -> None:
    print("\nper shape: us per call, GB/s of weights, fraction of copy bandwidth, relative error of the Triton "
          "output against fp32 (Triton config as picked)")
    print(f"{'shape':>9} {'M':>2} {'triton us':>9} {'cuBLAS us':>9} {'triton GB/s':>11} {'cuBLAS GB/s':>11} "
          f"{'triton':>6} {'cuBLAS':>6} {'speedup':>7} {'rel err':>7}  config")
    sms = torch.cuda.get_device_properties(0).multi_processor_count if target.cuda else 132
    for name, (n, k) in target.shapes.items():
        weights = rotation(target, n, k)
        nbytes = n * k * weights[0].element_size()
        for silu in (False, True) if name == "down" else (False,):
            for m in target.rows:
                ours = time_shape(target, weights, m, None, silu=silu)
                theirs = time_shape(target, weights, m, None, silu=silu, cublas=True)
                print(f"{name + ('+silu' if silu else ''):>9} {m:>2} {ours:>9.1f} {theirs:>9.1f} "
                      f"{rate(target, nbytes / ours / 1e3, '.0f'):>11} "
                      f"{rate(target, nbytes / theirs / 1e3, '.0f'):>11} "
                      f"{rate(target, nbytes / ours * 1e6 / ceiling, '.1%'):>6} "
                      f"{rate(target, nbytes / theirs * 1e6 / ceiling, '.1%'):>6} "
                      f"{rate(target, theirs / ours, '.2f'):>7} {rel_err(target, weights[0], m, silu):>7.1e}  "
                      f"{fmt_config(gemv.pick_config(m, n, k, sms, silu_mul=silu))}", flush=True)
        del weights
        target.free()


def chain_table(target: Target, ceiling: float) -> None:
    shapes = target.shapes
    layers = [{name: target.randn(*shapes[name], scale=0.02) for name in ("qkv", "o", "gate_up", "down")}
              for _ in range(target.layers)]
    lm_head = target.randn(*shapes["lm_head"], scale=0.02)
    nbytes = sum(w.numel() * w.element_size() for layer in layers for w in layer.values())
    nbytes += lm_head.numel() * lm_head.element_size()
    print(f"\nchain: {target.layers} x [qkv, o, gate_up, down] + lm_head, {nbytes / 1e9:.3g} GB of weights"
          f"{' in one CUDA graph' if target.cuda else ''}; ms per chain, tokens/s at one chain per token, "
          "fraction of copy bandwidth")
    print(f"{'M':>2} {'form':>6} {'triton ms':>9} {'cuBLAS ms':>9} {'triton tok/s':>12} {'cuBLAS tok/s':>12} "
          f"{'triton':>6} {'cuBLAS':>6} {'speedup':>7}")
    for m in target.rows:
        x = target.randn(m, target.hidden)
        h = target.randn(m, target.intermediate)  # the down projection's input
        gate_up = target.randn(m, 2 * target.intermediate)

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
            ours = target.per_call_us([ours_fn], reps=20) / 1e3
            theirs = target.per_call_us([theirs_fn], reps=20) / 1e3
            print(f"{m:>2} {form:>6} {ours:>9.3f} {theirs:>9.3f} {rate(target, 1e3 / ours, '.0f'):>12} "
                  f"{rate(target, 1e3 / theirs, '.0f'):>12} {rate(target, nbytes / ours * 1e3 / ceiling, '.1%'):>6} "
                  f"{rate(target, nbytes / theirs * 1e3 / ceiling, '.1%'):>6} "
                  f"{rate(target, theirs / ours, '.2f'):>7}", flush=True)
    norms_table(target, layers, lm_head, nbytes, ceiling)


def norms_table(target: Target, layers: list[dict[str, torch.Tensor]], lm_head: torch.Tensor, nbytes: int,
                ceiling: float) -> None:
    """The chain as a decoder step runs it, with its RMSNorms, residual adds and RoPE + KV writes:
    as separate kernels (rmsnorm.rms_norm with the residual fused, before each qkv, gate_up and the
    head; rope_and_write_kv after each qkv) or folded into the products (skinny_linear's
    norm_weight, residual and rope); and how far apart the two forms' logits are."""
    from lab.engine.kernels.rmsnorm import rms_norm
    from lab.engine.kernels.rope_kv_write import rope_and_write_kv

    norm = torch.rand(target.hidden, dtype=target.dtype, device=target.device) + 0.5
    heads, kv_heads, head_dim = target.heads, target.kv_heads, target.head_dim
    kv_cache = torch.zeros(2, 64, 16, kv_heads, head_dim, dtype=target.dtype, device=target.device)
    print(f"\nnorms: the fused chain plus a step's {2 * target.layers + 1} RMSNorms, residual adds and RoPE + KV "
          "writes; ms per chain, fraction of copy bandwidth, relative difference of the logits")
    print(f"{'M':>2} {'separate ms':>11} {'folded ms':>9} {'separate':>8} {'folded':>6} {'speedup':>7} {'logits':>7}")
    for m in target.rows:
        embedded = target.randn(m, target.hidden)
        attn = target.randn(m, target.hidden)  # stands in for attention's output
        rows = torch.rand(m, head_dim, device=target.device)
        slots = torch.arange(m, device=target.device) * 7
        rope = RopeKV(rows, kv_cache[0], kv_cache[1], slots)

        def separate() -> torch.Tensor:
            hidden, residual = embedded, None
            for layer in layers:
                h, residual = rms_norm(hidden, norm, 1e-5, residual)
                qkv = skinny_linear(h, layer["qkv"]).view(m, -1, head_dim)
                rope_and_write_kv(*qkv.split([heads, kv_heads, kv_heads], dim=1), *rope)
                hidden = skinny_linear(attn, layer["o"])
                h, residual = rms_norm(hidden, norm, 1e-5, residual)
                hidden = skinny_silu_mul_linear(skinny_linear(h, layer["gate_up"]), layer["down"])
            h, _ = rms_norm(hidden, norm, 1e-5, residual)
            return skinny_linear(h, lm_head, out_dtype=torch.float32)

        def folded() -> torch.Tensor:
            hidden = embedded
            for layer in layers:
                skinny_linear(hidden, layer["qkv"], norm_weight=norm, eps=1e-5, rope=rope)
                hidden = skinny_linear(attn, layer["o"], residual=hidden)
                gate_up = skinny_linear(hidden, layer["gate_up"], norm_weight=norm, eps=1e-5)
                hidden = skinny_silu_mul_linear(gate_up, layer["down"], residual=hidden)
            h, _ = rms_norm(hidden, norm, 1e-5)
            return skinny_linear(h, lm_head, out_dtype=torch.float32)

        ours = target.per_call_us([folded], reps=20) / 1e3
        theirs = target.per_call_us([separate], reps=20) / 1e3
        apart = relative_error(folded(), separate())
        print(f"{m:>2} {theirs:>11.3f} {ours:>9.3f} {rate(target, nbytes / theirs * 1e3 / ceiling, '.1%'):>8} "
              f"{rate(target, nbytes / ours * 1e3 / ceiling, '.1%'):>6} {rate(target, theirs / ours, '.2f'):>7} "
              f"{apart:>7.1e}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: tiny shapes in Triton's interpreter (run with TRITON_INTERPRET=1)")
    parser.add_argument("--sweep", action="store_true", help="time candidate configs first and use the winners")
    parser.add_argument("--sweep-only", action="store_true", help="the sweep alone, the table left as it is")
    parser.add_argument("--sweep-budget", type=float, default=120.0, help="seconds the sweep may take")
    parser.add_argument("--shapes", default=",".join(GPU.shapes), help="comma-separated shapes to sweep")
    args = parser.parse_args()
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if args.device == "cpu" and not interpreted:
        parser.error("--device cpu runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1")
    if args.device == "cuda" and interpreted:
        parser.error("TRITON_INTERPRET=1 runs the kernels on the CPU: unset it, or pass --device cpu")
    if args.device == "cpu" and (args.sweep or args.sweep_only):
        parser.error("--sweep times launch configs on a GPU; the interpreter ignores them")
    target = GPU if args.device == "cuda" else CPU
    torch.manual_seed(0)
    if target.cuda:
        props = torch.cuda.get_device_properties(0)
        ceiling = copy_bandwidth()
        torch.cuda.empty_cache()
        print(f"{props.name}, {props.multi_processor_count} SMs; device copy {ceiling / 1e12:.2f} TB/s", flush=True)
    else:
        ceiling = float("nan")
        print("cpu: Triton's interpreter, tiny shapes; the times say nothing about a GPU, the errors are the check")
    if args.sweep or args.sweep_only:
        sweep(ceiling, args.sweep_budget, args.shapes.split(","), install=not args.sweep_only)
    if not args.sweep_only:
        shape_table(target, ceiling)
        chain_table(target, ceiling)


if __name__ == "__main__":
    main()
