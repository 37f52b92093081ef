"""The KV file tier's reads and writes against this host's ceilings for the same bytes.

Ceilings, the best of two passes of sequential 64 MiB requests on a file in `--dir`: the page
cache's write rate (no fsync, as the tier writes), its read rate (the file read again, with as many
reads in flight as the tier keeps), the disk's read rate (the same, after `posix_fadvise(DONTNEED)`
evicted the file from the page cache) and a copy from host memory (pinned, to the device, on a
GPU). Then the tier
on a file of `--blocks` blocks of Llama-3-8B's shape (32 layers x K/V x 16 tokens x 8 heads x 128,
bf16: 2 MiB): `put` of every block (when the puts returned, when every block was in the file, how
many were dropped), then a fresh `FileTier` on that file reads the whole run back as a prefix
lookup does (`read_run`, each block copied into a KV pool block on the device), from the page
cache and from the disk; last, the host-memory tier holding the same blocks gives them back the
same way. Each tier figure is printed as a fraction of its ceiling.

    PYTHONPATH=. python benchmarks/file_tier_io.py [--blocks 400] [--dir /tmp] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from lab.engine.kv.file_tier import READERS, FileTier
from lab.engine.kv.host_tier import HostTier
from lab.engine.kv.kv_tiers import KVTiers

SHAPE = (32, 2, 16, 8, 128)
IDENTITY = {"model": "file-tier-io", "block_size": 16}
CHUNK = 64 << 20
# What bounds a resume from the host-memory tier on each device.
MEMORY = {"cpu": "host memory copy", "cuda": "pinned host-to-device copy"}


def timed(work: Callable[[], object]) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def best(work: Callable[[], object], before: Callable[[], object] = lambda: None) -> float:
    """The shorter of two timed passes, `before` run ahead of each."""
    return min(before() or timed(work) for _ in range(2))


def evict(path: Path) -> None:
    """Drop the file's pages from the page cache (written back first), so the next read is the disk's."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def ceilings(where: Path, size: int, device: torch.device) -> dict[str, float]:
    """Bytes per second of each ceiling, with `size` bytes moved."""
    path = where / "ceiling.bin"
    chunk = torch.randint(0, 256, (CHUNK,), dtype=torch.uint8).numpy()
    into = [memoryview(bytearray(CHUNK)) for _ in range(READERS)]
    chunks = max(1, size // CHUNK)

    def write() -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        for i in range(chunks):
            os.pwrite(fd, chunk, i * CHUNK)
        os.close(fd)

    def read() -> None:  # as many reads in flight as the tier keeps
        fd = os.open(path, os.O_RDONLY)
        with ThreadPoolExecutor(READERS) as pool:
            list(pool.map(lambda i: os.preadv(fd, [into[i % READERS]], i * CHUNK), range(chunks)))
        os.close(fd)

    out = {"page-cache write": chunks * CHUNK / best(write)}
    out["page-cache read"] = chunks * CHUNK / best(read)
    out["disk read"] = chunks * CHUNK / best(read, before=lambda: evict(path))
    path.unlink()
    source = torch.ones(CHUNK, dtype=torch.uint8, pin_memory=device.type == "cuda")
    target = torch.zeros(CHUNK, dtype=torch.uint8, device=device)

    def copy() -> None:
        for _ in range(chunks):
            target.copy_(source, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    out[MEMORY[device.type]] = chunks * CHUNK / best(copy)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=400)
    ap.add_argument("--dir", type=Path, default=None, help="where the files go (default: the system's temp dir)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    device = torch.device(args.device)
    where = Path(tempfile.mkdtemp(dir=args.dir))
    try:
        path = where / "io.kvtier"
        size = args.blocks * torch.Size(SHAPE).numel() * 2
        ceiling = ceilings(where, size, device)
        pool = torch.zeros((SHAPE[0], SHAPE[1], args.blocks, *SHAPE[2:]), dtype=torch.bfloat16, device=device)
        pool.normal_()
        keys = [(h, tuple(range(h * 16, h * 16 + 16))) for h in range(1, args.blocks + 1)]
        pinned = device.type == "cuda"
        writer = FileTier(path, IDENTITY, args.blocks, SHAPE, torch.bfloat16, pinned=pinned, staging_bytes=2 << 30)
        started = time.perf_counter()
        for i, (h, tokens) in enumerate(keys):
            writer.put(h, tokens, pool[:, :, i])
        returned = time.perf_counter() - started
        writer.close()
        written = time.perf_counter() - started
        bytes_ = len(keys) * writer.block_bytes
        print(f"{device} {args.blocks} blocks, {bytes_ / 2**30:.2f} GiB, file in {where.parent}")
        for name, rate in ceiling.items():
            print(f"  ceiling {name:27s} {rate / 2**30:7.2f} GiB/s")
        kept = writer.blocks_written * writer.block_bytes
        print(f"  tier puts returned after {returned:.3f} s; all written after {written:.3f} s: "
              f"{kept / written / 2**30:.2f} GiB/s, {kept / written / ceiling['page-cache write']:.2f} of the "
              f"page-cache write; {writer.blocks_dropped} of {len(keys)} dropped (staging: "
              f"{writer.staging_blocks} blocks)")
        # A burst faster than the disk drops what the staging cannot hold; write those again, a
        # staging's worth at a time, so that the resumes below read the whole run.
        refill = FileTier(path, IDENTITY, args.blocks, SHAPE, torch.bfloat16, pinned=pinned, staging_bytes=2 << 30)
        missing = [i for i, key in enumerate(keys) if key not in refill]
        for at in range(0, len(missing), refill.staging_blocks):
            for i in missing[at:at + refill.staging_blocks]:
                refill.put(*keys[i], pool[:, :, i])
            refill.flush()
        refill.close()
        into = torch.zeros_like(pool)  # touched now: page faults are not the tier's
        loaded: list[int] = []
        block_ids = list(range(args.blocks))
        for source, ceiling_name in (("page cache", "page-cache read"), ("disk", "disk read")):
            if source == "disk":
                evict(path)
            reader = FileTier(path, IDENTITY, args.blocks, SHAPE, torch.bfloat16, pinned=pinned)
            tiers = KVTiers(into, "write-through", None, reader)
            took = timed(lambda: loaded.append(len(tiers.load_run(keys, block_ids))))
            reader.close()
            assert loaded.pop() == len(keys), "the file did not hold the whole run"
            assert torch.equal(into, pool), "the tier read back other K/V than it wrote"
            print(f"  tier resume from the {source:10s} {took:.3f} s: {bytes_ / took / 2**30:.2f} GiB/s, "
                  f"{bytes_ / took / ceiling[ceiling_name]:.2f} of the {ceiling_name}")
        host = HostTier(args.blocks, SHAPE, torch.bfloat16, pin=pinned)
        for i, (h, tokens) in enumerate(keys):
            host.put(h, tokens, pool[:, :, i])
        into.zero_()
        tiers = KVTiers(into, "write-through", host, None)
        took = timed(lambda: tiers.load_run(keys, block_ids))
        assert torch.equal(into, pool), "the host tier gave back other K/V than it kept"
        print(f"  tier resume from host memory {took:.3f} s: {bytes_ / took / 2**30:.2f} GiB/s, "
              f"{bytes_ / took / ceiling[MEMORY[device.type]]:.2f} of the {MEMORY[device.type]}")
    finally:
        shutil.rmtree(where)


if __name__ == "__main__":
    main()
