"""The sandbox that runs code answers: limits, isolation, and clean-up."""

from __future__ import annotations

import ast
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lab.instruments.sandbox import MAX_PROCESSES, run_python

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux /proc")


def _kernel_allows_network_namespace() -> bool:
    """Whether a process like ours may enter a new network namespace (tried in a throwaway one)."""
    if not sys.platform.startswith("linux"):
        return False
    flags = 0x40000000 | (0 if os.geteuid() == 0 else 0x10000000)  # CLONE_NEWNET (+ CLONE_NEWUSER)
    probe = f"import ctypes, sys\nsys.exit(0 if ctypes.CDLL(None).unshare({flags}) == 0 else 1)"
    return subprocess.run([sys.executable, "-I", "-c", probe]).returncode == 0


def _live_processes_in(directory: str) -> list[int]:
    """Pids of processes (not zombies) whose working directory is `directory`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if cwd.removesuffix(" (deleted)") == directory and state != "Z":
            found.append(int(pid))
    return found


def _wait_until_none_in(directory: str, within_s: float = 3.0) -> list[int]:
    deadline = time.monotonic() + within_s
    while (alive := _live_processes_in(directory)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def test_passing_program_passes():
    result = run_python("def double(x):\n    return 2 * x\n\nassert double(21) == 42\nprint('fine')")
    assert result.ok and not result.timed_out
    assert result.returncode == 0
    assert result.stdout == "fine\n"


def test_failing_program_fails_with_its_traceback():
    result = run_python("def double(x):\n    return x + x + 1\n\nassert double(21) == 42, double(21)")
    assert not result.ok and not result.timed_out
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == "AssertionError: 43"
    assert 'File "<answer>", line 4' in result.stderr


def test_exit_status_and_signals_are_reported():
    assert run_python("import sys\nsys.exit(3)").returncode == 3
    assert run_python("raise SystemExit('bad input')").returncode == 1
    killed = run_python("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)")
    assert killed.returncode == -9 and not killed.timed_out and not killed.ok


def test_infinite_loop_times_out_within_the_limit():
    start = time.monotonic()
    result = run_python("while True:\n    pass", timeout_s=1.0)
    elapsed = time.monotonic() - start
    assert result.timed_out and not result.ok
    assert 1.0 <= elapsed < 3.0


def test_memory_limit_stops_a_memory_bomb_without_hurting_the_parent():
    for bomb in ("block = bytearray(4 * 1024 ** 3)",
                 "chunks = []\nwhile True:\n    chunks.append(bytearray(8 * 1024 * 1024))"):
        result = run_python(bomb, timeout_s=10.0, memory_mb=256)
        assert not result.ok and not result.timed_out
        assert result.stderr.strip().endswith("MemoryError")
    assert len(bytearray(64 * 1024 * 1024)) == 64 * 1024 * 1024  # the parent still allocates freely


def test_memory_limit_follows_the_argument():
    program = "block = bytearray(150 * 1024 * 1024)\nprint(len(block))"
    assert run_python(program, memory_mb=512).ok
    assert "MemoryError" in run_python(program, memory_mb=128).stderr


@pytest.mark.parametrize("namespaces", [True, False], ids=["default", "fallback"])
def test_network_is_unreachable(namespaces: bool):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(0.3)
        port = listener.getsockname()[1]
        program = (f"import socket\nwith socket.create_connection(('127.0.0.1', {port}), timeout=2) as s:\n"
                   "    s.sendall(b'leak')\nprint('connected')")
        result = run_python(program, namespaces=namespaces)
        assert not result.ok and "connected" not in result.stdout
        with pytest.raises(TimeoutError):
            listener.accept()
    assert result.network == "blocked" if not namespaces else result.network in ("namespace", "blocked")


@pytest.mark.skipif(not _kernel_allows_network_namespace(), reason="this kernel refuses network namespaces here")
def test_network_namespace_is_used_where_the_kernel_allows_it():
    result = run_python("import socket\nprint(socket.if_nameindex())")
    assert result.network == "namespace"
    assert result.ok and result.stdout.strip() == "[(1, 'lo')]"


def test_fallback_blocks_sockets_subprocesses_and_ctypes():
    for program in ("import socket\nsocket.socket()",
                    "import _socket\n_socket.socket()",
                    "import subprocess\nsubprocess.run(['true'])",
                    "import os\nos.system('true')",
                    "import os\nos.execv('/bin/true', ['true'])",
                    "import ctypes\nctypes.CDLL(None)"):
        result = run_python(program, namespaces=False)
        assert result.network == "blocked"
        assert not result.ok, program
        assert "PermissionError" in result.stderr and "disabled in the sandbox" in result.stderr, program


def test_files_land_in_a_throwaway_directory_that_is_removed():
    program = ("import os, tempfile\nwith open('answer.txt', 'w') as f:\n    f.write('hello')\n"
               "print(os.path.abspath('answer.txt'))\nprint(tempfile.gettempdir())\nprint(os.environ['HOME'])")
    result = run_python(program)
    assert result.ok, result.stderr
    written, tempdir, home = result.stdout.split()
    workdir = os.path.dirname(written)
    assert tempdir == home == workdir != os.getcwd()
    assert not os.path.exists(written) and not os.path.exists(workdir)


@pytest.mark.skipif(os.geteuid() != 0, reason="only root drops to an unprivileged user")
def test_root_runs_the_program_as_an_unprivileged_user(tmp_path: Path):
    target = tmp_path / "escaped.txt"
    result = run_python(f"import os\nprint(os.getuid())\nopen({str(target)!r}, 'w').write('x')")
    assert result.stdout.strip() != "0"
    assert "PermissionError" in result.stderr
    assert not target.exists()


def test_environment_is_minimal(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("QEVAL_TEST_SECRET", "do-not-leak")
    result = run_python("import os\nprint(sorted(os.environ))")
    assert result.ok
    assert "QEVAL_TEST_SECRET" not in result.stdout
    assert ast.literal_eval(result.stdout) == ["HOME", "LC_ALL", "PATH", "TMPDIR"]


def test_only_the_standard_library_is_importable():
    assert run_python("import json, fractions, statistics, encodings.idna").ok
    assert "ModuleNotFoundError" in run_python("import pydantic").stderr


def test_output_is_cut_to_its_tail():
    result = run_python("print('a' * 200_000)\nprint('end')")
    assert result.ok
    assert len(result.stdout) <= 64 * 1024 and result.stdout.endswith("a\nend\n")


@linux_only
def test_forks_are_capped_and_children_are_cleaned_up():
    program = ("import os, time\nprint(os.getcwd(), flush=True)\nforks = 0\n"
               "for _ in range(200):\n    try:\n        pid = os.fork()\n    except OSError:\n        break\n"
               "    if pid == 0:\n        time.sleep(60)\n        os._exit(0)\n    forks += 1\nprint(forks)")
    result = run_python(program, timeout_s=10.0)
    assert result.ok, result.stderr
    workdir, forks = result.stdout.split()
    assert 0 < int(forks) <= MAX_PROCESSES
    assert _wait_until_none_in(workdir) == []


@linux_only
def test_fork_bomb_is_contained():
    bomb = ("import os\nprint(os.getcwd(), flush=True)\nwhile True:\n    try:\n        os.fork()\n"
            "    except OSError:\n        pass")
    start = time.monotonic()
    result = run_python(bomb, timeout_s=1.5)
    assert time.monotonic() - start < 4.0
    assert result.timed_out and not result.ok
    assert _wait_until_none_in(result.stdout.strip()) == []
