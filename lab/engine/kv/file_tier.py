"""The file tier under the prefix cache: KV blocks in one file on disk that a restarted engine
with the same model and config reads back.

Layout: a header of HEADER_BYTES (magic, format version, the identity as JSON with its CRC32), then
fixed-size records, one per block: block hash (u64), XXH3-64 of hash + tokens + data (u64), the
block's tokens (int32 each) and its K/V bytes. The identity names the model and its source hash,
the engine's config hash, the block size, the KV dtype and the block's shape, so a file written by
another model, config or format is never read.

Reads: a prefix lookup reads its whole run of blocks at once (`read_run`). Records whose slots
follow each other are read by one sequential read of up to READ_SPAN_BYTES into one of READ_BUFFERS
host buffers (pinned when the KV cache is on a GPU, so the device copies straight from them), and
READERS threads read and verify the next spans while the caller copies this one out (whole records
in one copy; `kv` views their K/V wherever they landed): a resume keeps the disk busy and the step
loop only copies, rather than reading, checking and copying one block at a time.
The checksum is XXH3 because verifying a resumed 100K-token history (12 GiB of Llama-3-8B KV) with
CRC32 alone costs seconds.

Writes never wait for the disk: `put` copies the block into a staging buffer (of a pool of
`staging_bytes` allocated when the tier opens, pinned on a GPU, the device copy asynchronous) and a
writer thread checksums and writes it. When every staging buffer is still waiting for the disk the
block is dropped (it is simply not in the tier, `blocks_dropped` counts it), so a disk slower than
serving costs cache hits, never step time. `read_run` of a block still queued waits for its write,
and `flush`/`close` return once every queued block is in the file (or a failed write has turned the
tier off).

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
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
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


# The largest single read of a run: large enough that a read costs the disk's bandwidth rather
# than its latency, small enough that READ_BUFFERS of them (pinned, on a GPU) are cheap to keep.
READ_SPAN_BYTES = 16 << 20
# Spans in flight: READERS threads each read and verify one while the caller copies another out,
# so the disk always has a read queued while a span is checksummed. A read from the page cache is
# a memory copy on the reading thread, so more readers read faster where there are cores for them
# (a quarter of the host's, two to four: the step loop and the server keep theirs).
READERS = min(4, max(2, (os.cpu_count() or 1) // 4))
READ_BUFFERS = READERS + 1

Key = tuple[int, tuple[int, ...]]  # a block's chained hash and its tokens


def record_bytes(block_size: int, block_bytes: int) -> int:
    return _RECORD.size + 4 * block_size + block_bytes


def _checksum(h: int, tokens: Any, data: Any) -> int:
    digest = xxhash.xxh3_64(h.to_bytes(8, "little"))
    digest.update(tokens)
    digest.update(data)
    return digest.intdigest()


class FileTier:
    def __init__(self, path: Path, identity: dict[str, Any], capacity_blocks: int, block_shape: tuple[int, ...],
                 dtype: torch.dtype, pinned: bool = False, staging_bytes: int = 64 << 20) -> None:
        self.path = path
        self.identity = identity
        self.capacity = capacity_blocks
        self.block_shape = block_shape
        self.dtype = dtype
        self.block_size = identity["block_size"]
        self.block_bytes = int(np.prod(block_shape)) * torch.empty((), dtype=dtype).element_size()
        self.record = record_bytes(self.block_size, self.block_bytes)
        self._data_at = _RECORD.size + 4 * self.block_size
        # Pinned memory lets the device copy blocks straight from the buffers the file was read
        # into, and into the buffers the writer thread writes from.
        self._pinned = pinned
        self.span_blocks = max(1, min(capacity_blocks, READ_SPAN_BYTES // self.record))
        # Touched now: a resume after a restart is the tier's first read, and faulting in fresh
        # pages as the disk fills them would halve its rate.
        self._read_buffers = [torch.zeros(self.span_blocks * self.record, dtype=torch.uint8, pin_memory=pinned)
                              for _ in range(READ_BUFFERS)]
        self._reader: ThreadPoolExecutor | None = None
        self.staging_blocks = max(1, staging_bytes // self.block_bytes)
        # Allocated and touched now, so no write of a long turn pays for new pages (or, on a GPU
        # host, a pinned allocation) on the step loop.
        self._staging = torch.zeros((self.staging_blocks, self.block_bytes), dtype=torch.uint8, pin_memory=pinned)
        self._free_buffers: queue.LifoQueue[torch.Tensor] = queue.LifoQueue()
        for buffer in self._staging:
            self._free_buffers.put(buffer)
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
        self.blocks_dropped = 0  # blocks not written because every staging buffer was waiting for the disk
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

    def read_run(self, keys: Sequence[Key]) -> Iterator[tuple[int, torch.Tensor]]:
        """`keys`' records in order, verified, one span at a time: each span is (position in `keys`
        of its first block, its records as a [blocks, record] byte view of a read buffer, `kv`
        gives their K/V), valid until the next span is asked for. Stops at the first block absent
        or damaged (a damaged one empties the file, with one warning)."""
        self._surface_write_error()
        slots = []
        for h, tokens in keys:
            slot = self.index.slot(h, tokens)
            if slot is None:
                break
            slots.append(slot)
        for h, _ in keys[:len(slots)]:
            written = self._pending.pop(h, None)
            if written is not None:
                written.wait()  # queued for the writer: its record is not in the file yet
        self._surface_write_error()
        if not slots or not self.enabled:
            return
        spans = self._spans(slots)
        reads: list[Future[int | None]] = [self._read(spans[k], k, keys) for k in range(min(READ_BUFFERS, len(spans)))]
        unreadable = damaged = None
        try:
            for k, (first, _, count) in enumerate(spans):
                try:
                    bad = reads[k].result()
                except OSError as exc:
                    unreadable = f"cannot be read ({exc})"
                    return
                good = count if bad is None else bad
                for i in range(good):
                    self.index.move_to_end(keys[first + i][0])
                if good:
                    yield first, self._read_buffers[k % READ_BUFFERS][:good * self.record].view(good, self.record)
                if bad is not None:
                    damaged = keys[first + bad][0]
                    return
                if k + READ_BUFFERS < len(spans):  # the caller is done with this buffer: read ahead into it
                    reads.append(self._read(spans[k + READ_BUFFERS], k + READ_BUFFERS, keys))
        finally:
            for read in reads:  # no read may still be filling a buffer or using the descriptor
                read.exception()
            if damaged is not None:
                log.warning("KV file tier %s: block %016x fails its checksum; ignoring the file's blocks and "
                            "starting an empty file", self.path, damaged)
                self._reset_after_damage()
            elif unreadable is not None:
                self._disable(unreadable)

    def kv(self, records: torch.Tensor) -> torch.Tensor:
        """The K/V in `records` (a span from `read_run`, or its copy on a device): a
        [blocks, *block_shape] view, strided past each record's head. Whole records travel to the
        device in one contiguous copy; the view is taken there."""
        return records[:, self._data_at:].view(self.dtype).view(len(records), *self.block_shape)

    def _spans(self, slots: list[int]) -> list[tuple[int, int, int]]:
        """(first position, first slot, count) of each run of consecutive slots, at most
        span_blocks long."""
        spans: list[tuple[int, int, int]] = []
        for i, slot in enumerate(slots):
            if spans and slot == slots[i - 1] + 1 and spans[-1][2] < self.span_blocks:
                first, first_slot, count = spans[-1]
                spans[-1] = (first, first_slot, count + 1)
            else:
                spans.append((i, slot, 1))
        return spans

    def _read(self, span: tuple[int, int, int], k: int, keys: Sequence[Key]) -> Future[int | None]:
        """Read a span's records into read buffer k % READ_BUFFERS and verify them, on a reader thread (both
        the read and the checksum leave the GIL to the step loop): the position within the span of
        the first record that is short or fails its checksum, or None."""
        if self._reader is None:
            self._reader = ThreadPoolExecutor(READERS, thread_name_prefix="kv-file-tier-reader")
        assert self.fd is not None
        first, slot, count = span
        raw = memoryview(self._read_buffers[k % READ_BUFFERS].numpy())[:count * self.record]
        fd = self.fd

        def read() -> int | None:
            got = os.preadv(fd, [raw], HEADER_BYTES + slot * self.record)
            for i in range(count):
                at = i * self.record
                if at + self.record > got or not self._verify(raw[at:at + self.record], *keys[first + i]):
                    return i
            return None

        return self._reader.submit(read)

    def _verify(self, raw: memoryview, h: int, tokens: tuple[int, ...]) -> bool:
        stored_h, checksum = _RECORD.unpack_from(raw)
        tok, data = raw[_RECORD.size:self._data_at], raw[self._data_at:]
        return (stored_h == h and tok.tobytes() == np.asarray(tokens, dtype="<i4").tobytes()
                and _checksum(h, tok, data) == checksum)

    def _reset_after_damage(self) -> None:
        try:
            self._start_empty()
        except OSError as exc:
            self._disable(f"cannot be rewritten ({exc})")

    def put(self, h: int, tokens: tuple[int, ...], block: torch.Tensor) -> None:
        """Stage the block's K/V in a host buffer (the caller may reuse `block` on return) and queue
        its record for the writer thread, which checksums and writes it off the step loop. With
        every staging buffer still waiting for the disk, the block is dropped instead."""
        self._surface_write_error()
        if not self.enabled or h in self.index:
            if self.enabled:
                self.index.move_to_end(h)
            return
        staged = self._take_buffer()
        if staged is None:
            self.blocks_dropped += 1
            return
        if self.free:
            slot = self.free.pop()
        elif self.num_slots < self.capacity:
            slot = self.num_slots
        else:
            _, (slot, _) = self.index.popitem(last=False)
        # From a GPU the copy is queued on the stream behind the kernels that wrote the block; the
        # writer thread waits for it, not the step loop.
        staged.view(self.dtype).view(self.block_shape).copy_(block.detach(), non_blocking=block.is_cuda)
        copied = None
        if block.is_cuda:
            copied = torch.cuda.Event()
            copied.record()
        if len(self._pending) > 4 * self.staging_blocks:
            self._pending = {k: e for k, e in self._pending.items() if not e.is_set()}
        written = self._pending[h] = threading.Event()
        self.num_slots = max(self.num_slots, slot + 1)
        self.index[h] = (slot, tokens)
        self.blocks_queued += 1
        self._writes.put((h, np.asarray(tokens, dtype="<i4").tobytes(), slot, staged, copied, written))
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
        if self._reader is not None:
            self._reader.shutdown()
            self._reader = None

    def clear(self) -> None:
        self._drain()
        self._surface_write_error()
        if self.enabled:
            try:
                self._start_empty()
            except OSError as exc:
                self._disable(f"cannot be emptied ({exc})")

    # -- the writer thread -------------------------------------------------------------------

    def _take_buffer(self) -> torch.Tensor | None:
        """A free staging buffer; None when all of them are waiting for the disk."""
        try:
            return self._free_buffers.get_nowait()
        except queue.Empty:
            return None

    def _write_loop(self) -> None:
        while (item := self._writes.get()) is not None:
            h, tok, slot, staged, copied, written = item
            try:
                if copied is not None:
                    copied.synchronize()
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
