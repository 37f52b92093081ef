"""Paged KV-cache bookkeeping: which block holds which tokens, reference counts, and prefix
caching by hash-chained full blocks with LRU eviction and a retention limit. With tiers
(`kv_tiers.py`), evicted blocks go down to host memory or a file and come back on a hit."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from itertools import islice
from typing import TYPE_CHECKING

from lab.engine.core.sequence import Sequence

if TYPE_CHECKING:
    from lab.engine.kv.kv_tiers import KVTiers

TIERS = ("device", "host", "file")


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set once the block is full and registered in the prefix cache
    tokens: tuple[int, ...] = ()  # kept with the hash so a hash collision can never share wrong KV
    origin: str | None = None  # the lower tier a block was copied back from, until a lookup counts it


def chain_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    """64-bit hash of a block's tokens chained to its parent's. blake2b rather than hash(): the
    file tier finds blocks by these hashes in a later process."""
    head = b"\0" if parent is None else b"\1" + parent.to_bytes(8, "little")
    return int.from_bytes(hashlib.blake2b(head + array("q", tokens).tobytes(), digest_size=8).digest(), "little")


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 retention: int = -1, tiers: KVTiers | None = None) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.retention = retention
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Blocks nobody references, least recently freed first; some still carry a hash (cached).
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.num_cached_free = 0
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # prompt tokens found
        self.tiers = tiers
        self.tier_hit_blocks = dict.fromkeys(TIERS, 0)  # prefix hits by the tier that held the block
        self.tier_queries = 0  # prompt tokens looked up in the tiers under the device (those it missed)

    # -- queries -----------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    # -- prefix cache ------------------------------------------------------------------------

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks that hold a prefix of the sequence's tokens. At least one token is always
        left to compute, since its logits are needed to sample. Blocks a lower tier holds are
        copied back into free device blocks, the whole run at once."""
        if not self.enable_prefix_caching or seq.wants_prompt_logprobs:
            return []
        usable = (seq.num_tokens - 1) // self.block_size
        found: list[int | None] = []  # None: held by a lower tier, copied back below
        below: list[tuple[int, tuple[int, ...]]] = []
        kept: set[int] = set()  # the device hits as a set: a 1M-token resume looks up 65K blocks
        parent: int | None = None
        for i in range(usable):
            tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            h = chain_hash(parent, tokens)
            block_id = self.hash_to_block.get(h)
            if block_id is not None and self.blocks[block_id].tokens == tokens:
                kept.add(block_id)
            elif self.tiers is not None and self.tiers.find(h, tokens) is not None:
                block_id = None
                below.append((h, tokens))
            else:
                break
            found.append(block_id)
            parent = h
        if not below:
            return found  # type: ignore[return-value]
        loaded = iter(self._copy_back(below, kept))
        hits = []
        for block_id in found:
            block_id = block_id if block_id is not None else next(loaded, None)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def _copy_back(self, keys: list[tuple[int, tuple[int, ...]]], keep: set[int]) -> list[int]:
        """Copy blocks lower tiers hold into free device blocks and cache them there, unused (they
        join the free list's recent end, as a freed cached block does); returns the device blocks
        of the run copied, which stops at the first block no tier could give. The blocks in `keep`
        (this lookup's device hits) are never the ones reused."""
        assert self.tiers is not None
        block_ids = list(islice((b for b in self.free if b not in keep), len(keys)))
        for block_id in block_ids:
            del self.free[block_id]
            block = self.blocks[block_id]
            if block.hash is not None:
                self._forget(block)
        origins = self.tiers.load_run(keys[:len(block_ids)], block_ids)
        for block_id, (h, tokens), origin in zip(block_ids, keys, origins):
            block = self.blocks[block_id]
            block.hash, block.tokens, block.origin = h, tokens, origin
            self.hash_to_block[h] = block_id
            self.num_cached_free += 1
        for block_id in block_ids:
            self.free[block_id] = None
        return block_ids[:len(origins)]

    def record_lookup(self, seq: Sequence, hit_blocks: int) -> None:
        if not self.enable_prefix_caching:
            return
        self.prefix_queries += seq.num_tokens
        self.prefix_hits += hit_blocks * self.block_size
        device_hits = 0
        for block_id in seq.block_table[:hit_blocks]:
            block = self.blocks[block_id]
            self.tier_hit_blocks[block.origin or "device"] += 1
            device_hits += block.origin is None
            block.origin = None  # from now on it is a device hit
        if self.tiers is not None:
            self.tier_queries += seq.num_tokens - device_hits * self.block_size

    def register_full_blocks(self, seq: Sequence) -> None:
        """After a step computed K/V, give every newly filled block its chained hash."""
        if not self.enable_prefix_caching:
            return
        full = seq.num_computed_tokens // self.block_size
        while len(seq.block_hashes) < full:
            i = len(seq.block_hashes)
            tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            h = chain_hash(parent, tokens)
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and h not in self.hash_to_block:
                block.hash, block.tokens = h, tokens
                self.hash_to_block[h] = block.block_id
                if self.tiers is not None:
                    self.tiers.on_registered(h, tokens, block.block_id)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix, in the lower tiers too; returns how many device blocks lost
        their hash."""
        dropped = 0
        for block in self.blocks:
            if block.hash is not None:
                block.hash, block.tokens, block.origin = None, (), None
                dropped += 1
        self.hash_to_block.clear()
        self.num_cached_free = 0
        if self.tiers is not None:
            self.tiers.clear()
        return dropped

    # -- allocation --------------------------------------------------------------------------

    def allocate(self, seq: Sequence, num_new_tokens: int, cached: list[int] | None = None) -> bool:
        """Give `seq` blocks for `num_new_tokens` more tokens, first taking the cached prefix blocks
        `cached` (at admission). Returns False, changing nothing, when the pool cannot hold them."""
        cached = cached or []
        taken_from_free = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        needed = max(0, -(-(len(cached) * self.block_size + seq.num_computed_tokens + num_new_tokens)
                          // self.block_size) - len(seq.block_table) - len(cached))
        if needed + taken_from_free > len(self.free):
            return False
        for block_id in cached:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
                self.num_cached_free -= 1
            block.ref_count += 1
            seq.block_table.append(block_id)
            seq.block_hashes.append(block.hash)  # type: ignore[arg-type]
        if cached:
            seq.num_computed_tokens = len(cached) * self.block_size
        for _ in range(needed):
            seq.block_table.append(self._take_free_block())
        return True

    def _take_free_block(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:
            self._forget(block)
        block.ref_count = 1
        return block_id

    def _forget(self, block: Block) -> None:
        """Evict a cached block from the device (to the tiers below, if any)."""
        if self.hash_to_block.get(block.hash) == block.block_id:  # type: ignore[arg-type]
            del self.hash_to_block[block.hash]  # type: ignore[arg-type]
            if self.tiers is not None:
                self.tiers.on_evicted(block.hash, block.tokens, block.block_id)  # type: ignore[arg-type]
        block.hash, block.tokens, block.origin = None, (), None
        if block.ref_count == 0:
            self.num_cached_free -= 1

    def free_seq(self, seq: Sequence) -> None:
        """Release a sequence's blocks. The tail is released first so that, under LRU, a shared
        prompt head outlives the sequence-specific tail."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
                if block.hash is not None:
                    self.num_cached_free += 1
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0
        self._enforce_retention()

    def _enforce_retention(self) -> None:
        if self.retention < 0 or self.num_cached_free <= self.retention:
            return
        for block_id in self.free:  # oldest first
            block = self.blocks[block_id]
            if block.hash is not None:
                self._forget(block)
                if self.num_cached_free <= self.retention:
                    return
