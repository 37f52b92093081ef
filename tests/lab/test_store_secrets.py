"""A PostgreSQL store URL carries a password; nothing the lab prints or stores does. Faults injected
against a real server (a wrong port, a wrong password, the server stopped in the middle of a run)
each end in one line naming the store with its password masked, and what the run stored, its boot
logs and its report hold no password either."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from sqlalchemy import select

from lab.runner.boot import free_port
from lab.store import models as m
from lab.store.db import StoreError, open_store
from tests.instruments.ladder_run import REPO
from tests.lab.conftest import KV_LADDER
from tests.postgres import Server, postgres

pytestmark = pytest.mark.slow

PASSWORD = "Pw-7f3kQz9x"  # distinctive, so a search of any output for it cannot hit by chance

LADDER = KV_LADDER.replace("name: kv", "name: secret", 1)


@pytest.fixture(scope="module")
def server() -> Server:
    with postgres(PASSWORD) as running:
        yield running


def lab(cwd: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lab", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "250"})


def masked(server: Server, port: int | None = None) -> str:
    return f"postgresql://lab:***@127.0.0.1:{port or server.port}/lab"


@pytest.mark.parametrize("fault", ["wrong port", "wrong password"])
def test_a_store_that_refuses_the_connection_is_named_without_its_password(server: Server, tmp_path: Path,
                                                                          fault: str) -> None:
    port = free_port() if fault == "wrong port" else None
    url = server.url(port=port) if port else server.url(password="Wrong-" + PASSWORD)
    (tmp_path / "secret.yaml").write_text(textwrap.dedent(LADDER))
    for args in (["ls"], ["run", "secret.yaml"], ["sweep", "secret.yaml", "--label", "x"], ["history", "secret"],
                 ["compare", "C0ctl", "A1kv16m"], ["report", "secret"]):
        done = lab(tmp_path, *args, "--db", url)
        output = done.stdout + done.stderr
        assert done.returncode in (1, 2), output
        assert PASSWORD not in output and "Traceback" not in output
        [line] = done.stderr.splitlines()
        assert masked(server, port) in line
        assert ("Connection refused" if port else 'password authentication failed for user "lab"') in line
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_an_unsupported_scheme_is_one_line_naming_the_supported_ones(tmp_path: Path) -> None:
    done = lab(tmp_path, "ls", "--db", f"mysql://lab:{PASSWORD}@127.0.0.1/lab")
    assert done.returncode == 1 and PASSWORD not in done.stdout + done.stderr
    assert done.stderr.splitlines() == ["lab: unsupported store URL scheme mysql:// in mysql://lab:***@127.0.0.1/lab; "
                                        "the lab stores its runs in SQLite (a file path, or sqlite:///PATH) or "
                                        "PostgreSQL (postgresql://user:password@host/db)"]
    with pytest.raises(StoreError, match=r"scheme mysql\+pymysql:// in mysql\+pymysql://lab:\*\*\*@h/lab;"):
        open_store(f"mysql+pymysql://lab:{PASSWORD}@h/lab", read_only=True)


def test_a_server_that_goes_away_mid_run_leaves_no_password_anywhere(server: Server, tmp_path: Path) -> None:
    (tmp_path / "secret.yaml").write_text(textwrap.dedent(LADDER))
    url = server.url()
    run = subprocess.Popen([sys.executable, "-m", "lab", "run", "secret.yaml", "--name", "gone", "--db", url],
                           cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "250"})
    try:
        _wait_for_a_finished_boot(url, run)
        server.stop()
        output = run.communicate(timeout=300)[0]
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate()
        if not server.running():
            server.start()
    assert run.returncode == 1, output
    assert PASSWORD not in output and "Traceback" not in output
    # The error's one line, as rich wraps it at the terminal's width.
    lines = output.splitlines()
    last = " ".join(" ".join(lines[max(i for i, line in enumerate(lines) if line.startswith("lab: ")):]).split())
    # Stopped between two queries (no connection can be made) or during one (the connection drops).
    assert (last.startswith(f"lab: cannot open store {masked(server)}: OperationalError: ")
            or last.startswith(f"lab: the store {masked(server)} dropped the connection: OperationalError: "))
    assert last.endswith("run gone stays as it was, `lab run --resume gone` continues it once the store answers again")

    resumed = lab(tmp_path, "run", "--resume", "gone", "--db", url)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"→ {masked(server)};" in resumed.stdout + resumed.stderr
    for args in (["ls"], ["ls", "gone"], ["report", "gone", "--out", "reports"], ["compare", "C0ctl", "A1kv16m"]):
        done = lab(tmp_path, *args, "--db", url)
        assert done.returncode == 0, done.stdout + done.stderr
        assert PASSWORD not in resumed.stdout + resumed.stderr + done.stdout + done.stderr
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.suffix == ".html" for p in files) and any(p.suffix == ".log" for p in files)
    assert [p for p in files if PASSWORD.encode() in p.read_bytes()] == []
    assert _stored_text_with(url, PASSWORD) == []


def _wait_for_a_finished_boot(url: str, run: subprocess.Popen[str]) -> None:
    """Until the run has stored its first finished boot: the store is then mid-run."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and run.poll() is None:
        try:
            store = open_store(url, read_only=True)
        except StoreError:  # its tables are not there yet
            time.sleep(0.5)
            continue
        try:
            with store.session() as s:
                if s.scalar(select(m.Boot.id).where(m.Boot.status == "done").limit(1)) is not None:
                    return
        finally:
            store.close()
        time.sleep(0.5)
    raise AssertionError(f"no boot finished: {run.communicate()[0] if run.poll() is not None else 'timed out'}")


def _stored_text_with(url: str, needle: str) -> list[str]:
    """Every table.column of the store (the lab's tables and Optuna's) holding `needle` in any row."""
    store = open_store(url, read_only=True)
    try:
        found = []
        with store.engine.connect() as connection:
            for table in m.Base.metadata.sorted_tables:
                for row in connection.execute(select(table)).mappings():
                    found += [f"{table.name}.{column}" for column, value in row.items() if needle in repr(value)]
        return found
    finally:
        store.close()
