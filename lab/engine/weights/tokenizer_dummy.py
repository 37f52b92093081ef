"""A synthetic tokenizer for random-weight (`dummy:<preset>`) models, built in memory at boot so the
lab sees what it sees with a real model: a full vocabulary, a chat template, stop tokens, and text
for every token.

Random weights sample ids across the whole vocabulary, so every id except the specials decodes, on
its own, to non-empty valid UTF-8; otherwise streamed output would arrive in a few chunks of text
instead of one per token. It is a byte-level BPE over the 128 ASCII characters:

- a normalizer replaces every non-ASCII character with "?", so no token is ever part of a UTF-8
  character; the tokenizer is therefore lossy for non-ASCII text (it decodes back with "?");
- merges build first a list of common English words, with and without a leading space (the pad
  words " and", " the", " a", " of" first, since the lab's exact-length prompt fitter needs each to
  be one token), then letter strings in breadth-first order (" a", "ab", " ab", ..., then length 3,
  ...) until the vocabulary is full;
- the last ids are the specials `<|endoftext|>`, `<|im_start|>` and `<|im_end|>`, and the chat
  template is ChatML; generation stops at `<|im_end|>` or `<|endoftext|>`, and there is no BOS.

Everything is deterministic and nothing is cached on disk.
"""

from __future__ import annotations

import itertools
import string
from collections.abc import Iterator

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from lab.engine.weights.tokenizer import BYTE_TO_CHAR, Tokenizer

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIALS = (ENDOFTEXT, IM_START, IM_END)
CHATML_TEMPLATE = (
    r"{% for message in messages %}"
    r"{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    r"{% endfor %}"
    r"{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
ASCII_SIZE = 128

# The words prompts are most often made of. The first four are the prompt fitter's pad words.
_WORDS = (
    "and the a of to in is that it for on was with as be by at this are from or his an have not they "
    "which one had but you were her all she there can their we him been has when who will more no if "
    "out so said what up its about into than them only other new some could time these two may then "
    "do first any my now such like our over man me even most made after also did many before must "
    "through back years where much your way well down should because each just those people how too "
    "little state good very make world still own see men work long get here between both life being "
    "under never day same another know while last might us great old year off come since against go "
    "came right used take three place small found part every house number use water word called name "
    "line write sound give help mean tell boy follow want show around form set put end does large big "
    "turn why ask went read need land different home move try kind hand picture again change play "
    "spell air away animal point page letter mother answer study learn high near add food below "
    "country plant school father keep tree start city earth eye light thought head story saw left few "
    "along close something seem next hard open example begin always paper together got group often "
    "run important until children side feet car mile night walk white sea began grow took river four "
    "carry once book hear stop without second later miss idea enough eat face watch far really almost "
    "let above girl sometimes mountain cut young talk soon list song leave family model engine token "
    "prompt request server question data system value code test result output input text message user "
    "assistant"
).split()


def _byte_spelling(text: str) -> str:
    return "".join(BYTE_TO_CHAR[b] for b in text.encode("ascii"))


def _bpe(word: str, ranks: dict[tuple[str, str], int]) -> list[str]:
    """`word` split by the merges in `ranks`, as the `tokenizers` BPE model splits it: the lowest
    ranked adjacent pair first, the leftmost of equals first."""
    parts = list(word)
    while len(parts) > 1:
        rank, i = min((ranks.get((parts[i], parts[i + 1]), len(ranks)), i) for i in range(len(parts) - 1))
        if rank == len(ranks):
            break
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return parts


def _word_merges() -> Iterator[tuple[str, str]]:
    """Merges that make each word one token. Each merge joins the first two parts the merges so far
    leave of a word, so a word made one token stays one token whatever merges follow it: a later
    merge ranks below every merge its path uses."""
    ranks: dict[tuple[str, str], int] = {}
    words = [" " + w for w in _WORDS] + list(_WORDS) + [" " + w.capitalize() for w in _WORDS]
    for word in map(_byte_spelling, words):
        while len(parts := _bpe(word, ranks)) > 1:
            pair = (parts[0], parts[1])
            ranks[pair] = len(ranks)
            yield pair


def _letter_merges() -> Iterator[tuple[str, str]]:
    """Letter strings, with and without a leading space, shortest first; each is its string less
    its last letter (made one level earlier) joined with that letter."""
    space = _byte_spelling(" ")
    yield from ((space, c) for c in string.ascii_lowercase)
    for length in itertools.count(2):
        for letters in itertools.product(string.ascii_lowercase, repeat=length):
            word = "".join(letters)
            yield word[:-1], word[-1]
            yield space + word[:-1], word[-1]


def dummy_tokenizer(vocab_size: int) -> Tokenizer:
    """The synthetic tokenizer filling exactly `vocab_size` ids, the specials last."""
    full = vocab_size - len(SPECIALS)
    if full < ASCII_SIZE:
        raise ValueError(f"a dummy tokenizer needs a vocabulary of at least {ASCII_SIZE + len(SPECIALS)}, "
                         f"got {vocab_size}")
    vocab = {BYTE_TO_CHAR[b]: b for b in range(ASCII_SIZE)}
    # A token may be made by more than one merge (a word's path and a letter string's); each stays,
    # since a word's path needs its own. A pair listed twice would take the later rank.
    merges: dict[tuple[str, str], None] = {}
    for pair in itertools.chain(_word_merges(), _letter_merges()):
        token = pair[0] + pair[1]
        if token not in vocab:
            if len(vocab) == full:
                break
            vocab[token] = len(vocab)
        merges.setdefault(pair)
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=list(merges), fuse_unk=False))
    backend.normalizer = normalizers.Replace(Regex(r"[^\x00-\x7F]"), "?")
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    ids = {t: backend.token_to_id(t) for t in SPECIALS}
    return Tokenizer(backend, vocab_size=vocab_size, bos_token_id=None, eos_token_ids=(ids[IM_END], ids[ENDOFTEXT]),
                     chat_template=CHATML_TEMPLATE, named_tokens={"eos_token": IM_END, "pad_token": ENDOFTEXT})
