"""Which on-disk caches this engine process had to build. A boot that built one is *cold*: every
later boot reuses what it built and skips that work, so the lab leaves a cold boot's figures out
of its verdicts.

Four caches qualify. The dequantized-GGUF weight cache (`weight_cache.py`) is built at load; the
loader knows whether it was. On the CPU, the file of product layouts measured on this host
(`cpu_linear.py`) is measured and written at load when it lacks one of the model's shapes. A
load that measured while the host was too busy to trust the figures writes nothing, so no later
boot reuses its layouts and it is not cold; its layouts may differ from the next boot's, which
is boot-to-boot noise that the window's controls see. Triton's kernel cache is filled when the CUDA kernels in `kernels/`
are compiled: at warm-up and CUDA-graph capture, and at the first use of a new specialization
while serving, so it can grow long after the engine is ready. Random `dummy:` weights are made in
memory on every boot and reused by none, so they make no boot cold; nothing in the engine calls
torch.compile, so torch's inductor caches are not watched.

The KV file tier (`kv/file_tier.py`) is an on-disk cache that fills while serving, but of another
kind: what a boot wrote there speeds up only a later request with the same prefix, not every
later boot. It is listed with `"cold": false`, and makes no boot cold: a benchmark that never
repeats a prompt across boots (the lab salts every request per boot) gains nothing from what an
earlier boot wrote, and one that does repeat them reads its hits at `prefix_cache.hits_by_tier`.
Every other entry has `"cold": true`.

Triton keeps one top-level directory per compiled kernel hash, so the names added to its cache
directory since the snapshot count the kernels compiled. Names added by another process sharing
the directory count too; the lab boots one engine at a time.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Protocol

log = logging.getLogger(__name__)

WEIGHTS, TRITON, CPU_PRODUCTS, KV_FILE_TIER = "weights", "triton", "cpu-linear", "kv-file-tier"


class FileCache(Protocol):
    """A cache that fills while serving and counts what this process queued to write (`FileTier`)."""
    path: Path
    blocks_queued: int


def triton_cache_dir(environ: Mapping[str, str] = os.environ) -> Path | None:
    """The directory Triton compiles into, by Triton's own rule (`triton.knobs.cache.dir`):
    $TRITON_CACHE_DIR, else $TRITON_HOME/.triton/cache, else ~/.triton/cache. None when
    TRITON_CACHE_DIR is set empty (Triton then caches nothing). The rule is restated rather than
    read from Triton so that a CPU engine, which never runs a Triton kernel, never imports it."""
    if "TRITON_CACHE_DIR" in environ:
        explicit = environ["TRITON_CACHE_DIR"]
        return Path(explicit).absolute() if explicit else None
    home = environ.get("TRITON_HOME", os.path.expanduser("~/"))
    return (Path(home) / ".triton" / "cache").absolute()


def _entries(path: Path) -> frozenset[str]:
    try:
        return frozenset(os.listdir(path))
    except FileNotFoundError:
        return frozenset()  # Triton creates it at the first compile
    except OSError as exc:
        log.warning("cannot list the %s cache %s (%s); kernels compiled there will not mark this boot cold",
                    TRITON, path, exc)
        return frozenset()


@dataclass(frozen=True)
class WatchedDirectory:
    """A cache directory whose top-level names were listed at the snapshot."""
    cache: str
    path: Path
    at_start: frozenset[str]

    def entries_added(self) -> int:
        return len(_entries(self.path) - self.at_start)


@dataclass
class BuiltCaches:
    """What this process built since its snapshot, taken at engine start before the load."""
    watched: list[WatchedDirectory]
    weights_built_in: str | None = None  # the weight cache directory the load built
    products_written: tuple[str, ...] = ()  # product-layout files the load measured and wrote
    file_tier: FileCache | None = None

    @classmethod
    def snapshot(cls, environ: Mapping[str, str] = os.environ) -> BuiltCaches:
        triton = triton_cache_dir(environ)
        watched = [] if triton is None else [WatchedDirectory(TRITON, triton, _entries(triton))]
        return cls(watched)

    def record_weights(self, built_in: str | None) -> None:
        """The load built the weight cache in directory `built_in` (None: it built nothing)."""
        self.weights_built_in = built_in

    def record_products(self, written: list[Path]) -> None:
        """The load measured CPU product layouts and wrote these choices files (empty: none)."""
        self.products_written = tuple(str(p) for p in written)

    def watch_file_tier(self, tier: FileCache) -> None:
        self.file_tier = tier

    def built(self) -> list[dict[str, Any]]:
        """One entry per cache built since the snapshot, e.g. `{"cache": "weights", "path": ...,
        "built": true, "cold": true}`, `{"cache": "triton", "path": ..., "entries_added": 14, "cold":
        true}`; `cold` says whether it makes this process cold (see the module's docstring)."""
        found: list[dict[str, Any]] = []
        if self.weights_built_in is not None:
            found.append({"cache": WEIGHTS, "path": self.weights_built_in, "built": True, "cold": True})
        for path in dict.fromkeys(self.products_written):
            found.append({"cache": CPU_PRODUCTS, "path": path, "built": True, "cold": True})
        for directory in self.watched:
            added = directory.entries_added()
            if added:
                found.append({"cache": directory.cache, "path": str(directory.path), "entries_added": added,
                              "cold": True})
        if self.file_tier is not None and self.file_tier.blocks_queued:
            found.append({"cache": KV_FILE_TIER, "path": str(self.file_tier.path),
                          "entries_added": self.file_tier.blocks_queued, "cold": False})
        return found
