"""Prefix caching and block accounting, exact counts."""

from __future__ import annotations

from lab.engine.core.sampling_params import SamplingParams
from lab.engine.core.sequence import Sequence
from lab.engine.kv.block_manager import BlockManager

BS = 4


def seq(i: int, tokens: list[int], **params) -> Sequence:
    return Sequence(i, f"r{i}", tokens, SamplingParams(**params))


def admit(bm: BlockManager, s: Sequence) -> int:
    """Admit like the scheduler does: match the prefix, allocate the rest, count the lookup."""
    cached = bm.match_prefix(s)
    assert bm.allocate(s, s.num_tokens - len(cached) * BS, cached)
    bm.record_lookup(s, len(cached))
    s.num_cached_tokens = len(cached) * BS
    s.num_computed_tokens = s.num_tokens
    bm.register_full_blocks(s)
    return s.num_cached_tokens


def test_shared_prefix_hits_are_exact() -> None:
    bm = BlockManager(16, BS)
    a = seq(0, list(range(10)))  # blocks [0-3] [4-7] [8,9]
    assert admit(bm, a) == 0
    b = seq(1, list(range(8)) + [99, 98, 97])  # shares two full blocks
    assert admit(bm, b) == 8
    assert b.block_table[:2] == a.block_table[:2]
    assert bm.blocks[a.block_table[0]].ref_count == 2
    assert (bm.prefix_queries, bm.prefix_hits) == (21, 8)


def test_last_token_is_always_computed() -> None:
    bm = BlockManager(16, BS)
    admit(bm, seq(0, list(range(8))))
    again = seq(1, list(range(8)))  # identical, exactly two full blocks
    assert admit(bm, again) == 4  # the second block holds the last token: recomputed


def test_freed_blocks_stay_cached_until_reused_lru() -> None:
    bm = BlockManager(4, BS)
    a = seq(0, list(range(9)))
    admit(bm, a)
    bm.free_seq(a)
    assert bm.num_free_blocks == 4
    assert admit(bm, seq(1, list(range(9)))) == 8  # still cached after its owner finished
    bm2 = BlockManager(3, BS)
    x = seq(2, list(range(8)) + [50])
    admit(bm2, x)
    bm2.free_seq(x)
    y = seq(3, [7] * 9)  # needs all three blocks: evicts the cached ones
    admit(bm2, y)
    bm2.free_seq(y)
    assert admit(bm2, seq(4, list(range(8)) + [50])) == 0


def test_retention_limit_drops_oldest_hashes() -> None:
    bm = BlockManager(16, BS, retention=1)
    a = seq(0, list(range(13)))  # three full blocks
    admit(bm, a)
    bm.free_seq(a)
    assert bm.num_cached_free == 1
    # Tail blocks are freed first, so the retained block is the prompt's head... and it is
    # the only one left: a lookup finds just the first block.
    assert admit(bm, seq(1, list(range(13)))) == 4


def test_no_caching_when_disabled_or_prompt_logprobs() -> None:
    bm = BlockManager(16, BS, enable_prefix_caching=False)
    admit(bm, seq(0, list(range(10))))
    assert admit(bm, seq(1, list(range(10)))) == 0
    bm2 = BlockManager(16, BS)
    admit(bm2, seq(2, list(range(10))))
    assert admit(bm2, seq(3, list(range(10)), prompt_logprobs=1)) == 0


def test_allocate_refuses_without_side_effects() -> None:
    bm = BlockManager(2, BS)
    s = seq(0, list(range(12)))
    assert not bm.allocate(s, 12)
    assert s.block_table == [] and bm.num_free_blocks == 2


def test_reset_prefix_cache() -> None:
    bm = BlockManager(16, BS)
    a = seq(0, list(range(10)))
    admit(bm, a)
    bm.free_seq(a)
    assert bm.reset_prefix_cache() == 2
    assert admit(bm, seq(1, list(range(10)))) == 0


def test_collision_guard_compares_tokens() -> None:
    bm = BlockManager(16, BS)
    a = seq(0, list(range(10)))
    admit(bm, a)
    # Corrupt the stored tokens of the first block: a hash match must not be trusted.
    bm.blocks[a.block_table[0]].tokens = (9, 9, 9, 9)
    assert admit(bm, seq(1, list(range(10)))) == 0
