"""Where a prefix-cache tier keeps each block: hash -> (slot, tokens), least recently used first.
The tokens are kept beside the hash so that a hash collision is never served as a hit."""

from __future__ import annotations

from collections import OrderedDict


class BlockIndex(OrderedDict[int, tuple[int, tuple[int, ...]]]):
    def slot(self, h: int, tokens: tuple[int, ...]) -> int | None:
        """The slot holding the block of this hash and these tokens, or None."""
        entry = self.get(h)
        return entry[0] if entry is not None and entry[1] == tokens else None
