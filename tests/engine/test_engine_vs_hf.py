"""The engine against Hugging Face transformers on the same SmolLM2 GGUF, in float32."""

from __future__ import annotations

import pytest
import torch

from lab.engine.core.sampling_params import SamplingParams
from lab.engine.model.attention_metadata import build_metadata
from lab.engine.serve.llm import LLM
from tests.engine.prompts import all_prompts

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("smollm2-135m", dtype="float32")


def engine_logits(llm: LLM, ids: list[int], chunk: int) -> torch.Tensor:
    """All-position logits through the paged path, computing the prompt `chunk` tokens at a time
    so later chunks attend to K/V read back from the cache."""
    runner = llm.engine.runner
    bs = runner.block_size
    table = list(range(-(-len(ids) // bs)))  # the engine is idle: these blocks are free
    out = []
    with torch.inference_mode():
        for start in range(0, len(ids), chunk):
            end = min(len(ids), start + chunk)
            meta = build_metadata([end - start], [end], [table], bs)
            hidden = runner.model.forward(torch.tensor(ids[start:end]), torch.arange(start, end), meta,
                                          runner.kv_layers)
            out.append(runner.model.logits(hidden))
    return torch.cat(out)


def hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("chunk", [4096, 7])
def test_logits_match_transformers(llm: LLM, hf_model, chunk: int) -> None:
    prompts = all_prompts(llm.tokenizer)[:10]
    for prompt in prompts:
        ids = llm.tokenizer.encode(prompt)
        ours, ref = engine_logits(llm, ids, chunk), hf_logits(hf_model, ids)
        assert ours.shape == ref.shape
        rel = ((ours - ref).norm() / ref.norm()).item()
        assert rel < 1e-4, f"{prompt[:30]!r}: relative error {rel:.2e}"
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_greedy_matches_transformers_generate(llm: LLM, hf_model) -> None:
    prompts = all_prompts(llm.tokenizer)[:6]
    ours = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    for prompt, got in zip(prompts, ours):
        ids = torch.tensor([llm.tokenizer.encode(prompt)])
        with torch.inference_mode():
            ref = hf_model.generate(ids, max_new_tokens=16, do_sample=False, min_new_tokens=16,
                                    pad_token_id=2)[0, ids.shape[1]:].tolist()
        assert got.token_ids == ref, prompt[:40]


def test_prompt_logprobs_match_transformers(llm: LLM, hf_model) -> None:
    """`echo` with logprobs (what lm-evaluation-harness loglikelihood tasks use)."""
    prompt = "The quick brown fox jumps over the lazy dog because it was"
    out = llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0, logprobs=2, prompt_logprobs=3))[0]
    ids = out.prompt_token_ids
    ref = torch.log_softmax(hf_logits(hf_model, ids), -1)
    assert out.prompt_logprobs[0] is None
    for pos in range(1, len(ids)):
        lp = out.prompt_logprobs[pos]
        assert lp.token_id == ids[pos]
        assert lp.logprob == pytest.approx(ref[pos - 1, ids[pos]].item(), abs=1e-4)
        assert [t for t, _ in lp.top] == ref[pos - 1].topk(3).indices.tolist()
    gen = out.logprobs[0]
    assert gen.token_id == int(ref[-1].argmax())
    assert gen.logprob == pytest.approx(ref[-1].max().item(), abs=1e-4)


def test_needle_at_half_of_4000_tokens_is_retrieved(llm: LLM) -> None:
    filler = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ")
    tok = llm.tokenizer
    unit = len(tok.encode(filler))
    needle = "The secret passphrase is violet-harbor-42. "
    half = filler * (2000 // unit)
    body = half + needle + filler * (2000 // unit)
    messages = [{"role": "user", "content": body + "\n\nWhat is the secret passphrase? Answer with the passphrase."}]
    prompt = tok.apply_chat_template(messages) + "The secret passphrase is"
    n = len(tok.encode(prompt))
    assert 3800 < n < 4300
    out = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0))[0]
    assert "violet-harbor-42" in out.text.replace(" ", ""), out.text
