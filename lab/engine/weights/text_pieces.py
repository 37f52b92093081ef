"""A long text cut into pieces that a byte-level BPE tokenizer encodes independently to the same
ids as the whole: each cut is a space between two letters, where every byte-level pre-tokenizer
(GPT-2's split, Llama-3's) starts a new pre-token (` word`) and no merge reaches across. The
pieces are then encoded in parallel on the tokenizers library's threads: a prompt's tokenization
is all host time before its first step.

How finely to cut depends on the host: a piece must be long enough that handing it to a thread
pays, there should be enough of them to keep every core busy, and a long piece costs more than
its share (byte-level BPE's work grows faster than the text), so even one core gains from
pieces of a few thousand characters. `--tokenize-piece-chars 0` (the default) cuts two pieces
per usable core, each between MIN_PIECE_CHARS and MAX_PIECE_CHARS; docs/performance.md has the
sizes timed on a 2-core and a 16-core host."""

from __future__ import annotations

import os
from functools import cache

# Shorter pieces stop paying even on many cores: each one is a task handed to a thread.
MIN_PIECE_CHARS = 512
MAX_PIECE_CHARS = 4096
WHOLE = -1  # --tokenize-piece-chars -1: never cut


def piece_chars_for(text_chars: int, piece_chars: int = 0, cores: int | None = None) -> int:
    """The piece size for a text of `text_chars`: `piece_chars` when set (> 0; WHOLE stays WHOLE),
    else two pieces per core, within [MIN_PIECE_CHARS, MAX_PIECE_CHARS]."""
    if piece_chars:
        return piece_chars
    per_core = text_chars // (2 * (cores or _usable_cores()))
    return min(MAX_PIECE_CHARS, max(MIN_PIECE_CHARS, per_core))


@cache
def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def pieces(text: str, piece_chars: int = 0) -> list[str]:
    """`text` cut about every `piece_chars` characters (0: `piece_chars_for` this host) at a space
    between two letters; the text itself when it is shorter than two pieces, offers no such
    space, or `piece_chars` is WHOLE."""
    piece_chars = piece_chars_for(len(text), piece_chars)
    if piece_chars == WHOLE or len(text) < 2 * piece_chars:
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
