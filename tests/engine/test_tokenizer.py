"""The engine's tokenizer against transformers' tokenizer for the same SmolLM2 GGUF: ids, decoding,
per-token text, chat templates; and the byte-level stand-in used with dummy weights."""

from __future__ import annotations

import datetime
import os
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lab.engine.serve.llm import LLM
from lab.engine.weights import text_pieces
from lab.engine.weights.chat_template import ChatTemplate, ChatTemplateError
from lab.engine.weights.tokenizer import Tokenizer
from lab.engine.weights.tokenizer_dummy import dummy_tokenizer
from lab.engine.weights.weights_gguf import read_gguf
from tests.engine.test_loader import write_tiny_gguf

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<file_sep>", "<empty_output>"]

CORPUS = [
    "",
    "Hello world",
    " leading space",
    "trailing space ",
    "  two leading spaces",
    "a  12",
    "x   \n\n  y",
    "12345678901234567890",
    "3.14159, 2,718 and 1e-5; 007",
    "tabs\tand\tnewlines\nand\r\nwindows line ends",
    "\n\n\n",
    " " * 17,
    "\t\t\t",
    "def add(a, b):\n    return a + b\n\n\nprint(add(1, 2))  # -> 3\n",
    '{"name": "Alice", "tags": ["a", "b"], "n": 42}',
    "héllo wörld café naïve façade",
    "日本語のテキストです。",
    "中文测试，标点符号。",
    "한국어 텍스트",
    "emoji 🙂👍🏽👨‍👩‍👧 and flags 🇫🇷",
    "Ω≈ç√∫ ∑_{i=1}^{n} i² = n(n+1)/2",
    "combining e\u0301 and a\u0308",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text",
    "<|im_start|><|im_start|><|im_end|>",
    "a partial <|im_start and a stray |>",
    "<repo_name>lab<file_sep>README.md",
    "I'm sure they're here; we'll see, you've won, it's done",
    "ALL CAPS SHOUTING",
    "https://example.com/a/b?c=d&e=f#frag",
    "non\u00a0breaking and ideographic\u3000space",
    "zero\u200bwidth\u200djoiner",
    "RTL עברית العربية",
    "x" * 500,
    "\x00\x01\x1f control bytes \x7f",
    "\ufeffbyte order mark",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "and 3+3?"}],
    [{"role": "system", "content": "Réponds en français."}, {"role": "user", "content": "日本 🙂\n\ttab"},
     {"role": "assistant", "content": "D'accord."}],
    [{"role": "user", "content": ""}],
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf: Path) -> Tokenizer:
    return read_gguf(smollm2_gguf)[2]


@pytest.mark.parametrize("text", CORPUS)
def test_ids_equal_transformers(tokenizer: Tokenizer, hf_tokenizer, text: str) -> None:
    assert tokenizer.encode(text) == hf_tokenizer(text)["input_ids"]


def _random_text(rng: random.Random) -> str:
    pools = [
        lambda: rng.choice("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"),
        lambda: rng.choice("0123456789"),
        lambda: rng.choice([" ", "  ", "\t", "\n", "\r\n", "\u00a0", "\u3000"]),
        lambda: rng.choice("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"),
        lambda: chr(rng.randint(0x4E00, 0x9FFF)),  # CJK
        lambda: chr(rng.randint(0x1F300, 0x1FAFF)),  # emoji and pictographs
        lambda: chr(rng.randint(0xA0, 0x24F)),  # Latin-1 and Latin Extended
        lambda: chr(rng.randint(0x300, 0x36F)),  # combining marks
        lambda: rng.choice(SPECIALS),
        lambda: chr(rng.choice([rng.randint(1, 0xD7FF), rng.randint(0xE000, 0x10FFFF)])),
    ]
    return "".join(rng.choice(pools)() for _ in range(rng.randint(0, 40)))


def test_ids_equal_transformers_on_random_mixed_text(tokenizer: Tokenizer, hf_tokenizer) -> None:
    rng = random.Random(20240229)
    texts = [_random_text(rng) for _ in range(400)]
    mismatches = [t for t in texts if tokenizer.encode(t) != hf_tokenizer(t)["input_ids"]]
    assert mismatches == []


@settings(max_examples=300, derandomize=True, deadline=None)
@given(st.lists(st.one_of(st.text(), st.sampled_from(SPECIALS)), max_size=4).map("".join))
def test_ids_equal_transformers_on_arbitrary_unicode(tokenizer: Tokenizer, hf_tokenizer, text: str) -> None:
    assert tokenizer.encode(text) == hf_tokenizer(text)["input_ids"]


@pytest.mark.parametrize("text", CORPUS)
def test_decode_round_trips_and_equals_transformers(tokenizer: Tokenizer, hf_tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    for skip in (False, True):
        assert tokenizer.decode(ids, skip_special_tokens=skip) == hf_tokenizer.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("text", CORPUS)
def test_token_bytes_concatenate_to_the_text(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert b"".join(tokenizer.token_bytes(ids)) == text.encode("utf-8")
    assert len(tokenizer.token_strings(ids)) == len(ids)


def test_token_strings_escape_partial_characters(tokenizer: Tokenizer) -> None:
    # SmolLM2 has no token for 日, so its three UTF-8 bytes are spread over three tokens.
    ids = tokenizer.encode(" 日本<|im_end|>")
    assert tokenizer.token_strings(ids) == [" \\xe6", "\\x97", "\\xa5", "本", "<|im_end|>"]
    assert tokenizer.token_bytes(ids)[:3] == [b" \xe6", b"\x97", b"\xa5"]


def test_special_ids_and_stop_ids(tokenizer: Tokenizer, hf_tokenizer) -> None:
    assert tokenizer.special_ids == frozenset(range(17))
    assert set(hf_tokenizer.all_special_ids) <= tokenizer.special_ids
    assert tokenizer.bos_token_id == hf_tokenizer.bos_token_id == 1
    assert tokenizer.eos_token_id == hf_tokenizer.eos_token_id == 2
    assert tokenizer.eos_token_ids == (2,)
    assert tokenizer.vocab_size == 49152
    assert tokenizer.add_bos_token is False


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_equals_transformers(tokenizer: Tokenizer, hf_tokenizer, messages: list[dict],
                                           add_generation_prompt: bool) -> None:
    ours = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs


def test_chat_template_inserts_smollm2_default_system_message(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_chat_template_leaves_messages_untouched(tokenizer: Tokenizer) -> None:
    messages = [{"role": "user", "content": "hi", "reasoning": "hmm"}]
    tokenizer.apply_chat_template(messages)
    assert messages == [{"role": "user", "content": "hi", "reasoning": "hmm"}]


# A template exercising what templates commonly call, rendered by us and by transformers.
_FEATURE_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(n=0) %}"
    "{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}{% set ns.n = ns.n + 1 %}"
    "[{{ m.role }}|{{ m.content | tojson }}]{% endfor %}"
    "{% if tools %}{{ tools | tojson(indent=2) }}{% endif %}"
    "n={{ ns.n }}{% if add_generation_prompt %}>{% endif %}{{ eos_token }}"
)


def test_template_features_match_transformers(tokenizer: Tokenizer, hf_tokenizer) -> None:
    messages = [{"role": "user", "content": "<b>&\"é\""}, {"role": "skip", "content": "x"},
                {"role": "assistant", "content": "ok"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"a": "<int>"}}}]
    template = ChatTemplate(_FEATURE_TEMPLATE)
    ours = template.render(messages, add_generation_prompt=True, special_tokens=tokenizer.named_tokens, tools=tools)
    theirs = hf_tokenizer.apply_chat_template(messages, chat_template=_FEATURE_TEMPLATE, tools=tools,
                                              tokenize=False, add_generation_prompt=True)
    assert ours == theirs
    assert '"<b>&\\"é\\""' in ours  # tojson keeps <, > and & and non-ASCII as they are


def test_template_raise_exception_and_strftime_now() -> None:
    refusing = ChatTemplate("{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok")
    with pytest.raises(ChatTemplateError, match="first must be user"):
        refusing.render([{"role": "assistant", "content": "x"}], add_generation_prompt=True, special_tokens={})
    assert refusing.render([{"role": "user", "content": "x"}], add_generation_prompt=True, special_tokens={}) == "ok"
    dated = ChatTemplate("{{ strftime_now('%Y') }}")
    year = dated.render([], add_generation_prompt=False, special_tokens={})
    assert year in {str(datetime.datetime.now().year), str(datetime.datetime.now().year - 1)}


def test_template_sandbox_refuses_python_internals() -> None:
    escape = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):
        escape.render([], add_generation_prompt=False, special_tokens={})


def test_generation_block_renders_its_body() -> None:
    template = ChatTemplate("{% for m in messages %}{% generation %}<{{ m.content }}>{% endgeneration %}{% endfor %}")
    assert template.render([{"role": "assistant", "content": "a"}], add_generation_prompt=False,
                           special_tokens={}) == "<a>"


def test_bad_template_is_a_one_line_error() -> None:
    with pytest.raises(ChatTemplateError) as info:
        ChatTemplate("{% for m in messages %}")
    assert "\n" not in str(info.value)


def test_save_and_load_keep_everything(tokenizer: Tokenizer, tmp_path: Path) -> None:
    tokenizer.save(tmp_path)
    loaded = Tokenizer.load(tmp_path)
    for text in CORPUS:
        assert loaded.encode(text) == tokenizer.encode(text)
    assert (loaded.special_ids, loaded.eos_token_ids, loaded.bos_token_id, loaded.vocab_size) == \
        (tokenizer.special_ids, tokenizer.eos_token_ids, tokenizer.bos_token_id, tokenizer.vocab_size)
    messages = CONVERSATIONS[1]
    assert loaded.apply_chat_template(messages) == tokenizer.apply_chat_template(messages)


def _long_text(rng: random.Random, words: int) -> str:
    """Prose-like text (words between spaces, most cuts land between letters) mixed with
    everything `_random_text` makes: digits, whitespace runs, punctuation, CJK, combining marks,
    special tokens written in the text."""
    parts = []
    for _ in range(words):
        parts.append(_random_text(rng) if rng.random() < 0.2 else
                     "".join(rng.choice("abcdefghijklmnopqrstuvwxyzéß") for _ in range(rng.randint(1, 9))))
        parts.append(rng.choice([" ", " ", " ", "\n", ", ", "  "]))
    return "".join(parts)


@pytest.mark.parametrize("which", ["smollm2", "dummy", "llama3-split"])
def test_a_long_text_encoded_in_pieces_gives_the_whole_texts_ids(which: str, smollm2_gguf: Path,
                                                                 tmp_path: Path) -> None:
    if which == "smollm2":
        tok = read_gguf(smollm2_gguf)[2]
    elif which == "dummy":
        tok = dummy_tokenizer(128256)
    else:
        tok = read_gguf(write_tiny_gguf(tmp_path / "tiny.gguf", pre="llama-bpe"))[2]
    tok.piece_chars = 64  # many cuts in a text a test can afford
    rng = random.Random(7)
    for _ in range(40):
        text = _long_text(rng, 300)
        assert len(text_pieces.pieces(text, tok.piece_chars)) > 5
        for special in (True, False):
            assert tok.encode(text, add_special_tokens=special) == \
                tok._backend.encode(text, add_special_tokens=special).ids


def test_text_is_cut_only_at_a_space_between_letters() -> None:
    text = "ab " * 40 + "12 34 !? " * 40 + "cd ef"
    parts = text_pieces.pieces(text, piece_chars=50)
    assert "".join(parts) == text and len(parts) > 1
    for part in parts[1:]:
        assert part[0] == " " and part[1].isalpha()
    assert text_pieces.pieces("1 2 3 " * 100, piece_chars=50) == ["1 2 3 " * 100]  # no letters: no cut
    assert text_pieces.pieces(text, piece_chars=text_pieces.WHOLE) == [text]  # --tokenize-piece-chars -1


def test_by_default_a_text_is_cut_into_two_pieces_per_core_within_the_bounds() -> None:
    # Timed on a 2-core and a 16-core host (docs/performance.md): 8 kB of text cut in 4 pieces on
    # two cores, in 16 of 512 characters on sixteen; 132 kB in pieces of 4 kB on either.
    assert text_pieces.piece_chars_for(8192, cores=2) == 2048
    assert text_pieces.piece_chars_for(8192, cores=16) == text_pieces.MIN_PIECE_CHARS == 512
    assert text_pieces.piece_chars_for(132_000, cores=2) == text_pieces.MAX_PIECE_CHARS == 4096
    assert text_pieces.piece_chars_for(33_000, cores=16) == 1031
    assert text_pieces.piece_chars_for(8192, 1024, cores=16) == 1024  # a size given is kept
    assert text_pieces.piece_chars_for(8192, text_pieces.WHOLE, cores=16) == text_pieces.WHOLE
    text = "word " * 1638  # 8,190 characters
    cut = text_pieces.pieces(text)
    assert "".join(cut) == text and 2 <= len(cut) <= 2 * len(os.sched_getaffinity(0)) + 1
    assert text_pieces.pieces("word " * 200) == ["word " * 200]  # shorter than two of the smallest pieces


@pytest.mark.parametrize("piece_chars", [-1, 64])
def test_the_engine_tokenizes_in_pieces_of_its_knob(piece_chars: int) -> None:
    llm = LLM("smollm2-135m", max_model_len=4096, tokenize_piece_chars=piece_chars)
    text = _long_text(random.Random(3), 400)
    assert llm.tokenizer.piece_chars == piece_chars
    assert llm.encode(text) == llm.tokenizer._backend.encode(text, add_special_tokens=True).ids
    cut = len(text_pieces.pieces(text, llm.tokenizer.piece_chars))
    assert (cut > 1) == (piece_chars != text_pieces.WHOLE)
