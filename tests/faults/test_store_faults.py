"""Faults of the SQLite store under `lab run`: its disk full mid-run, the file read-only, two runs
writing it at once. Each ends in one line saying what happened, the engine stopped, the store
whole; a stopped run resumes with every cell once."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from pathlib import Path
from typing import Callable, Iterator

import pytest
from sqlalchemy import select

from lab.store import models as m
from tests.faults.conftest import (boot_of, finish, gone_within, keys, ladder, query, run, start, steps_stored,
                                   wait_for)


def error_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("lab:")]


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs mounted for the test (root, or CAP_SYS_ADMIN, is needed to mount one)."""
    where = tmp_path / "disk"
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16M", "tmpfs", str(where)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"a small file system cannot be mounted here ({done.stderr.strip() or done.returncode}): the "
                    "disk-full case needs root or CAP_SYS_ADMIN")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def fill(disk: Path) -> Path:
    """Write zeros to a file on `disk` until the file system refuses more; the file."""
    filler = disk / "filler"
    block = b"\0" * (64 << 10)
    with open(filler, "wb", buffering=0) as out:
        try:
            while True:
                out.write(block)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    return filler


def test_a_full_disk_stops_the_run_in_one_line_and_resume_finishes_it(small_disk: Path, tmp_path: Path,
                                                                       expected_keys: list[tuple]) -> None:
    db = small_disk / "lab.db"
    args = ["--db", str(db), "--runs-dir", str(tmp_path / "runs")]  # the boot logs on another disk
    lab = start(["run", str(ladder(tmp_path)), "--name", "r", *args], tmp_path)
    wait_for("A1 has a step stored", lambda: steps_stored(db, 1) >= 1, lab)
    engine = boot_of(db, 1)
    filler = fill(small_disk)
    code, out = finish(lab)
    assert code == 1, out
    [line] = error_lines(out)
    assert line == (f"lab: cannot write the store {db}: OperationalError: database or disk is full; run r stays as "
                    "it was, `lab run --resume r` continues it once the store answers again")
    assert gone_within(engine.pid, 1)
    filler.unlink()
    code, out = run(["run", "--resume", "r", *args], tmp_path)
    assert code == 0, out
    assert keys(db) == expected_keys  # the step the disk refused was measured again, once


@pytest.fixture
def read_only(tmp_path: Path) -> Iterator[Callable[[Path], None]]:
    """Makes a file read-only for `lab`: immutable (chattr +i) where this runs as root, whom file
    modes do not stop, and mode 0444 otherwise; undone after the test."""
    made: list[Path] = []

    def make(path: Path) -> None:
        if os.geteuid() == 0:
            done = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True)
            if done.returncode != 0:
                pytest.skip(f"cannot make {path.name} immutable here: {done.stderr.strip()}")
        else:
            path.chmod(0o444)
        made.append(path)

    yield make
    for path in made:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(path)], capture_output=True)
        path.chmod(0o644)


def test_a_read_only_store_is_refused_in_one_line_before_anything_boots(
        tmp_path: Path, unfaulted_db: Path, expected_keys: list[tuple], read_only) -> None:
    db = tmp_path / "lab.db"
    shutil.copy(unfaulted_db, db)
    read_only(db)
    code, out = run(["run", str(ladder(tmp_path)), "--name", "r2", "--db", str(db)], tmp_path)
    assert code == 1, out
    [line] = error_lines(out)
    assert line == f"lab: cannot write the store {db}: OperationalError: attempt to write a readonly database", out
    assert not (tmp_path / "runs").exists()  # nothing booted
    code, out = run(["ls", "r", "--db", str(db)], tmp_path)
    assert code == 0 and "C0ctl" in out  # what only reads still works
    assert keys(db) == expected_keys  # the store is as it was


def run_keys(db: Path, name: str) -> list[tuple]:
    rows = query(db, select(m.Slot.idx, m.Cell.instrument, m.Cell.metric, m.Cell.params_key, m.Cell.repeat)
                 .join(m.Slot, m.Cell.slot_id == m.Slot.id).join(m.Run, m.Run.id == m.Slot.run_id)
                 .where(m.Run.name == name))
    return sorted(tuple(r) for r in rows)


def test_two_runs_writing_one_store_at_once_each_store_every_cell_once(tmp_path: Path,
                                                                       expected_keys: list[tuple]) -> None:
    path = ladder(tmp_path)
    both = [start(["run", str(path)], tmp_path) for _ in range(2)]  # the same default name, the same second
    for lab in both:
        code, out = finish(lab)
        assert code == 0, out
    db = tmp_path / "lab.db"
    names = [row[0] for row in query(db, select(m.Run.name).order_by(m.Run.id))]
    assert len(names) == 2 and all(row[0] == "done" for row in query(db, select(m.Run.status)))
    want = [(k[0], k[1], k[3], k[4], k[5]) for k in expected_keys]
    for name in names:
        assert run_keys(db, name) == want
    # A name given twice: one run takes it, the other is refused in one line.
    both = [start(["run", str(path), "--name", "same"], tmp_path) for _ in range(2)]
    results = sorted(finish(lab) for lab in both)
    assert [code for code, _ in results] == [0, 1], results
    assert error_lines(results[1][1]) == [
        "lab: a run named 'same' exists; resume it with `lab run --resume same` or pick another --name"]
