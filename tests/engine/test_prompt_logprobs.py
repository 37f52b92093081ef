"""Prompt logprobs gathered chunk by chunk, with a preemption that prefills the prompt again, equal
log_softmax over the whole prompt's logits at once."""

from __future__ import annotations

import pytest
import torch

from lab.engine.core import prompt_logprobs
from lab.engine.core.sampling_params import SamplingParams
from lab.engine.core.sequence import Sequence


@pytest.mark.parametrize("chunks", [[7], [3, 4], [1, 2, 2, 2]])
def test_chunked_and_recomputed_prompt_logprobs_equal_the_whole_prompts(chunks: list[int]) -> None:
    torch.manual_seed(0)
    prompt = [5, 1, 7, 3, 3, 0, 6]
    logits = torch.randn(len(prompt), 8)  # row j predicts prompt[j + 1]
    reference = torch.log_softmax(logits.double(), dim=-1)
    seq = Sequence(0, "r", prompt, SamplingParams(max_tokens=1, prompt_logprobs=0))
    for _ in range(2):  # the second pass is the prefill again after a preemption
        start = 0
        for n in chunks:
            chunk = prompt_logprobs.of_chunk(seq, start, n, logits[start:start + n])
            prompt_logprobs.keep(seq, start, chunk)
            start += n
    assert len(seq.prompt_logprobs) == len(prompt) and seq.prompt_logprobs[0] is None
    for position, lp in enumerate(seq.prompt_logprobs[1:], start=1):
        assert lp is not None and lp.token_id == prompt[position]
        assert lp.logprob == pytest.approx(reference[position - 1, prompt[position]].item(), abs=1e-5)
