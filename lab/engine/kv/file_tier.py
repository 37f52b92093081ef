"""The file tier under the prefix cache: KV blocks in one file on disk that a restarted engine
with the same model and config reads back.

Layout: a header of HEADER_BYTES (magic, format version, the identity as JSON with its CRC32), then
fixed-size records, one per block: block hash (u64), XXH3-64 of hash + tokens + data (u64), the
block's tokens (int32 each) and its K/V bytes. A block read goes through one reusable host buffer,
a block written through one of WRITE_BUFFERS, all pinned when the KV cache is on a GPU, so a block
moves between the file and the device without an extra host copy; the checksum is XXH3 because
verifying a resumed 100K-token history (12 GiB of Llama-3-8B KV) with CRC32 alone costs seconds.
Writes run on a writer thread, off the step loop: `put` stages the block and returns, `get` of a
block still queued waits for its write, and `flush`/`close` return once every queued block is in
the file (or a failed write has turned the tier off). The identity names the model and its source
hash, the engine's config hash, the block size, the KV dtype and the block's shape, so a file
written by another model, config or format is never read.

Nothing here may put wrong K/V into the cache or stop the engine:
- a file that is not a tier file (no magic) is left untouched and the engine runs without the
  file tier; a tier file of another identity or version, with a bad header or a partial record
  (truncated) is replaced by an empty one; either way with one warning;
- each record's checksum is verified when the block is read, before it reaches the KV pool; a
  mismatch empties the file, with one warning;
- a write that fails (disk full, file-size limit, I/O error) turns the file tier off, with one
  warning; the engine carries on with the tiers above.
No fsync: a crash may leave a torn record, which its checksum catches.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import struct
import threading
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

from lab.engine.kv.tier_index import BlockIndex

log = logging.getLogger(__name__)

MAGIC = b"LABKVTIER\n"
FORMAT_VERSION = 2
HEADER_BYTES = 4096
_HEADER = struct.Struct("<II")  # format version, identity JSON length; then the JSON and its CRC32
_RECORD = struct.Struct("<QQ")  # block hash, XXH3-64


# Blocks staged for the writer thread at once; a put waits for a free buffer beyond that, so a
# disk slower than the device bounds the memory held and slows the step, never drops a block.
WRITE_BUFFERS = 8


def record_bytes(block_size: int, block_bytes: int) -> int:
    return _RECORD.size + 4 * block_size + block_bytes


def _checksum(h: int, tokens: Any, data: Any) -> int:
    digest = xxhash.xxh3_64(h.to_bytes(8, "little"))
    digest.update(tokens)
    digest.update(data)
    return digest.intdigest()


class FileTier:
    def __init__(self, path: Path, identity: dict[str, Any], capacity_blocks: int, block_shape: tuple[int, ...],
                 dtype: torch.dtype, pinned: bool = False) -> None:
        self.path = path
        self.identity = identity
        self.capacity = capacity_blocks
        self.block_shape = block_shape
        self.dtype = dtype
        self.block_size = identity["block_size"]
        self.block_bytes = int(np.prod(block_shape)) * torch.empty((), dtype=dtype).element_size()
        self.record = record_bytes(self.block_size, self.block_bytes)
        # Pinned memory lets the device copy a block straight from the buffer the file was read into,
        # and into the buffers the writer thread writes from.
        self._buffer = torch.empty(self.record, dtype=torch.uint8, pin_memory=pinned)
        self._data_at = _RECORD.size + 4 * self.block_size
        self._pinned = pinned
        self._free_buffers: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()
        self._buffers_made = 0
        self._writes: queue.Queue = queue.Queue()
        self._writer: threading.Thread | None = None
        self._pending: dict[int, threading.Event] = {}  # hash -> its record is in the file
        self._write_error: OSError | None = None  # the writer thread's first failure
        self._count_lock = threading.Lock()
        self.index = BlockIndex()
        self.free: list[int] = []  # slots of records dropped from the index, reused first
        self.num_slots = 0  # records in the file
        self.blocks_found = 0  # valid blocks found at open, written by an earlier engine
        self.blocks_written = 0  # blocks this engine wrote (the writer thread counts them)
        self.blocks_queued = 0  # blocks this engine handed to the writer
        self.disabled: str | None = None  # why the file tier is off
        self.fd: int | None = None
        self._open()

    # -- open --------------------------------------------------------------------------------

    def _open(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            size = os.fstat(self.fd).st_size
            if size == 0:
                self._start_empty()
                return
            head = os.pread(self.fd, HEADER_BYTES, 0)
            if not head.startswith(MAGIC):
                self._disable("is not a KV tier file (no magic); leaving it untouched")
                return
            problem = self._check_header(head) or self._check_size(size)
            if problem:
                log.warning("KV file tier %s: %s; ignoring its blocks and starting an empty file", self.path, problem)
                self._start_empty()
                return
            self._scan((size - HEADER_BYTES) // self.record)
        except OSError as exc:
            self._disable(f"cannot be used ({exc})")

    def _check_header(self, head: bytes) -> str | None:
        if len(head) < len(MAGIC) + _HEADER.size:
            return "truncated header"
        version, length = _HEADER.unpack_from(head, len(MAGIC))
        if version != FORMAT_VERSION:
            return f"format version {version}, this engine reads {FORMAT_VERSION}"
        start = len(MAGIC) + _HEADER.size
        if start + length + 4 > len(head):
            return "truncated header"
        blob = head[start:start + length]
        (crc,) = struct.unpack_from("<I", head, start + length)
        if zlib.crc32(blob) != crc:
            return "header checksum mismatch"
        found = json.loads(blob)
        differs = [f"{k} {found.get(k)!r} != {v!r}" for k, v in self.identity.items() if found.get(k) != v]
        return f"written for another engine ({'; '.join(differs)})" if differs else None

    def _check_size(self, size: int) -> str | None:
        body = size - HEADER_BYTES
        if body < 0 or body % self.record:
            return f"truncated ({body % self.record if body > 0 else size} bytes of a partial record or header)"
        if body // self.record > self.capacity:
            return f"holds {body // self.record} blocks, more than the {self.capacity} configured"
        return None

    def _scan(self, n: int) -> None:
        head = _RECORD.size + 4 * self.block_size
        for slot in range(n):
            raw = os.pread(self.fd, head, HEADER_BYTES + slot * self.record)
            h, _ = _RECORD.unpack_from(raw)
            tokens = tuple(np.frombuffer(raw, dtype="<i4", offset=_RECORD.size).tolist())
            self.index.pop(h, None)
            self.index[h] = (slot, tokens)
        self.num_slots = n
        self.free = sorted(set(range(n)) - {slot for slot, _ in self.index.values()}, reverse=True)
        self.blocks_found = len(self.index)
        log.info("KV file tier %s: %d blocks from an earlier engine", self.path, self.blocks_found)

    def _start_empty(self) -> None:
        self._drain()  # no queued record may land in the emptied file
        blob = json.dumps(self.identity, sort_keys=True).encode()
        head = MAGIC + _HEADER.pack(FORMAT_VERSION, len(blob)) + blob + struct.pack("<I", zlib.crc32(blob))
        if len(head) > HEADER_BYTES:
            raise OSError(f"the identity needs a {len(head)}-byte header, more than {HEADER_BYTES}")
        if os.fstat(self.fd).st_size:
            os.ftruncate(self.fd, 0)
        if os.pwrite(self.fd, head.ljust(HEADER_BYTES, b"\0"), 0) != HEADER_BYTES:
            raise OSError("the header was written short")
        self.index.clear()
        self.free = []
        self.num_slots = 0

    def _disable(self, why: str) -> None:
        self._drain()  # the writer thread may hold the descriptor
        log.warning("KV file tier %s %s; running without the file tier", self.path, why)
        self.disabled = why
        self.index.clear()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    # -- blocks ------------------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        return self.disabled is None

    def __len__(self) -> int:
        return len(self.index)

    def __contains__(self, key: tuple[int, tuple[int, ...]]) -> bool:
        return self.index.slot(*key) is not None

    def get(self, h: int, tokens: tuple[int, ...]) -> torch.Tensor | None:
        """The block's K/V on the host, verified; None when absent or damaged. The tensor is a view
        of the tier's read buffer: valid until the next `get`, so copy it out first."""
        self._surface_write_error()
        slot = self.index.slot(h, tokens)
        if slot is None:
            return None
        written = self._pending.pop(h, None)
        if written is not None:
            written.wait()  # queued for the writer: its record is not in the file yet
            self._surface_write_error()
            if not self.enabled:
                return None
        raw = memoryview(self._buffer.numpy())
        try:
            got = os.preadv(self.fd, [raw], HEADER_BYTES + slot * self.record)
        except OSError as exc:
            self._disable(f"cannot be read ({exc})")
            return None
        tok = raw[_RECORD.size:self._data_at]
        data = raw[self._data_at:]
        stored_h, checksum = _RECORD.unpack_from(raw) if got == self.record else (None, None)
        if (stored_h != h or tok.tobytes() != np.asarray(tokens, dtype="<i4").tobytes()
                or _checksum(h, tok, data) != checksum):
            log.warning("KV file tier %s: block %016x fails its checksum; ignoring the file's blocks and "
                        "starting an empty file", self.path, h)
            try:
                self._start_empty()
            except OSError as exc:
                self._disable(f"cannot be rewritten ({exc})")
            return None
        self.index.move_to_end(h)
        return self._buffer[self._data_at:].view(self.dtype).view(self.block_shape)

    def put(self, h: int, tokens: tuple[int, ...], block: torch.Tensor) -> None:
        """Stage the block's K/V in a host buffer (the caller may reuse `block` on return) and queue
        its record for the writer thread, which checksums and writes it off the step loop."""
        self._surface_write_error()
        if not self.enabled or h in self.index:
            if self.enabled:
                self.index.move_to_end(h)
            return
        if self.free:
            slot = self.free.pop()
        elif self.num_slots < self.capacity:
            slot = self.num_slots
        else:
            _, (slot, _) = self.index.popitem(last=False)
        staged = self._take_buffer()
        staged.view(self.dtype).view(self.block_shape).copy_(block.detach())
        if len(self._pending) > 4 * WRITE_BUFFERS:
            self._pending = {k: e for k, e in self._pending.items() if not e.is_set()}
        written = self._pending[h] = threading.Event()
        self.num_slots = max(self.num_slots, slot + 1)
        self.index[h] = (slot, tokens)
        self.blocks_queued += 1
        self._writes.put((h, np.asarray(tokens, dtype="<i4").tobytes(), slot, staged, written))
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_loop, name="kv-file-tier-writer", daemon=True)
            self._writer.start()

    def flush(self) -> None:
        """Return once every queued block is in the file, or the tier has turned off because a
        write failed (with its one warning)."""
        self._drain()
        self._surface_write_error()

    def close(self) -> None:
        self.flush()
        if self._writer is not None:
            self._writes.put(None)
            self._writer.join()
            self._writer = None

    def clear(self) -> None:
        self._drain()
        self._surface_write_error()
        if self.enabled:
            try:
                self._start_empty()
            except OSError as exc:
                self._disable(f"cannot be emptied ({exc})")

    # -- the writer thread -------------------------------------------------------------------

    def _take_buffer(self) -> torch.Tensor:
        try:
            return self._free_buffers.get_nowait()
        except queue.Empty:
            if self._buffers_made < WRITE_BUFFERS:
                self._buffers_made += 1
                return torch.empty(self.block_bytes, dtype=torch.uint8, pin_memory=self._pinned)
            return self._free_buffers.get()

    def _write_loop(self) -> None:
        while (item := self._writes.get()) is not None:
            h, tok, slot, staged, written = item
            try:
                if self._write_error is None:
                    data = staged.numpy()
                    wrote = os.pwritev(self.fd, [_RECORD.pack(h, _checksum(h, tok, data)), tok, data],
                                       HEADER_BYTES + slot * self.record)
                    if wrote != self.record:  # a file-size limit cuts a write short before refusing the next
                        raise OSError(f"wrote {wrote} of {self.record} bytes")
                    with self._count_lock:
                        self.blocks_written += 1
            except OSError as exc:
                self._write_error = exc  # turned into `_disable` on the engine's thread
            finally:
                self._free_buffers.put(staged)
                written.set()
                self._writes.task_done()
        self._writes.task_done()

    def _drain(self) -> None:
        if self._writer is not None:
            self._writes.join()

    def _surface_write_error(self) -> None:
        if self._write_error is not None and self.enabled:
            self._drain()
            self._disable(f"cannot be written ({self._write_error})")
