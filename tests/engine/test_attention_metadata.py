"""The step's attention metadata (lab/engine/model/attention_metadata.py): every new token's cache
slot, lengths and offsets, whether the slots come from the Python loop (short steps) or the
vectorised gather (long chunks)."""

from __future__ import annotations

import pytest
import torch

from lab.engine.model.attention_metadata import LOOP_TOKENS, build_metadata

BLOCK = 16


def _slots_by_hand(query_lens: list[int], context_lens: list[int], tables: list[list[int]]) -> list[int]:
    return [tables[i][p // BLOCK] * BLOCK + p % BLOCK
            for i, (q, ctx) in enumerate(zip(query_lens, context_lens)) for p in range(ctx - q, ctx)]


@pytest.mark.parametrize("chunk", [37, LOOP_TOKENS + 300])
def test_slots_offsets_and_tables_of_decodes_then_a_chunk_over_a_prefix(chunk: int) -> None:
    # Two decodes, then a chunk of `chunk` tokens after 70 cached ones; blocks deliberately scattered.
    query_lens, context_lens = [1, 1, chunk], [5, 40, 70 + chunk]
    tables = [[9], [3, 7, 11], [int(b) for b in torch.randperm(200)[:(70 + chunk) // BLOCK + 1]]]
    meta = build_metadata(query_lens, context_lens, tables, BLOCK)
    assert meta.num_decodes == 2 and meta.max_query_len == chunk and meta.max_context_len == 70 + chunk
    assert meta.slot_mapping.dtype == torch.int64
    assert meta.slot_mapping.tolist() == _slots_by_hand(query_lens, context_lens, tables)
    assert meta.query_start_loc.tolist() == [0, 1, 2, 2 + chunk]
    assert meta.context_lens.dtype == meta.block_tables.dtype == torch.int32
    width = len(tables[2])
    assert meta.block_tables.shape == (3, width)
    assert meta.block_tables[1].tolist() == [3, 7, 11] + [0] * (width - 3)
