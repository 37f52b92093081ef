"""Every cuDNN plan for the long-prefill attention shapes, timed, beside the one PyTorch runs.

PyTorch's cuDNN attention builds the first plan its heuristics rank. The cuDNN frontend
(`nvidia-cudnn-frontend`, import name `cudnn`) can build every plan the library offers for the
same graph; this measures whether any of them is faster on this GPU. Shapes are Llama-3-8B's
(32 query heads, 8 KV heads, head dim 128, bf16) in the engine's layouts:

- causal: a chunk of L tokens attending to itself (q [L, 32, 128], k/v [L, 8, 128]);
- prefix: the chunk's query heads folded per KV head (q [8, 4L, 128]) over a P-token prefix;
- bottom-right: the chunk over prefix and itself in one call, causal aligned bottom-right (what
  the engine does in two calls and a merge); frontend only;
- causal L in pieces: the same causal attention as n pieces of L/n queries, each the engine's
  chunk_attention (its prefix folded, its own part causal, the two merged), to see whether moving
  work from the causal kernel to the folded one pays.

    python benchmarks/attention_plans.py [--length 32768] [--prefixes 32768 98304]
"""

from __future__ import annotations

import argparse

import torch
from attention_prefill import median_ms

from lab.engine.model.chunk_attention import attention_lse, chunk_attention

HEADS, KV_HEADS, DIM = 32, 8, 128
REPEATS = 5  # timed runs after one untimed, median


def flops(lq: int, lk: int, heads: int, causal: bool, bottom_right: bool = False) -> float:
    pairs = lq * lk
    if causal and not bottom_right:
        pairs = lq * (lq + 1) / 2
    elif causal:
        pairs = lq * (lk - lq) + lq * (lq + 1) / 2
    return 4 * pairs * heads * DIM


def frontend_plans(cudnn, handle, q, k, v, mask: str) -> list[tuple[str, float]]:
    """(plan name, ms) of every plan cuDNN builds for this SDPA; stats (log-sum-exp) generated
    unless the call is the single bottom-right one (which needs no merge)."""
    graph = cudnn.pygraph(io_data_type=cudnn.data_type.BFLOAT16, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=handle)
    tq, tk, tv = graph.tensor_like(q), graph.tensor_like(k), graph.tensor_like(v)
    stats_wanted = mask != "bottom_right"
    kwargs = {"use_causal_mask": mask == "causal", "use_causal_mask_bottom_right": mask == "bottom_right"}
    o, stats = graph.sdpa(name="sdpa", q=tq, k=tk, v=tv, attn_scale=DIM ** -0.5, generate_stats=stats_wanted,
                          **kwargs)
    out = torch.empty_like(q)
    o.set_output(True).set_dim(list(q.shape)).set_stride(list(q.stride()))
    pack = {tq: q, tk: k, tv: v, o: out}
    if stats_wanted:
        lse = torch.empty(q.shape[0], q.shape[1], q.shape[2], 1, dtype=torch.float32, device=q.device)
        stats.set_output(True).set_data_type(cudnn.data_type.FLOAT)
        pack[stats] = lse
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.B, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans(cudnn.build_plan_policy.ALL)
    results = []
    for i in range(graph.get_execution_plan_count()):
        name = graph.get_plan_name_at_index(i)
        try:
            workspace = torch.empty(max(1, graph.get_workspace_size_plan_at_index(i)), dtype=torch.uint8,
                                    device=q.device)
            ms = median_ms(lambda: graph.execute_plan_at_index(pack, workspace, i, handle=handle), REPEATS)
        except Exception as error:  # a plan that does not run is a result too
            results.append((f"{name} failed: {str(error).splitlines()[0][:100]}", float("nan")))
            continue
        results.append((name, ms))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=32768)
    parser.add_argument("--prefixes", type=int, nargs="+", default=[32768, 98304])
    args = parser.parse_args()
    torch.manual_seed(0)
    L = args.length
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name()}")
    try:
        import cudnn
        handle = cudnn.create_handle()
        cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
        print(f"cudnn frontend {cudnn.__version__}, backend {cudnn.backend_version()}")
    except Exception as error:
        cudnn = None
        print(f"no cuDNN frontend: {type(error).__name__}: {error}")

    def ctx(n: int) -> torch.Tensor:
        return torch.randn(n, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16)

    chunk_q = torch.randn(L, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    cases = []
    k, v = ctx(L), ctx(L)
    view = lambda x: x.transpose(0, 1).unsqueeze(0)  # noqa: E731
    cases.append((f"causal {L}", view(chunk_q), view(k), view(v), "causal", flops(L, L, HEADS, True)))
    folded = chunk_q.view(L, KV_HEADS, HEADS // KV_HEADS, DIM).permute(1, 2, 0, 3).reshape(1, KV_HEADS, -1, DIM)
    for prefix in args.prefixes:
        pk, pv = ctx(prefix), ctx(prefix)
        cases.append((f"prefix {prefix} (folded)", folded, view(pk), view(pv), "none", flops(L, prefix, HEADS, False)))
    for prefix in args.prefixes:
        fk, fv = ctx(prefix + L), ctx(prefix + L)
        cases.append((f"bottom-right {prefix}+{L}", view(chunk_q), view(fk), view(fv), "bottom_right",
                      flops(L, prefix + L, HEADS, True, bottom_right=True)))
    causal_work = flops(L, L, HEADS, True)
    print(f"\ncausal {L} in pieces (cuDNN, the engine's chunk_attention): {causal_work / 1e12:.2f} TFLOP", flush=True)
    out = torch.empty_like(chunk_q)
    for pieces in (1, 2, 4, 8):
        size = L // pieces

        def run() -> None:
            for i in range(pieces):
                end = (i + 1) * size
                chunk_attention(chunk_q[i * size:end], k[:end], v[:end], DIM ** -0.5, out=out[i * size:end])
        ms = median_ms(run, REPEATS)
        print(f"  {pieces} pieces of {size:<44} {ms:9.3f} ms {causal_work / ms / 1e9:7.1f} TFLOP/s", flush=True)
    for name, q, k, v, mask, work in cases:
        print(f"\n{name}: {work / 1e12:.2f} TFLOP", flush=True)
        if mask != "bottom_right":
            for backend in ("cudnn", "flash"):
                label = f"torch {backend}"
                try:
                    ms = median_ms(lambda: attention_lse(q, k, v, causal=mask == "causal", scale=DIM ** -0.5,
                                                         backend=backend), REPEATS)
                    print(f"  {label:<60} {ms:9.3f} ms {work / ms / 1e9:7.1f} TFLOP/s", flush=True)
                except Exception as error:
                    print(f"  {label:<60} failed: {str(error).splitlines()[0][:100]}", flush=True)
        if cudnn is None:
            continue
        try:
            for plan, ms in frontend_plans(cudnn, handle, q, k, v, mask):
                print(f"  {plan[:60]:<60} {ms:9.3f} ms {work / ms / 1e9:7.1f} TFLOP/s", flush=True)
        except Exception as error:
            print(f"  frontend failed: {type(error).__name__}: {str(error).splitlines()[0][:160]}", flush=True)


if __name__ == "__main__":
    main()
