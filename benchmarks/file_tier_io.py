"""How fast the KV file tier writes and reads blocks on this host: the ceiling of its figures.

`FileTier.put` of N blocks of Llama-3-8B's shape (32 layers x K/V x 16 tokens x 8 heads x 128,
bf16: 2 MiB), then, from a fresh `FileTier` on the same file, `get` and a copy of each into a
host block (the page cache holds the file).

    PYTHONPATH=. python benchmarks/file_tier_io.py [--blocks 400] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch

from lab.engine.kv.file_tier import FileTier

SHAPE = (32, 2, 16, 8, 128)
IDENTITY = {"model": "file-tier-io", "block_size": 16}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=400)
    ap.add_argument("--dir", type=Path, default=None, help="where the file goes (default: the system's temp dir)")
    args = ap.parse_args()
    where = Path(tempfile.mkdtemp(dir=args.dir))
    try:
        path = where / "io.kvtier"
        block = torch.randn(SHAPE).to(torch.bfloat16)
        tokens = tuple(range(16))
        writer = FileTier(path, IDENTITY, args.blocks, SHAPE, torch.bfloat16)
        started = time.perf_counter()
        for h in range(1, args.blocks + 1):
            writer.put(h, tokens, block)
        returned = time.perf_counter() - started
        writer.close()
        written = time.perf_counter() - started
        reader = FileTier(path, IDENTITY, args.blocks, SHAPE, torch.bfloat16)
        into = torch.empty(SHAPE, dtype=torch.bfloat16)
        started = time.perf_counter()
        for h in range(1, args.blocks + 1):
            into.copy_(reader.get(h, tokens))
        read = time.perf_counter() - started
        gb = args.blocks * writer.block_bytes / 1e9
        print(f"{args.blocks} blocks, {gb:.2f} GB: puts returned after {returned:.3f} s, all written after "
              f"{written:.3f} s ({gb / written:.3g} GB/s); read, verified and copied {gb / read:.3g} GB/s")
    finally:
        shutil.rmtree(where)


if __name__ == "__main__":
    main()
