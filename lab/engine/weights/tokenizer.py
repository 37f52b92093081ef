"""The engine's tokenizer: a `tokenizers` pipeline plus what serving needs around it (stop ids,
special ids, per-token text for logprobs, the chat template), built from GGUF metadata or from a
Hugging Face `tokenizer.json` (the synthetic one of dummy weights is in tokenizer_dummy.py)."""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from typing import Any, Mapping, Sequence

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from lab.engine.weights import text_pieces
from lab.engine.weights.chat_template import ChatTemplate, ChatTemplateError

TOKENIZER_FILE = "tokenizer.json"
META_FILE = "tokenizer_meta.json"

# The named tokens chat templates may refer to as variables (`{{ bos_token }}`).
NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")

# GGUF token types (llama.cpp's `llama_token_type`).
_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4

# How the vocabulary's merges were learned to split text, by `tokenizer.ggml.pre`. A name not here
# gets the GPT-2 split built into ByteLevel, which is what transformers gives such files too
# (SmolLM2's `smollm` included: no separate digit split).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GGUF_PRE_SPLITS = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}

# The byte-level spelling GPT-2 introduced: printable Latin-1 bytes stand for themselves, the
# other 68 bytes get the code points from 256 upward, in byte order.
_PRINTABLE = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
BYTE_TO_CHAR: dict[int, str] = {b: chr(b) for b in _PRINTABLE}
BYTE_TO_CHAR.update({b: chr(256 + n) for n, b in enumerate(b for b in range(256) if b not in BYTE_TO_CHAR)})
CHAR_TO_BYTE: dict[str, int] = {c: b for b, c in BYTE_TO_CHAR.items()}


def _byte_spelling(token: str) -> str:
    """A GGUF byte-level token as the BPE model spells it; tokens already in the byte alphabet are kept."""
    if all(c in CHAR_TO_BYTE for c in token):
        return token
    return "".join(BYTE_TO_CHAR[b] for b in token.encode("utf-8"))


def _is_byte_level(backend: tokenizers.Tokenizer) -> bool:
    decoder = backend.decoder
    if decoder is None:
        return False
    state = json.loads(decoder.__getstate__())
    parts = state.get("decoders", [state]) if state.get("type") == "Sequence" else [state]
    return any(p.get("type") == "ByteLevel" for p in parts)


class Tokenizer:
    """Text <-> token ids for one model.

    `vocab_size` is the model's (embedding rows), which can exceed the tokenizer's own vocabulary;
    ids in that gap are special and have no text.
    """

    def __init__(self, backend: tokenizers.Tokenizer, *, vocab_size: int, bos_token_id: int | None,
                 eos_token_ids: Sequence[int], chat_template: str | None = None,
                 named_tokens: Mapping[str, str] | None = None) -> None:
        self._backend = backend
        self.vocab_size = vocab_size
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.eos_token_id = self.eos_token_ids[0] if self.eos_token_ids else None
        self.named_tokens = {k: v for k, v in (named_tokens or {}).items() if v is not None}
        self.chat_template_source = chat_template
        self._chat_template = ChatTemplate(chat_template) if chat_template else None
        self._byte_level = _is_byte_level(backend)
        self._backend_size = backend.get_vocab_size(with_added_tokens=True)
        self.piece_chars = 0  # text_pieces.pieces' own choice; the engine sets --tokenize-piece-chars

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_gguf_vocab(cls, *, tokens: Sequence[str], token_types: Sequence[int], merges: Sequence[str],
                        pre: str | None, bos_token_id: int | None, eos_token_ids: Sequence[int],
                        unk_token_id: int | None, pad_token_id: int | None, add_bos_token: bool,
                        chat_template: str | None, vocab_size: int) -> "Tokenizer":
        """A byte-level BPE (`tokenizer.ggml.model == "gpt2"`) from a GGUF file's token list and
        merges, configured as transformers configures the tokenizer it builds from the same file."""
        vocab = {_byte_spelling(t): i for i, t in enumerate(tokens)}
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs, continuing_subword_prefix="",
                                                  end_of_word_suffix="", fuse_unk=False))
        split = _GGUF_PRE_SPLITS.get(pre or "")
        if split is None:
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        else:
            backend.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        backend.decoder = decoders.ByteLevel()
        # Control tokens stay whole wherever they appear in text. One spelled outside the byte
        # alphabet is a mislabel in some files; adding it would grow the vocabulary, so it is left out.
        control = [AddedToken(t, special=True, normalized=False) for t, kind in zip(tokens, token_types)
                   if kind == _GGUF_CONTROL and all(c in CHAR_TO_BYTE for c in t)]
        backend.add_special_tokens(control)
        user = [AddedToken(t, special=False, normalized=False) for t, kind in zip(tokens, token_types)
                if kind == _GGUF_USER_DEFINED]
        backend.add_tokens(user)
        if add_bos_token and bos_token_id is not None:
            bos = tokens[bos_token_id]
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_token_id)])
        named = {"bos_token": bos_token_id, "eos_token": eos_token_ids[0] if eos_token_ids else None,
                 "unk_token": unk_token_id, "pad_token": pad_token_id}
        return cls(backend, vocab_size=vocab_size, bos_token_id=bos_token_id, eos_token_ids=eos_token_ids,
                   chat_template=chat_template,
                   named_tokens={k: tokens[i] for k, i in named.items() if i is not None})

    @classmethod
    def from_hf_directory(cls, directory: Path, *, vocab_size: int,
                          eos_token_ids: Sequence[int]) -> "Tokenizer":
        """`tokenizer.json` + `tokenizer_config.json` (+ `chat_template.jinja`, which newer
        transformers writes instead of a `chat_template` entry). `eos_token_ids` are the model's
        stop ids (generation_config.json), joined after the tokenizer's own eos token."""
        backend = tokenizers.Tokenizer.from_file(str(directory / TOKENIZER_FILE))
        config_path = directory / "tokenizer_config.json"
        config: dict[str, Any] = json.loads(config_path.read_text("utf-8")) if config_path.exists() else {}
        named = {}
        for name in NAMED_TOKENS:
            value = config.get(name)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                named[name] = value
        template_file = directory / "chat_template.jinja"
        template = template_file.read_text("utf-8") if template_file.exists() else config.get("chat_template")
        if isinstance(template, list):
            # Several named templates: the one called "default" is what apply_chat_template uses.
            template = next((t["template"] for t in template if t.get("name") == "default"), None)

        def token_id(name: str) -> int | None:
            return backend.token_to_id(named[name]) if name in named else None

        eos = token_id("eos_token")
        eos_ids = tuple(dict.fromkeys(([eos] if eos is not None else []) + list(eos_token_ids)))
        return cls(backend, vocab_size=vocab_size, bos_token_id=token_id("bos_token"), eos_token_ids=eos_ids,
                   chat_template=template, named_tokens=named)

    def save(self, directory: Path) -> None:
        self._backend.save(str(directory / TOKENIZER_FILE))
        meta = {"vocab_size": self.vocab_size, "bos_token_id": self.bos_token_id,
                "eos_token_ids": list(self.eos_token_ids), "add_bos_token": self.add_bos_token,
                "special_ids": sorted(self.special_ids), "named_tokens": self.named_tokens,
                "chat_template": self.chat_template_source}
        (directory / META_FILE).write_text(json.dumps(meta, ensure_ascii=False, indent=1), "utf-8")

    @classmethod
    def load(cls, directory: Path) -> "Tokenizer":
        """The inverse of `save`; raises ValueError when the two files disagree (a damaged cache)."""
        meta = json.loads((directory / META_FILE).read_text("utf-8"))
        backend = tokenizers.Tokenizer.from_file(str(directory / TOKENIZER_FILE))
        tok = cls(backend, vocab_size=meta["vocab_size"], bos_token_id=meta["bos_token_id"],
                  eos_token_ids=meta["eos_token_ids"], chat_template=meta["chat_template"],
                  named_tokens=meta["named_tokens"])
        if tok.add_bos_token != meta["add_bos_token"] or sorted(tok.special_ids) != meta["special_ids"]:
            raise ValueError(f"{directory / META_FILE} does not match {directory / TOKENIZER_FILE}")
        return tok

    # -- use ----------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, as Hugging Face's `tokenizer(text)["input_ids"]`: special tokens
        written in the text are recognised, and a BOS is added when the model's tokenizer adds one.
        Pass `add_special_tokens=False` for text a chat template rendered (it writes its own BOS).
        A long text is encoded in pieces in parallel (`text_pieces.py`), to the same ids."""
        parts = text_pieces.pieces(text, self.piece_chars) if self._cuts_safely else [text]
        if len(parts) == 1:
            return self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        # The fast batch keeps no offsets; the post-processor's tokens are added around the whole.
        ids = [i for piece in self._backend.encode_batch_fast(parts, add_special_tokens=False) for i in piece.ids]
        before, after = self._added_around if add_special_tokens else ([], [])
        return before + ids + after

    @cached_property
    def _added_around(self) -> tuple[list[int], list[int]]:
        """The ids the post-processor puts before and after a text's own (a BOS, say)."""
        bare = self._backend.encode("a", add_special_tokens=False).ids
        full = self._backend.encode("a", add_special_tokens=True).ids
        at = next(i for i in range(len(full) - len(bare) + 1) if full[i:i + len(bare)] == bare)
        return full[:at], full[at + len(bare):]

    @cached_property
    def _cuts_safely(self) -> bool:
        """A space between two letters always starts a pre-token: byte-level BPE, and no added
        token (matched before the split) whose text holds a space."""
        added = self._backend.get_added_tokens_decoder().values()
        return self._byte_level and not any(" " in token.content for token in added)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, ids: Sequence[int]) -> list[bytes]:
        """The exact bytes each token contributes to the text (OpenAI's logprobs `bytes`). Special
        tokens give their written form; ids with no text give b""."""
        out = []
        for i in ids:
            token = self._backend.id_to_token(i)
            if token is None:
                out.append(b"")
            elif i in self._added_text:
                out.append(self._added_text[i])
            elif self._byte_level and all(c in CHAR_TO_BYTE for c in token):
                out.append(bytes(CHAR_TO_BYTE[c] for c in token))
            elif self._byte_level:
                out.append(token.encode("utf-8"))  # a vocabulary entry outside the byte alphabet
            else:
                out.append(self._sentencepiece_bytes(token))
        return out

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """Per-token text for logprobs. A token holding only part of a UTF-8 character shows the
        bytes it has as backslash escapes (`"\\xe2\\x80"`), never U+FFFD, so distinct tokens stay
        distinct and the bytes can be recovered."""
        return [b.decode("utf-8", errors="backslashreplace") for b in self.token_bytes(ids)]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The prompt text Hugging Face's `apply_chat_template(messages, tokenize=False, ...)` gives."""
        if self._chat_template is None:
            raise ChatTemplateError("this model has no chat template; use /v1/completions with a plain prompt")
        return self._chat_template.render(messages, add_generation_prompt=add_generation_prompt,
                                          special_tokens=self.named_tokens, **kwargs)

    @property
    def has_chat_template(self) -> bool:
        return self._chat_template is not None

    @cached_property
    def special_ids(self) -> frozenset[int]:
        added = {i for i, t in self._backend.get_added_tokens_decoder().items() if t.special}
        return frozenset(added | set(range(self._backend_size, self.vocab_size)))

    @cached_property
    def add_bos_token(self) -> bool:
        return self.bos_token_id is not None and self.encode("")[:1] == [self.bos_token_id]

    @cached_property
    def _added_text(self) -> dict[int, bytes]:
        return {i: t.content.encode("utf-8") for i, t in self._backend.get_added_tokens_decoder().items()}

    @staticmethod
    def _sentencepiece_bytes(token: str) -> bytes:
        # SentencePiece vocabularies write a space as U+2581 and unknown bytes as `<0xNN>` tokens.
        if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            return bytes([int(token[3:5], 16)])
        return token.replace("\u2581", " ").encode("utf-8")
