"""The CUDA-graph decode path's inputs: static buffers, padding rows in the null block, and the
batch-size choice. On the CPU the graphs are replaced by eager calls of the same captured
function, so what is checked is everything around the replay."""

from __future__ import annotations

import torch

from lab.engine.core.cuda_graphs import DecodeGraphs, capture_sizes
from lab.engine.core.sampling_params import SamplingParams
from lab.engine.serve.llm import LLM


class EagerReplay:
    """Stands in for a captured graph: recomputes the captured function on the static buffers,
    and records that it ran."""

    def __init__(self, graphs: DecodeGraphs, bs: int, bound: int, replayed: list[tuple[int, int]]) -> None:
        self.graphs, self.bs, self.bound, self.replayed = graphs, bs, bound, replayed

    def replay(self) -> None:
        self.replayed.append((self.bs, self.bound))
        self.graphs.logits[self.bs, self.bound] = self.graphs._forward(self.bs, self.bound)


def eager_graphs(graphs: DecodeGraphs) -> list[tuple[int, int]]:
    """Install EagerReplay for every (batch size, context bound); returns the replay log."""
    replayed: list[tuple[int, int]] = []
    graphs.graphs = {(bs, b): EagerReplay(graphs, bs, b, replayed) for bs in graphs.sizes for b in graphs.bounds[bs]}
    return replayed


def test_capture_sizes() -> None:
    assert capture_sizes(256)[:6] == [1, 2, 4, 8, 16, 32] and capture_sizes(256)[-1] == 256
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert capture_sizes(3) == [1, 2, 3]


def test_padded_decode_matches_the_plain_path() -> None:
    llm = LLM("smollm2-135m", max_model_len=512)
    engine, runner = llm.engine, llm.engine.runner
    graphs = DecodeGraphs(runner.model, runner.kv_layers, runner.null_block, runner.block_size,
                          runner.max_model_len, max_batch=8)
    eager_graphs(graphs)
    prompts = ["The capital of France is", "def add(a, b):", "1, 2, 3,", "Once upon a time",
               "Water boils at", "The opposite of hot is"]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    plain = [c.token_ids for c in llm.generate(prompts, params)]
    runner.graphs = graphs  # six sequences decode in the size-8 buffers: two padding rows
    padded = [c.token_ids for c in llm.generate(prompts, params)]
    assert padded == plain
    null = runner.kv_cache[:, :, runner.null_block]
    assert null.abs().sum() > 0  # the padding rows wrote there...
    assert engine.blocks.num_used_blocks == 0  # ...and the pool never handed it out
    assert graphs.batch_size_for(6) == 8 and graphs.batch_size_for(9) is None
    assert torch.equal(graphs.context_lens[6:8], torch.ones(2, dtype=torch.int32))


def test_each_step_replays_the_graph_of_the_smallest_context_bound_that_holds_it() -> None:
    llm = LLM("smollm2-135m", max_model_len=512)
    engine, runner = llm.engine, llm.engine.runner
    # As a split-KV backend would give: more bounds at batch 1 than at batch 2.
    graphs = DecodeGraphs(runner.model, runner.kv_layers, runner.null_block, runner.block_size,
                          runner.max_model_len, max_batch=2,
                          context_bounds=lambda bs: [24, 40, 512] if bs == 1 else [512])
    replayed = eager_graphs(graphs)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    prompt = "The capital of France is"
    plain = llm.generate([prompt], params)[0].token_ids
    runner.graphs = graphs
    assert llm.generate([prompt], params)[0].token_ids == plain
    prompt_len = len(llm.encode(prompt))
    # Decode step i (after the prefill) runs with context prompt_len + i + 1.
    expected = [(1, next(b for b in (24, 40, 512) if b >= prompt_len + 1 + i)) for i in range(len(replayed))]
    assert replayed == expected
    assert {b for _, b in replayed} == {24, 40}  # the context grew past the first bound
    assert graphs.bound_for(1, 41) == 512 and graphs.bound_for(2, 3) == 512 and graphs.bound_for(1, 600) == 512
