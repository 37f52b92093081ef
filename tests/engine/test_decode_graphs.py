"""The CUDA-graph decode path's inputs: static buffers, padding rows in the null block, and the
batch-size choice. On the CPU the graphs are replaced by eager calls of the same captured
function, so what is checked is everything around the replay."""

from __future__ import annotations

import torch

from lab.engine.cuda_graphs import DecodeGraphs, capture_sizes
from lab.engine.llm import LLM
from lab.engine.sampling_params import SamplingParams


class EagerReplay:
    """Stands in for a captured graph: recomputes the captured function on the static buffers."""

    def __init__(self, graphs: DecodeGraphs, bs: int) -> None:
        self.graphs, self.bs = graphs, bs

    def replay(self) -> None:
        self.graphs.logits[self.bs] = self.graphs._forward(self.bs)


def test_capture_sizes() -> None:
    assert capture_sizes(256)[:6] == [1, 2, 4, 8, 16, 32] and capture_sizes(256)[-1] == 256
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert capture_sizes(3) == [1, 2, 3]


def test_padded_decode_matches_the_plain_path() -> None:
    llm = LLM("smollm2-135m", max_model_len=512)
    engine, runner = llm.engine, llm.engine.runner
    graphs = DecodeGraphs(runner.model, runner.kv_layers, runner.null_block, runner.block_size,
                          runner.max_model_len, max_batch=8)
    graphs.graphs = {bs: EagerReplay(graphs, bs) for bs in graphs.sizes}
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
