"""The flat varlen batch's attention metadata: one layout that the PyTorch path and the Triton
kernels consume unchanged.

Layout of one engine step:
- the step's new tokens are flattened into one sequence of T tokens; sequences are contiguous;
- the first `num_decodes` sequences are decodes (exactly one new token each), the rest are
  prefill chunks (one or more new tokens, possibly on top of a cached prefix);
- the KV cache of one layer is `[num_blocks, block_size, num_kv_heads, head_dim]` for K and the
  same for V; token `p` of a sequence lives in slot `block_table[p // block_size] * block_size +
  p % block_size`;
- a sequence with `context_len` tokens of KV (after this step's tokens are written) and
  `query_len` new tokens has its queries at positions `context_len - query_len ... context_len - 1`,
  and query `i` attends causally to KV positions `0 ... context_len - query_len + i`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lab.engine.model.host_copy import to_device


@dataclass
class AttentionMetadata:
    num_decodes: int
    slot_mapping: torch.Tensor  # [T] int64: cache slot of every new token
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0 past a sequence's blocks
    context_lens: torch.Tensor  # [B] int32: KV tokens per sequence after this step's writes
    query_start_loc: torch.Tensor  # [B + 1] int32: cumulative query lengths
    max_query_len: int
    max_context_len: int
    # Host copies so the reference path never syncs with the device to read lengths.
    query_lens_cpu: list[int]
    context_lens_cpu: list[int]
    # Filled lazily by attention backends with per-step indexes shared across layers.
    scratch: dict = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_cpu)

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decodes

    @property
    def num_tokens(self) -> int:
        return int(sum(self.query_lens_cpu))

    @property
    def is_pure_decode(self) -> bool:
        return self.num_decodes == self.num_seqs


# Steps of at most this many new tokens compute their slots in a Python loop, which costs less than
# the fixed cost of the tensor operations (decode steps, chats); longer chunks as one gather.
LOOP_TOKENS = 512


def token_positions(query_lens: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
    """Positions of the step's new tokens, flattened ([T] int64, on the host): sequence i's run from
    context_lens[i] - query_lens[i] to context_lens[i] - 1."""
    first = context_lens - query_lens
    starts = torch.cumsum(query_lens, 0) - query_lens
    return torch.arange(int(query_lens.sum())) + torch.repeat_interleave(first - starts, query_lens)


def build_metadata(query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
                   block_size: int, device: torch.device | str = "cpu", num_decodes: int | None = None,
                   pad_block_table_to: int = 0) -> AttentionMetadata:
    """Metadata for sequences given as Python lists (decodes first). Used by the model runner
    and by tests that build batches by hand. Built on the host (a long chunk's slots as one
    gather, not a Python loop over its tokens) and copied without waiting for the device."""
    device = torch.device(device)
    if num_decodes is None:
        num_decodes = 0
        for q in query_lens:
            if q != 1:
                break
            num_decodes += 1
    width = max([len(t) for t in block_tables] + [pad_block_table_to, 1])
    tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int64)
    tables = tables.reshape(len(block_tables), width)
    queries = torch.tensor(query_lens, dtype=torch.int64)
    if sum(query_lens) <= LOOP_TOKENS:
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size
                              for q, ctx, table in zip(query_lens, context_lens, block_tables)
                              for p in range(ctx - q, ctx)], dtype=torch.int64)
    else:
        positions = token_positions(queries, torch.tensor(context_lens, dtype=torch.int64))
        rows = torch.repeat_interleave(torch.arange(len(query_lens)), queries)
        slots = tables[rows, positions // block_size] * block_size + positions % block_size
    starts = torch.zeros(len(query_lens) + 1, dtype=torch.int64)
    torch.cumsum(queries, 0, out=starts[1:])
    return AttentionMetadata(
        num_decodes=num_decodes,
        slot_mapping=to_device(slots, torch.int64, device),
        block_tables=to_device(tables, torch.int32, device),
        context_lens=to_device(context_lens, torch.int32, device),
        query_start_loc=to_device(starts, torch.int32, device),
        max_query_len=max(query_lens, default=0),
        max_context_len=max(context_lens, default=0),
        query_lens_cpu=list(query_lens),
        context_lens_cpu=list(context_lens),
    )
