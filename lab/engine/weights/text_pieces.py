"""A long text cut into pieces that a byte-level BPE tokenizer encodes independently to the same
ids as the whole: each cut is a space between two letters, where every byte-level pre-tokenizer
(GPT-2's split, Llama-3's) starts a new pre-token (` word`) and no merge reaches across. The
pieces are then encoded in parallel on the tokenizers library's threads: a prompt's tokenization
is all host time before its first step."""

from __future__ import annotations

# The engine's default (--tokenize-piece-chars): below twice this a text is encoded whole.
PIECE_CHARS = 4096


def pieces(text: str, piece_chars: int = PIECE_CHARS) -> list[str]:
    """`text` cut about every `piece_chars` characters at a space between two letters (the text
    itself when it is shorter than two pieces, offers no such space, or `piece_chars` is 0)."""
    if not piece_chars or len(text) < 2 * piece_chars:
        return [text]
    cuts = [0]
    at = piece_chars
    while at < len(text) - piece_chars:
        cut = text.find(" ", at)
        while cut != -1 and not (text[cut - 1].isalpha() and cut + 1 < len(text) and text[cut + 1].isalpha()):
            cut = text.find(" ", cut + 1)
        if cut == -1:
            break
        cuts.append(cut)
        at = cut + piece_chars
    cuts.append(len(text))
    return [text[a:b] for a, b in zip(cuts, cuts[1:])]
