"""The engine on a CUDA device: Triton kernels, CUDA-graph decode and the fp8 KV cache, each
against the PyTorch path or transformers on the same (dummy) weights. Skipped without a GPU."""

from __future__ import annotations

import gc

import pytest
import torch

from lab.engine.core.sampling_params import SamplingParams
from lab.engine.serve.engine_stats import memory_report
from lab.engine.serve.llm import LLM
from lab.engine.spec.draft_costs import DraftCosts, StepTimes
from lab.engine.tools.hf_reference import build_hf_model
from lab.engine.weights.loader import load_model

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
MODEL = "dummy:smollm2-135m"
KV = 1 << 30  # a fixed pool, so no test depends on an earlier test's engine having been freed


@pytest.fixture(autouse=True)
def _free_the_device():
    yield
    gc.collect()
    torch.cuda.empty_cache()


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 300, (n,), generator=gen).tolist()
    return [torch.randint(3, 250, (length,), generator=gen).tolist() for length in lengths]


def top_logprobs(llm: LLM, ps: list[list[int]],
                 tokens: int) -> tuple[list[list[dict[int, float]]], list[list[int]]]:
    outs = llm.generate(ps, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, logprobs=5))
    return [[dict(lp.top) for lp in c.logprobs] for c in outs], [c.token_ids for c in outs]


def max_diff(a: dict[int, float], b: dict[int, float]) -> float:
    shared = set(a) & set(b)
    assert len(shared) >= 4, (a, b)
    return max(abs(a[t] - b[t]) for t in shared)


def assert_close_until_divergence(want: tuple, got: tuple, tol: float = 0.05) -> None:
    """Top-5 logprobs agree step by step up to the first token that differs: bf16 near-ties may
    legitimately pick different tokens, after which the contexts differ."""
    for a_seq, b_seq, a_ids, b_ids in zip(want[0], got[0], want[1], got[1]):
        for i, (a, b) in enumerate(zip(a_seq, b_seq)):
            assert max_diff(a, b) < tol, (i, a, b)
            if a_ids[i] != b_ids[i]:
                break


def test_prompt_logits_match_transformers_fp32() -> None:
    llm = LLM(MODEL, kv_cache_memory_bytes=KV, dtype="float32", device="cuda", cuda_graphs=False)
    mc = llm.engine.model_config
    hf = build_hf_model(mc, load_model(MODEL, torch.float32, "cuda").weights, torch.float32,
                        torch.device("cuda"), "sdpa")
    for ids in prompts(4):
        ours = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))[0]
        with torch.inference_mode():
            ref = torch.log_softmax(hf(torch.tensor([ids], device="cuda")).logits[0].float(), -1)
        got = torch.tensor([lp.logprob for lp in ours.prompt_logprobs[1:]])
        want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].cpu()
        assert (got - want).abs().max() < 1e-3


def test_cuda_graph_decode_matches_eager() -> None:
    ps = prompts(6, seed=1)  # six rows replay in the size-8 graph: two padding rows
    eager = LLM(MODEL, kv_cache_memory_bytes=KV, dtype="bfloat16", device="cuda", cuda_graphs=False)
    want_lp, want_ids = top_logprobs(eager, ps, 8)
    del eager
    graphed = LLM(MODEL, kv_cache_memory_bytes=KV, dtype="bfloat16", device="cuda", cuda_graphs=True,
                  cuda_graph_max_batch_size=16)
    assert graphed.engine.runner.graphs is not None
    assert_close_until_divergence((want_lp, want_ids), top_logprobs(graphed, ps, 8))


def test_turning_cuda_graphs_off_changes_no_greedy_token_at_batch_1() -> None:
    """The eager step sizes its decode split by the graphs' context bound: the same sums in the
    same order, so a ladder arm that turns graphs off is held to exact agreement."""
    ps = prompts(4, seed=3)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    eager = LLM(MODEL, kv_cache_memory_bytes=KV, dtype="bfloat16", device="cuda", cuda_graphs=False)
    want = [eager.generate([p], params)[0].token_ids for p in ps]
    del eager
    graphed = LLM(MODEL, kv_cache_memory_bytes=KV, dtype="bfloat16", device="cuda", cuda_graphs=True)
    assert [graphed.generate([p], params)[0].token_ids for p in ps] == want


def test_triton_backend_matches_torch_backend_bf16() -> None:
    ps = prompts(5, seed=2)
    torch_path = LLM(MODEL, kv_cache_memory_bytes=KV, dtype="bfloat16", device="cuda", attention_backend="torch",
                     cuda_graphs=False)
    want_lp, want_ids = top_logprobs(torch_path, ps, 6)
    del torch_path
    triton_path = LLM(MODEL, kv_cache_memory_bytes=KV, dtype="bfloat16", device="cuda", attention_backend="triton",
                      cuda_graphs=True)
    assert_close_until_divergence((want_lp, want_ids), top_logprobs(triton_path, ps, 6))


@pytest.mark.parametrize("kernel", ["auto", "cudnn", "flash"])
def test_each_prefill_attention_kernel_matches_the_torch_backend(kernel: str) -> None:
    """Chunks of 128 tokens over their cached prefixes, and whole short prompts, on each of PyTorch's
    fused kernels (auto mixes them: cuDNN for the budget-sized chunks, flash for the rest)."""
    ps = prompts(5, seed=5)
    torch_path = LLM(MODEL, kv_cache_memory_bytes=KV, dtype="bfloat16", device="cuda", attention_backend="torch",
                     cuda_graphs=False, max_num_batched_tokens=128)
    want = top_logprobs(torch_path, ps, 4)
    del torch_path
    triton_path = LLM(MODEL, kv_cache_memory_bytes=KV, dtype="bfloat16", device="cuda", attention_backend="triton",
                      max_num_batched_tokens=128, prefill_attention=kernel)
    assert triton_path.engine.runner.attention.prefill_kernels.mode == kernel
    assert_close_until_divergence(want, top_logprobs(triton_path, ps, 4))


def test_fp8_kv_cache_stays_close() -> None:
    ps = prompts(4, seed=3)
    bf16 = LLM(MODEL, kv_cache_memory_bytes=KV, dtype="bfloat16", device="cuda")
    want_lp, _ = top_logprobs(bf16, ps, 4)
    del bf16
    fp8 = LLM(MODEL, kv_cache_memory_bytes=KV, dtype="bfloat16", device="cuda", kv_cache_dtype="fp8")
    assert fp8.engine.runner.kv_dtype == torch.float8_e4m3fn
    got_lp, _ = top_logprobs(fp8, ps, 4)
    for a_seq, b_seq in zip(want_lp, got_lp):
        assert max_diff(a_seq[0], b_seq[0]) < 0.1


def test_long_prefill_through_chunks_on_paged_kv() -> None:
    """A prompt longer than the step budget is prefilled in chunks over its own cached prefix."""
    # 40K tokens of Llama-3-8B KV in bf16 is 5.2 GB: the pool must hold one full-length request.
    llm = LLM("dummy:llama3-8b", kv_cache_memory_bytes=8 << 30, dtype="bfloat16", device="cuda", max_model_len=40000,
              max_num_batched_tokens=8192, max_num_seqs=8, cuda_graph_max_batch_size=8)
    ids = torch.randint(3, 250, (20000,), generator=torch.Generator().manual_seed(4)).tolist()
    out = llm.generate([ids], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 2 and llm.engine.counters.steps >= 4


def test_overlapped_decode_matches_synchronous() -> None:
    """Overlapped decode (the CUDA default) feeds each step's tokens to the next on the device:
    greedy tokens must equal the synchronous engine's, with requests ending at different steps
    so the batch shrinks across captured graph sizes. float32, so no bf16 near-tie can differ."""
    ps = prompts(24, seed=5)
    params = [SamplingParams(max_tokens=6 + (i % 5) * 5, temperature=0, ignore_eos=True) for i in range(24)]
    sync = LLM(MODEL, kv_cache_memory_bytes=KV, dtype="float32", device="cuda", overlap_decode="off")
    want = [c.token_ids for c in sync.generate(ps, params)]
    del sync
    overlapped = LLM(MODEL, kv_cache_memory_bytes=KV, dtype="float32", device="cuda")
    assert overlapped.engine.overlap and overlapped.engine.runner.graphs is not None
    assert [c.token_ids for c in overlapped.generate(ps, params)] == want
    assert overlapped.engine.counters.overlapped_steps >= 20


def test_prompt_lookup_with_graphs_and_overlap_matches_plain_decoding() -> None:
    """Prompt lookup's load-time probe runs overlapped and graph-replayed steps on the device, a
    verify step as one decode row per token; greedy tokens then equal plain decoding's, whether a
    step drafts (random weights loop greedily) or overlaps, with requests ending at different
    steps."""
    ps = prompts(12, seed=6)
    params = [SamplingParams(max_tokens=16 + (i % 4) * 8, temperature=0, ignore_eos=True) for i in range(12)]
    plain = LLM(MODEL, kv_cache_memory_bytes=KV, dtype="float32", device="cuda")
    want = [c.token_ids for c in plain.generate(ps, params)]
    del plain
    spec = LLM(MODEL, kv_cache_memory_bytes=KV, dtype="float32", device="cuda", prompt_lookup=True)
    assert spec.engine.counters.steps == 0 and spec.engine.blocks.num_used_blocks == 0
    measured = spec.engine.drafter.costs.measured
    assert [t.batch for t in measured][0] == 1 and all(t.overlapped > 0 and t.plain > 0 for t in measured)
    assert [c.token_ids for c in spec.generate(ps, params)] == want
    assert spec.engine.counters.overlapped_steps > 0
    # On a fast device a model this small may find no draft worth its verify step; priced free,
    # every sequence with a match drafts, and its verify steps are decode rows replayed in a
    # graph, not eager steps: greedy tokens still equal plain decoding's.
    t = measured[0]
    free = StepTimes(1, t.plain, t.plain, {d: t.plain for d in t.verify})
    spec.engine.drafter.costs = DraftCosts([free])
    assert [c.token_ids for c in spec.generate(ps, params)] == want
    counters = spec.engine.drafter.counters
    assert counters.drafts > 0 and counters.graph_verify_steps > 0


def test_a_repeated_workload_sends_the_allocator_to_the_driver_no_more() -> None:
    """What `/v1/stats` `allocator` reports: once a workload has run, running it again is served from
    the caching allocator's pool, so no request of a warm engine pays for a cudaMalloc."""
    llm = LLM(MODEL, kv_cache_memory_bytes=KV, dtype="bfloat16", device="cuda")
    work, params = prompts(8, seed=3), SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    llm.generate(work, params)
    before = memory_report(torch.device("cuda"))["allocator"]
    assert before["device_allocs"] > 0
    llm.generate(work, params)
    after = memory_report(torch.device("cuda"))["allocator"]
    assert after["device_allocs"] == before["device_allocs"]
    assert after["alloc_retries"] == 0


def test_programmatic_dependent_launch_changes_no_token_or_logprob() -> None:
    """PDL only moves when a kernel's programs are placed: each waits for the kernel before it
    before touching memory, so the same sums run in the same order. With CUDA graphs and the
    overlapped loop, alone and six at once, tokens and logprobs equal those without it."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs compute capability 9.0 or newer")
    ps = prompts(6, seed=7)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=5)

    def answers(llm: LLM) -> list:
        runs = [llm.generate([ps[0]], params), llm.generate(ps, params)]
        return [(c.token_ids, [dict(lp.top) for lp in c.logprobs]) for run in runs for c in run]

    plain = LLM(MODEL, kv_cache_memory_bytes=KV, dtype="bfloat16", device="cuda")
    want = answers(plain)
    del plain
    launched = LLM(MODEL, kv_cache_memory_bytes=KV, dtype="bfloat16", device="cuda", pdl=True)
    assert launched.engine.runner.graphs is not None and launched.engine.runner.attention.pdl
    assert answers(launched) == want
