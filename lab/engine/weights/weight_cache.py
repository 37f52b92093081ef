"""The on-disk cache of dequantized GGUF models: `<root>/<sha256[:16]>/` holding float32
`model.safetensors`, `config.json`, the tokenizer and a manifest.

A cache directory only ever appears whole: it is written under a temporary name in the same root
and renamed into place, so a load killed half-way leaves at most a temporary directory, which a
later build removes. A cache directory that fails any check on read is treated as absent and
rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Sequence

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from lab.engine.model_config import ModelConfig
from lab.engine.weights.loader import check_weights
from lab.engine.weights.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Bump when what a cache directory holds changes meaning; older directories are then rebuilt.
CACHE_FORMAT = 1
_WEIGHTS, _CONFIG, _MANIFEST = "model.safetensors", "config.json", "manifest.json"
_TMP_PREFIX = ".tmp-"
_HASH_CHUNK = 16 << 20


def sha256_files(paths: Sequence[Path]) -> str:
    """sha256 of the files' bytes one after another (for one file, what `sha256sum` prints),
    streamed in large chunks: at ~100 MB the hash is a visible part of a warm boot."""
    digest = hashlib.sha256()
    buffer = bytearray(_HASH_CHUNK)
    view = memoryview(buffer)
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buffer):
                digest.update(view[:n])
    return digest.hexdigest()


class WeightCache:
    def __init__(self, root: Path, source_sha256: str) -> None:
        self.root = root
        self.source_sha256 = source_sha256
        self.directory = root / source_sha256[:16]

    def read(self) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer] | None:
        """The cached model, or None when there is none or it fails a check (logged)."""
        if not self.directory.is_dir():
            return None
        try:
            manifest = json.loads((self.directory / _MANIFEST).read_text("utf-8"))
            if manifest.get("format") != CACHE_FORMAT or manifest.get("source_sha256") != self.source_sha256:
                raise ValueError("written for another format or source")
            for name, size in manifest["sizes"].items():
                actual = (self.directory / name).stat().st_size
                if actual != size:
                    raise ValueError(f"{name} is {actual} bytes, manifest says {size}")
            raw = json.loads((self.directory / _CONFIG).read_text("utf-8"))
            raw["eos_token_ids"] = tuple(raw["eos_token_ids"])
            config = ModelConfig(**raw)
            weights = load_file(self.directory / _WEIGHTS)
            check_weights(weights, config, str(self.directory))
            tokenizer = Tokenizer.load(self.directory)
        except (OSError, ValueError, KeyError, TypeError, SafetensorError) as exc:
            log.warning("weight cache %s is damaged (%s); rebuilding it", self.directory, exc)
            return None
        return config, weights, tokenizer

    def write(self, config: ModelConfig, weights: dict[str, torch.Tensor], tokenizer: Tokenizer) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self._remove_abandoned_builds()
        tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{self.directory.name}-{os.getpid()}-", dir=self.root))
        try:
            save_file({k: v.float().contiguous() for k, v in weights.items()}, tmp / _WEIGHTS)
            (tmp / _CONFIG).write_text(json.dumps(config.to_dict(), indent=1), "utf-8")
            tokenizer.save(tmp)
            sizes = {p.name: p.stat().st_size for p in sorted(tmp.iterdir())}
            manifest = {"format": CACHE_FORMAT, "source_sha256": self.source_sha256, "sizes": sizes}
            (tmp / _MANIFEST).write_text(json.dumps(manifest, indent=1), "utf-8")
            for p in tmp.iterdir():
                with open(p, "rb") as f:
                    os.fsync(f.fileno())
            self._install(tmp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _install(self, tmp: Path) -> None:
        if self.directory.exists():
            if self.read() is not None:
                return  # another process finished the same build first; its copy is as good as ours
            # A damaged directory is moved aside first, since rename cannot replace a non-empty one.
            stale = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{self.directory.name}-stale-", dir=self.root))
            os.rename(self.directory, stale / "old")
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(tmp, self.directory)
        except OSError:
            # Another process installed the same build between our check and our rename.
            if not self.directory.is_dir():
                raise

    def _remove_abandoned_builds(self) -> None:
        for entry in self.root.glob(f"{_TMP_PREFIX}{self.directory.name}-*"):
            parts = entry.name.split("-")
            pid = int(parts[2]) if len(parts) > 2 and parts[2].isdigit() else None
            if pid is None or not _process_alive(pid):
                shutil.rmtree(entry, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
