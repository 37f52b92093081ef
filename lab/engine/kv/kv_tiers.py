"""The tiers under the prefix cache: the device KV pool on top, then host memory (`host_tier.py`),
then a file (`file_tier.py`). The block manager asks here for a full block it does not hold; a
block found below is copied back into a device block instead of being recomputed.

Write policy: `write-through` copies every block the prefix cache registers to each lower tier at
once, so a restarted engine finds all of it in the file; `on-evict` copies a block down only when
the tier above evicts it (device -> host -> file), which writes less but leaves the file holding
only what overflowed host memory. Each tier evicts least recently used first on its own.

A prefix lookup loads its whole run of lower-tier blocks at once (`load_run`): each run of
consecutive host slots, and each of the file tier's sequential spans (the next read while this one
is copied), goes to the device in one copy and is scattered into its blocks there."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from lab.engine.cache_dir import cache_root
from lab.engine.core.config import ConfigError, EngineConfig
from lab.engine.kv.file_tier import FileTier, Key, record_bytes
from lab.engine.kv.host_tier import HostTier

log = logging.getLogger(__name__)

HOST, FILE = "host", "file"  # the names hit counts go under (block_manager.TIERS)
# The file tier's staging by default, at most the tier's size and a sixteenth of the host's memory:
# on a GPU a prefill makes KV faster than a page cache takes it (on the H200 host, about twice as
# fast: docs/performance.md), so a long conversation's (a 100K-token one is 12 GiB) waits there
# for the disk instead of being dropped; a CPU engine makes KV a hundred times slower, and its
# memory is the engine's own.
DEFAULT_STAGING_BYTES = {"cuda": 8 << 30, "cpu": 256 << 20}
# The most host blocks one copy to the device moves (of Llama-3-8B's, 2 MiB each: 128 MiB).
COPY_BLOCKS = 64


def file_tier_path(config: EngineConfig) -> Path:
    if config.kv_file_tier_path:
        return Path(config.kv_file_tier_path)
    return cache_root() / "kv-tiers" / f"{config.hash}.kvtier"


class KVTiers:
    def __init__(self, kv_cache: torch.Tensor, policy: str, host: HostTier | None, file: FileTier | None) -> None:
        self.kv_cache = kv_cache  # [layers, 2, blocks, block_size, kv_heads, head_dim]
        self.write_through = policy == "write-through"
        self.host = host
        self.file = file
        if host is not None and file is not None and not self.write_through:
            host.on_evict = file.put  # host overflow spills to the file

    def _block(self, block_id: int) -> torch.Tensor:
        return self.kv_cache[:, :, block_id]

    def find(self, h: int, tokens: tuple[int, ...]) -> str | None:
        """Which lower tier holds the block, without reading it."""
        if self.host is not None and (h, tokens) in self.host:
            return HOST
        if self.file is not None and (h, tokens) in self.file:
            return FILE
        return None

    def load_run(self, keys: Sequence[Key], block_ids: Sequence[int]) -> list[str]:
        """Copy `keys`' blocks into device blocks `block_ids`, in order, stopping at the first that
        no tier could give (absent, or the file's copy failed its checksum); returns the tier each
        loaded block came from."""
        origins: list[str] = []
        while len(origins) < len(keys):
            i = len(origins)
            slots = []  # the host's stretch from here
            while self.host is not None and i + len(slots) < len(keys):
                slot = self.host.take(*keys[i + len(slots)])
                if slot is None:
                    break
                slots.append(slot)
            if slots:
                self._copy_host(slots, block_ids[i:i + len(slots)])
                origins += [HOST] * len(slots)
                continue
            end = i + 1  # the stretch of blocks the host does not hold: the file's to read
            while end < len(keys) and not (self.host is not None and keys[end] in self.host):
                end += 1
            for first, records in self.file.read_run(keys[i:end]) if self.file is not None else ():
                self._scatter(records, block_ids[i + first:i + first + len(records)], self.file.kv)
                self._copied()  # the read buffer is reused once the next span is asked for
                origins += [FILE] * len(records)
            if len(origins) < end:
                break
        self._copied()
        return origins

    def _copy_host(self, slots: list[int], block_ids: Sequence[int]) -> None:
        """Each run of consecutive host slots goes to the device in one copy (pinned: asynchronous)."""
        assert self.host is not None
        start = 0
        for k in range(1, len(slots) + 1):
            if k == len(slots) or slots[k] != slots[k - 1] + 1 or k - start == COPY_BLOCKS:
                self._scatter(self.host.pool[slots[start]:slots[k - 1] + 1], block_ids[start:k])
                start = k

    def _scatter(self, data: torch.Tensor, block_ids: Sequence[int],
                 kv: Callable[[torch.Tensor], torch.Tensor] = lambda blocks: blocks) -> None:
        """Contiguous host `data` holding blocks into device blocks `block_ids`, in one copy to the
        device (a 100K-token history is 6,250 blocks); `kv` views the blocks' K/V, [n, *block_shape],
        in `data` or in its copy on the device."""
        if self.kv_cache.is_cuda:
            data = data.to(self.kv_cache.device, non_blocking=True)
        blocks, first = kv(data), block_ids[0]
        if list(block_ids) == list(range(first, first + len(block_ids))):
            self.kv_cache[:, :, first:first + len(block_ids)].copy_(blocks.movedim(0, 2))
        elif self.kv_cache.is_cuda:  # one kernel, not one launch per block
            ids = torch.tensor(block_ids, dtype=torch.long).to(self.kv_cache.device, non_blocking=True)
            self.kv_cache.index_copy_(2, ids, blocks.movedim(0, 2))
        else:  # on a CPU index_copy_ moves these strided blocks slower than one copy_ each
            for k, block_id in enumerate(block_ids):
                self.kv_cache[:, :, block_id].copy_(blocks[k])

    def _copied(self) -> None:
        """Wait for the copies queued to the device (from pinned buffers they are asynchronous)."""
        if self.kv_cache.is_cuda:
            torch.cuda.current_stream(self.kv_cache.device).synchronize()

    def on_registered(self, h: int, tokens: tuple[int, ...], block_id: int) -> None:
        """A device block just became a full prefix-cache block."""
        if not self.write_through:
            return
        block = self._block(block_id)
        if self.host is not None:
            self.host.put(h, tokens, block)
        if self.file is not None:
            self.file.put(h, tokens, self.host.get(h, tokens) if self.host is not None else block)

    def on_evicted(self, h: int, tokens: tuple[int, ...], block_id: int) -> None:
        """The device is about to reuse a cached block."""
        if self.write_through:
            return
        if self.host is not None:
            self.host.put(h, tokens, self._block(block_id))
        elif self.file is not None:
            self.file.put(h, tokens, self._block(block_id))

    def flush(self) -> None:
        """Every block handed to the file tier is in the file (or the tier is off)."""
        if self.file is not None:
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()

    def clear(self) -> None:
        for tier in (self.host, self.file):
            if tier is not None:
                tier.clear()

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"write_policy": "write-through" if self.write_through else "on-evict"}
        if self.host is not None:
            out[HOST] = {"blocks": len(self.host), "capacity_blocks": self.host.capacity,
                         "blocks_written": self.host.blocks_written}
        if self.file is not None:
            f = self.file
            out[FILE] = {"path": str(f.path), "enabled": f.enabled, "disabled_because": f.disabled,
                         "blocks": len(f), "capacity_blocks": f.capacity, "blocks_found_at_start": f.blocks_found,
                         "blocks_written": f.blocks_written, "blocks_queued": f.blocks_queued,
                         "blocks_dropped": f.blocks_dropped, "staging_blocks": f.staging_blocks}
        return out


def build_tiers(config: EngineConfig, kv_cache: torch.Tensor, identity: dict[str, Any]) -> KVTiers | None:
    """The tiers the config asks for, or None when both are off. `identity` names the model
    (`model`, `source_hash`); the rest of a file's identity comes from the config and the pool."""
    if not (config.kv_host_tier_bytes or config.kv_file_tier_bytes):
        return None
    block_shape = (kv_cache.shape[0], kv_cache.shape[1], *kv_cache.shape[3:])
    elem = kv_cache.element_size()
    block_bytes = int(torch.Size(block_shape).numel()) * elem
    host = file = None
    if config.kv_host_tier_bytes:
        blocks = config.kv_host_tier_bytes // block_bytes
        if blocks < 1:
            raise ConfigError(f"--kv-host-tier-bytes {config.kv_host_tier_bytes} holds no KV block "
                              f"({block_bytes} bytes each)")
        host = HostTier(blocks, block_shape, kv_cache.dtype, pin=kv_cache.is_cuda)
    if config.kv_file_tier_bytes:
        record = record_bytes(config.block_size, block_bytes)
        blocks = config.kv_file_tier_bytes // record
        if blocks < 1:
            raise ConfigError(f"--kv-file-tier-bytes {config.kv_file_tier_bytes} holds no KV block "
                              f"({record} bytes each)")
        full_identity = {**identity, "config_hash": config.hash, "block_size": config.block_size,
                         "kv_dtype": str(kv_cache.dtype).removeprefix("torch."), "kv_block_shape": list(block_shape)}
        staging = config.kv_file_tier_staging_bytes or min(
            config.kv_file_tier_bytes, DEFAULT_STAGING_BYTES[kv_cache.device.type],
            os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 16)
        file = FileTier(file_tier_path(config), full_identity, blocks, block_shape, kv_cache.dtype,
                        pinned=kv_cache.is_cuda, staging_bytes=staging)
    tiers = KVTiers(kv_cache, config.kv_tier_write_policy, host, file)
    log.info("KV tiers under the prefix cache (%s): %s", config.kv_tier_write_policy,
             {k: v.get("capacity_blocks") for k, v in tiers.stats().items() if isinstance(v, dict)})
    return tiers
