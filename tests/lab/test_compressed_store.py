"""A store kept compressed (`X.db.xz`, as results/ keeps them) is read where it lies by every command
that reads, and refused by every command that would add a run to it."""

from __future__ import annotations

import hashlib
import json
import lzma
from pathlib import Path

import pytest

from lab.cli import main as lab_main
from tests.lab.conftest import KV_LABELS

pytestmark = pytest.mark.slow


@pytest.fixture
def compressed(kv_series: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The real store of `kv_series` (run `kv` with A1kv16m kept, and its series of three labels),
    compressed with xz; the decompressed copy goes to this test's own cache directory."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("COLUMNS", "250")
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "kv.db.xz"
    path.write_bytes(lzma.compress((kv_series / "lab.db").read_bytes()))
    return path


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_every_read_command_works_on_the_compressed_file(compressed: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    before = _sha(compressed)
    db = str(compressed)

    assert lab_main(["ls", "--db", db]) == 0
    assert "kv" in capsys.readouterr().out

    assert lab_main(["ls", "kv", "--db", db]) == 0
    out = capsys.readouterr().out
    assert "A1kv16m" in out and "verdicts: 1 keep, 0 reject, 0 inconclusive" in out

    assert lab_main(["compare", "kv:C0ctl", "kv:A1kv16m", "--json", "--db", db]) == 0
    comparison = json.loads(capsys.readouterr().out)
    assert comparison["verdicts"]["A1kv16m"]["decision"] == "keep"

    assert lab_main(["report", "kv", "--out", str(tmp_path / "reports"), "--db", db]) == 0
    md = next((tmp_path / "reports").glob("kv*/index.md")).read_text()
    assert "A1kv16m" in md and "keep" in md

    assert lab_main(["export", "kv", "--format", "json", "--out", str(tmp_path / "exports"), "--db", db]) == 0
    assert any((tmp_path / "exports").rglob("*.json"))

    assert lab_main(["history", "kv", "--db", db]) == 0
    out = capsys.readouterr().out
    assert all(label in out for label in KV_LABELS) and "memory.kv_pool_tokens" in out

    # Decompressed once, into the cache; neither the file nor that copy took the re-judged verdicts.
    [copy] = (tmp_path / "cache" / "lab" / "stores").glob("*.db")
    assert copy.name.startswith(hashlib.sha256(compressed.read_bytes()).hexdigest())
    copied = (_sha(copy), copy.stat().st_mtime_ns)
    assert lab_main(["report", "kv", "--out", str(tmp_path / "again"), "--db", db]) == 0
    assert (_sha(copy), copy.stat().st_mtime_ns) == copied
    assert _sha(compressed) == before
    assert not list(compressed.parent.glob("kv.db*-*")) and not (tmp_path / "kv.db").exists()


@pytest.mark.parametrize("command", [["run", "kv.yaml"], ["calibrate", "kv.yaml"],
                                     ["sweep", "kv.yaml", "--label", "x"]], ids=lambda c: c[0])
def test_a_command_that_adds_a_run_refuses_it_and_says_how_to_decompress(
        compressed: Path, kv_series: Path, command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    before = _sha(compressed)
    command = [kv_series / c if c == "kv.yaml" else c for c in command]
    assert lab_main([*map(str, command), "--db", str(compressed)]) == 1
    err = capsys.readouterr().err
    assert "compressed store" in err and f"xz -dk {compressed}" in err
    assert _sha(compressed) == before and not (compressed.parent / "cache").exists()


def test_a_compressed_file_that_is_not_a_store_is_a_one_line_error(compressed: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    broken = compressed.with_name("broken.db.xz")
    broken.write_bytes(compressed.read_bytes()[:5000])
    assert lab_main(["ls", "--db", str(broken)]) == 1
    err = capsys.readouterr().err
    assert "cannot decompress" in err and str(broken) in err
    notes = compressed.with_name("notes.db.xz")
    notes.write_bytes(lzma.compress(b"not a database"))
    assert lab_main(["ls", "--db", str(notes)]) == 1
    assert "cannot read store" in capsys.readouterr().err
    assert lab_main(["ls", "--db", str(compressed.with_name("missing.db.xz"))]) == 1
    assert "no store at" in capsys.readouterr().err
