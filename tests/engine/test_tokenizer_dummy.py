"""The synthetic tokenizer of `dummy:<preset>` models: a full vocabulary of tokens with text, single
token pad words, ChatML, and a real dummy server that streams one chunk per token and lets the
lab's prompt fitter hit exact lengths."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Iterator

import httpx
import pytest
import torch

from lab.engine.model_config import PRESETS
from lab.engine.weights.loader import load_model
from lab.engine.weights.tokenizer import Tokenizer
from lab.engine.weights.tokenizer_dummy import dummy_tokenizer
from lab.instruments.base import BootContext
from lab.instruments.engine_extras import EngineExtras
from lab.instruments.prefill import PrefillParams
from lab.instruments.prompts import PAD_WORDS, filler_words, fit_prompt, salt_line
from lab.runner.mem_sampler import MemSampler
from lab.store.db import open_store
from lab.store.stored_rows import StoredRows
from tests.engine.server_process import ServerProcess, engine_server

MODEL = "dummy:smollm2-135m"
CHATML = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is a kettle?<|im_end|>\n"
          "<|im_start|>assistant\n")
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "a kettle?"}]}]


@pytest.fixture(scope="module")
def smollm() -> Tokenizer:
    return dummy_tokenizer(PRESETS["smollm2-135m"].vocab_size)


# -- the tokenizer ------------------------------------------------------------------------------

def test_every_id_but_the_specials_decodes_alone_to_text(smollm: Tokenizer) -> None:
    vocab = PRESETS["smollm2-135m"].vocab_size
    assert smollm.special_ids == frozenset({vocab - 3, vocab - 2, vocab - 1})
    assert [smollm.decode([i]) for i in sorted(smollm.special_ids)] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    empty = [i for i in range(vocab - 3) if not smollm.decode([i]) or "\ufffd" in smollm.decode([i])]
    assert empty == []
    assert smollm.token_strings([300, 40000]) == [smollm.decode([300]), smollm.decode([40000])]


def test_the_llama3_shape_fills_exactly_its_vocabulary() -> None:
    tok = dummy_tokenizer(128256)
    assert tok.special_ids == frozenset({128253, 128254, 128255})
    assert tok.encode("<|im_end|><|endoftext|>") == [128255, 128253]
    assert tok.eos_token_ids == (128255, 128253) and tok.bos_token_id is None and not tok.add_bos_token
    assert all(tok.decode([i]) for i in range(0, 128253, 97))
    assert tok.decode([128252]).strip().isalpha()


def test_ascii_round_trips_and_other_text_becomes_question_marks(smollm: Tokenizer) -> None:
    for text in ["The quick brown fox jumps over the lazy dog.", "x = f(3) + 12;\n\tprint('ok')  \r\n~`|{}",
                 "".join(map(chr, range(128)))]:
        assert smollm.decode(smollm.encode(text)) == text
    assert smollm.decode(smollm.encode("héllo 日本 🙂")) == "h?llo ?? ?"
    assert len(smollm.encode("the people of the world and the answer")) == 8


@pytest.mark.parametrize("vocab", [512, 49152])
def test_pad_words_are_one_token_and_repeat_as_many(vocab: int) -> None:
    tok = dummy_tokenizer(vocab)
    for pad in PAD_WORDS:
        assert len(tok.encode(pad)) == 1, pad
        assert len(tok.encode("The end." + pad * 3)) == len(tok.encode("The end.")) + 3, pad


def test_builds_are_identical_and_a_too_small_vocabulary_is_refused() -> None:
    a, b = dummy_tokenizer(2000), dummy_tokenizer(2000)
    assert [a.decode([i]) for i in range(2000)] == [b.decode([i]) for i in range(2000)]
    with pytest.raises(ValueError, match="at least 131, got 100"):
        dummy_tokenizer(100)


def test_chatml_template(smollm: Tokenizer) -> None:
    plain = [{"role": m["role"], "content": "What is a kettle?" if m["role"] == "user" else m["content"]}
             for m in MESSAGES]
    assert smollm.apply_chat_template(plain) == CHATML
    assert smollm.apply_chat_template(plain, add_generation_prompt=False) == CHATML.removesuffix(
        "<|im_start|>assistant\n")


def test_a_dummy_model_stops_on_its_tokenizers_end_tokens() -> None:
    loaded = load_model("dummy:llama3-8b", torch.bfloat16, device="meta")
    tok = loaded.tokenizer
    assert loaded.config.eos_token_ids == tok.eos_token_ids == tuple(tok.encode("<|im_end|><|endoftext|>"))
    assert loaded.config.bos_token_id is None and loaded.config.vocab_size == 128256


# -- a real dummy server ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with engine_server(tmp_path_factory.mktemp("dummy"), "--model", MODEL, "--device", "cpu",
                       "--max-model-len", "4096") as s:
        yield s


def sse_payloads(response: httpx.Response) -> list[dict]:
    lines = [line for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


@pytest.mark.slow
def test_a_streamed_completion_arrives_one_text_chunk_per_token(server: ServerProcess) -> None:
    body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 24, "ignore_eos": True,
            "temperature": 1.0, "seed": 3, "stream": True}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200
    texts = [p["choices"][0]["text"] for p in sse_payloads(response) if p["choices"]]
    assert len([t for t in texts if t]) == 24 == len(texts)


@pytest.mark.slow
def test_chat_answers_streamed_and_not(server: ServerProcess, smollm: Tokenizer) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8, "ignore_eos": True}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200
    answer = response.json()
    assert answer["choices"][0]["message"]["content"] and answer["usage"]["completion_tokens"] == 8
    assert answer["usage"]["prompt_tokens"] == len(smollm.encode(CHATML))
    streamed = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "stream": True}, timeout=120)
    assert streamed.status_code == 200
    deltas = [p["choices"][0]["delta"].get("content") for p in sse_payloads(streamed)]
    assert deltas[0] == "" and len([d for d in deltas[1:] if d]) == 8


@pytest.mark.slow
def test_tokenize_renders_messages_through_chatml(server: ServerProcess, smollm: Tokenizer) -> None:
    response = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "messages": MESSAGES}, timeout=30)
    assert response.status_code == 200
    tokens = response.json()["tokens"]
    assert tokens == smollm.encode(CHATML, add_special_tokens=False)
    assert smollm.decode(tokens) == CHATML and tokens[0] == smollm.encode("<|im_start|>")[0]


@pytest.mark.slow
def test_the_prompt_fitter_hits_exact_lengths(server: ServerProcess, tmp_path: Path) -> None:
    store = open_store(str(tmp_path / "lab.db"))
    ctx = BootContext(base_url=server.url, api_base=f"{server.url}/v1", model=MODEL, api_key=None, run_id=1,
                      run_name="r", slot_id=1, boot_id=1, arm="A1", window="W1", role="arm", position="arm",
                      salt="s", engine_kind="bundled", params=PrefillParams(), stored=StoredRows(store),
                      control_boot_ids=[], mem=MemSampler(), log=logging.getLogger("test"))
    words = filler_words("seed", 3000)

    def render(k: int, tail: str) -> str:
        return f"{salt_line('0123456789ab')} {' '.join(words[:k])}{tail}"

    async def fitted() -> list[tuple[int, bool, int]]:
        async with EngineExtras(ctx) as extras:
            out = []
            for target in (100, 333, 1000, 2000):
                f = await fit_prompt(extras, target, render, len(words))
                out.append((f.tokens, f.exact, len(await extras.tokenize(prompt=f.form))))
            return out

    try:
        assert asyncio.run(fitted()) == [(t, True, t) for t in (100, 333, 1000, 2000)]
    finally:
        store.close()
