"""The commands that read work on a store nobody may write: a finished run's SQLite file on a
read-only path. `lab ls`, `lab compare`, `lab report` and `lab export` answer from it, and the store's
bytes are the same afterwards (no verdict, schema or journal written)."""

from __future__ import annotations

import hashlib
import os
import shutil
import sqlite3
import subprocess
import sys
from contextlib import closing
from pathlib import Path

import pandas as pd
import pytest

from tests.report.conftest import REPO, Quickstart

pytestmark = pytest.mark.slow

# Root writes through a directory's permission bits; a read-only bind mount, in a mount namespace
# of its own, stops it as it stops everyone. Each of these makes one, where the host allows it.
NAMESPACES = (["unshare", "--mount"], ["unshare", "--user", "--map-root-user", "--mount"])
READ_ONLY_MOUNT = 'mount --bind "$0" "$0" && mount -o remount,ro,bind "$0" "$0" && exec "$@"'


def read_only_lab(directory: Path, args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """`lab ARGS` as a person runs it, with `directory` read-only to it."""
    command = [sys.executable, "-m", "lab", *args]
    if os.geteuid() == 0:
        namespace = next((n for n in NAMESPACES if shutil.which(n[0]) and subprocess.run(
            [*n, "sh", "-c", READ_ONLY_MOUNT, str(directory), "true"], capture_output=True).returncode == 0), None)
        if namespace is None:
            pytest.skip("running as root where no mount namespace can be made: no path is read-only to root here")
        command = [*namespace, "sh", "-c", READ_ONLY_MOUNT, str(directory), *command]
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "250"}
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def digest(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


@pytest.fixture
def read_only_store(quickstart: Quickstart, tmp_path: Path):
    """A copy of the quickstart's store (WAL mode, as `lab run` left it) alone in a directory that,
    like the file, nobody may write."""
    directory = tmp_path / "archive"
    directory.mkdir()
    db = directory / "lab.db"
    with closing(sqlite3.connect(quickstart.db)) as source, closing(sqlite3.connect(db)) as copy:
        source.backup(copy)
        assert copy.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    assert [p.name for p in directory.iterdir()] == ["lab.db"]  # closed: no journal or index beside it
    db.chmod(0o444)
    directory.chmod(0o555)
    yield db
    directory.chmod(0o755)


def test_read_commands_answer_from_a_store_on_a_read_only_path_and_change_none_of_its_bytes(
        read_only_store: Path, tmp_path: Path) -> None:
    directory = read_only_store.parent
    before = digest(directory)
    db = ["--db", str(read_only_store)]

    listed = read_only_lab(directory, ["ls", *db], tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert "qs" in listed.stdout and "done" in listed.stdout
    run = read_only_lab(directory, ["ls", "qs", *db], tmp_path)
    assert run.returncode == 0, run.stderr
    assert "C1mnbt256" in run.stdout and "capabilities" in run.stdout

    compared = read_only_lab(directory, ["compare", "C0ctl", "C1mnbt256", *db], tmp_path)
    assert compared.returncode == 0, compared.stderr
    assert "KEEP C1mnbt256: " in compared.stdout and "against C0ctl (window W1)" in compared.stdout

    reported = read_only_lab(directory, ["report", "qs", "--out", str(tmp_path / "reports"), *db], tmp_path)
    assert reported.returncode == 0, reported.stderr
    page = (tmp_path / "reports" / "qs" / "index.md").read_text()
    assert "## KEEP verdicts" in page and "C2nopc" in page and "No verdicts" not in page

    exported = read_only_lab(directory, ["export", "qs", "--format", "csv", "--out", str(tmp_path / "exports"),
                                         *db], tmp_path)
    assert exported.returncode == 0, exported.stderr
    assert len(pd.read_csv(tmp_path / "exports" / "qs" / "verdicts.csv")) == 2  # as `lab run` stored them

    assert digest(directory) == before  # the store, byte for byte, and no journal or index left beside it
