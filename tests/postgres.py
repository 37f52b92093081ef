"""A real PostgreSQL server for tests: the server of the `pgserver` wheel, listening on 127.0.0.1 only,
with a database `lab` owned by a role `lab` that logs in over TCP with a password (scram-sha-256).
`pytest.skip` says why where the wheel is missing or the server cannot start."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from lab.runner.boot import free_port


@dataclass
class Server:
    pgdata: Path
    port: int
    system_user: str | None
    password: str

    def url(self, password: str | None = None, port: int | None = None) -> str:
        """The `lab` role's URL, with its password unless another is given (a wrong one, say)."""
        return f"postgresql://lab:{self.password if password is None else password}@127.0.0.1:{port or self.port}/lab"

    def stop(self) -> None:
        """An immediate shutdown: what a crashed or unplugged database server looks like to a client."""
        _pg_ctl(["-w", "-m", "immediate", "stop"], self)

    def running(self) -> bool:
        """Whether its postmaster is up: `pg_ctl -w stop` returns once the postmaster removed this file."""
        return (self.pgdata / "postmaster.pid").exists()

    def start(self) -> None:
        _pg_ctl(["-w", "-o", f"-h 127.0.0.1 -p {self.port} -k {self.pgdata}", "-l", str(self.pgdata / "log"),
                 "start"], self, timeout=60)


def _pg_ctl(args: list[str], server: Server, **kwargs: object) -> None:
    import pgserver

    pgserver.pg_ctl(args, pgdata=server.pgdata, user=server.system_user, **kwargs)


@contextmanager
def postgres(password: str) -> Iterator[Server]:
    """A running server whose role `lab` has `password`; stopped and deleted on exit."""
    pgserver = pytest.importorskip("pgserver", reason="the pgserver wheel (test extra) is not installed: "
                                                      "pip install -e '.[test]'")
    # Outside pytest's own temporary tree, whose permissions a concurrent pytest tightens.
    root = Path(tempfile.mkdtemp(prefix="lab-pg-"))
    pgdata = root / "data"
    try:
        # initdb (as an unprivileged user when run as root) and a first start on a Unix socket, where the
        # role and database are made; then a restart on loopback TCP, where only a password lets one in.
        handle = pgserver.get_server(pgdata, cleanup_mode=None)
        handle.psql(f"CREATE ROLE lab LOGIN PASSWORD '{password}';\nCREATE DATABASE lab OWNER lab;\n")
        (pgdata / "pg_hba.conf").write_text("local all all trust\nhost all all 127.0.0.1/32 scram-sha-256\n")
        server = Server(pgdata, free_port(), handle.system_user, password)
        _pg_ctl(["-w", "-m", "fast", "stop"], server)
        server.start()
    except (OSError, subprocess.SubprocessError) as exc:
        shutil.rmtree(root, ignore_errors=True)
        pytest.skip(f"PostgreSQL (pgserver) did not start here: {exc}")
    try:
        yield server
    finally:
        try:
            _pg_ctl(["-w", "-m", "fast", "stop"], server)
        except subprocess.SubprocessError:  # a test left it stopped
            pass
        shutil.rmtree(root, ignore_errors=True)
