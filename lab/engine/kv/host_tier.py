"""The host-memory tier under the prefix cache: KV blocks evicted from (or, with write-through,
copied from) the device KV pool, kept in a fixed pool of block-sized slots in RAM, least recently
used first out."""

from __future__ import annotations

from typing import Callable

import torch

from lab.engine.kv.tier_index import BlockIndex

# Called with a block's hash, tokens and data just before its slot is reused.
Spill = Callable[[int, tuple[int, ...], torch.Tensor], None]


class HostTier:
    def __init__(self, capacity_blocks: int, block_shape: tuple[int, ...], dtype: torch.dtype, pin: bool,
                 on_evict: Spill | None = None) -> None:
        # Allocated once: the OS commits the pages as blocks arrive, and pinned pages (CUDA) make
        # the copies back to the device asynchronous-capable.
        self.pool = torch.empty((capacity_blocks, *block_shape), dtype=dtype, pin_memory=pin)
        self.capacity = capacity_blocks
        self.index = BlockIndex()
        self.free = self._all_slots()
        self.on_evict = on_evict
        self.blocks_written = 0

    def __len__(self) -> int:
        return len(self.index)

    def __contains__(self, key: tuple[int, tuple[int, ...]]) -> bool:
        return self.index.slot(*key) is not None

    def _all_slots(self) -> list[int]:
        # Popped from the end: a run of blocks put in order lands in ascending slots, which a
        # lookup copies back to the device in one piece.
        return list(range(self.capacity - 1, -1, -1))

    def take(self, h: int, tokens: tuple[int, ...]) -> int | None:
        """The slot holding the block (now the most recently used), or None."""
        slot = self.index.slot(h, tokens)
        if slot is not None:
            self.index.move_to_end(h)
        return slot

    def get(self, h: int, tokens: tuple[int, ...]) -> torch.Tensor | None:
        slot = self.take(h, tokens)
        return None if slot is None else self.pool[slot]

    def put(self, h: int, tokens: tuple[int, ...], block: torch.Tensor) -> None:
        if h in self.index:
            self.index.move_to_end(h)
            return
        if not self.free:
            old, (slot, old_tokens) = self.index.popitem(last=False)
            if self.on_evict is not None:
                self.on_evict(old, old_tokens, self.pool[slot])
            self.free.append(slot)
        slot = self.free.pop()
        self.pool[slot].copy_(block)
        self.index[h] = (slot, tokens)
        self.blocks_written += 1

    def clear(self) -> None:
        self.index.clear()
        self.free = self._all_slots()
