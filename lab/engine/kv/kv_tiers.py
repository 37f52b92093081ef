"""The tiers under the prefix cache: the device KV pool on top, then host memory (`host_tier.py`),
then a file (`file_tier.py`). The block manager asks here for a full block it does not hold; a
block found below is copied back into a device block instead of being recomputed.

Write policy: `write-through` copies every block the prefix cache registers to each lower tier at
once, so a restarted engine finds all of it in the file; `on-evict` copies a block down only when
the tier above evicts it (device -> host -> file), which writes less but leaves the file holding
only what overflowed host memory. Each tier evicts least recently used first on its own."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from lab.engine.cache_dir import cache_root
from lab.engine.core.config import ConfigError, EngineConfig
from lab.engine.kv.file_tier import FileTier, record_bytes
from lab.engine.kv.host_tier import HostTier

log = logging.getLogger(__name__)

HOST, FILE = "host", "file"  # the names hit counts go under (block_manager.TIERS)


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

    def load(self, h: int, tokens: tuple[int, ...], block_id: int) -> str | None:
        """Copy the block into device block `block_id`; returns the tier it came from, or None
        when no tier could give it (absent, or the file's copy failed its checksum)."""
        for name, tier in ((HOST, self.host), (FILE, self.file)):
            data = tier.get(h, tokens) if tier is not None else None
            if data is not None:
                self._block(block_id).copy_(data)
                return name
        return None

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
                         "blocks_written": f.blocks_written, "blocks_queued": f.blocks_queued}
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
        file = FileTier(file_tier_path(config), full_identity, blocks, block_shape, kv_cache.dtype,
                        pinned=kv_cache.is_cuda)
    tiers = KVTiers(kv_cache, config.kv_tier_write_policy, host, file)
    log.info("KV tiers under the prefix cache (%s): %s", config.kv_tier_write_policy,
             {k: v.get("capacity_blocks") for k, v in tiers.stats().items() if isinstance(v, dict)})
    return tiers
