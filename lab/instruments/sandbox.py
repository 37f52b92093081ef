"""Run an untrusted Python program (a model's code answer) in a throwaway, limited subprocess.

The program runs in a fresh interpreter (`-I -S`: no environment variables, no user or
site packages, only the standard library) whose current directory is a new temporary
directory, deleted afterwards, with a minimal environment (HOME and TMPDIR point into it).

Process layout: run_python -> launcher (new session, so one process group) -> supervisor ->
worker. The launcher sets the resource limits and tries to enter new namespaces; the
supervisor (PID 1 of the new PID namespace when there is one) dies with the launcher and
records the worker's exit status; only the worker runs the untrusted code.

What is isolated:
- Network: on Linux the launcher enters a new network namespace (as root directly, otherwise
  inside a new user namespace), which holds only a loopback device that is down, so no socket
  reaches anything. Where namespaces cannot be created, an audit hook (which the program
  cannot remove) refuses socket creation, subprocesses, exec and ctypes before the program
  starts; that block is in-process and best effort, not a kernel boundary.
- Processes: a new PID namespace when available, so when the supervisor dies (timeout,
  launcher killed) the kernel kills everything the program started, even processes that left
  the process group. RLIMIT_NPROC caps forks; root ignores that limit, so as root the worker
  first drops to the `nobody` user (which also stops it writing files owned by root).
- Resources: RLIMIT_AS (memory), RLIMIT_CPU, RLIMIT_FSIZE (files and captured output),
  RLIMIT_NOFILE, no core dumps, and a wall-clock timeout that kills the whole process group.

What is not isolated:
- The filesystem is the host's: the program can read whatever its user may read, and as a
  non-root user it can write wherever that user can (only its working directory is thrown
  away). Under `nobody` it can still write world-writable places such as /tmp and /dev/shm.
- /proc is the host's, so the program can see other processes (not signal them, as nobody).
- With the audit-hook fallback, a program that finds a way around the hook has the network.
- On platforms without /proc or namespaces only the resource limits and the hook apply.
"""

from __future__ import annotations

import json
import logging
import math
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

MAX_PROCESSES = 16
"""Most processes (threads count too) the program may add to those its user already has."""

_MAX_FILE_BYTES = 8 * 1024 * 1024
_KEPT_OUTPUT_BYTES = 64 * 1024
_CLEANUP_GRACE_S = 2.0

# Runs in the launcher before any untrusted code; kept as source text rather than a module so
# that the child imports only what it needs (nothing that would hand the program a
# subprocess primitive before the fallback hook is installed).
_CHILD = r'''
import ctypes, json, linecache, os, resource, signal, sys, traceback

cfg = json.loads(sys.argv[1])
with open(cfg["code_path"], encoding="utf-8") as f:
    source = f.read()

def set_limit(name, soft, hard=None):
    # "Where available": some platforms lack a limit or refuse to lower it (RLIMIT_AS on macOS).
    if hasattr(resource, name):
        try:
            resource.setrlimit(getattr(resource, name), (soft, soft if hard is None else hard))
        except (ValueError, OSError):
            pass

set_limit("RLIMIT_AS", cfg["memory_bytes"])
set_limit("RLIMIT_CPU", cfg["cpu_s"], cfg["cpu_s"] + 1)
set_limit("RLIMIT_FSIZE", cfg["file_bytes"])
set_limit("RLIMIT_NOFILE", 64)
set_limit("RLIMIT_CORE", 0)

libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
network = "blocked"
if cfg["namespaces"] and libc is not None:
    CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
    # Without root, only a new user namespace grants the right to create the others.
    flags = CLONE_NEWNET | CLONE_NEWPID | (0 if os.geteuid() == 0 else CLONE_NEWUSER)
    if libc.unshare(flags) == 0:
        network = "namespace"
with open(cfg["network_path"], "w") as f:
    f.write(network)

def tasks_of(uid):
    count = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.stat("/proc/" + pid).st_uid == uid:
                    count += len(os.listdir("/proc/" + pid + "/task"))
            except OSError:
                pass
    return count

def reach_stdlib_after_drop():
    # The interpreter may live where `nobody` cannot look (e.g. under /root): open its
    # library directories now and import through /proc/self/fd, which skips the ancestors.
    moved = {}
    for entry in sys.path:
        try:
            moved[entry] = "/proc/self/fd/%d" % os.open(entry, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            pass
    def relocate(path):
        for old, new in moved.items():
            if path == old or path.startswith(old + os.sep):
                return new + path[len(old):]
        return path
    sys.path[:] = list(moved.values())
    sys.path_importer_cache.clear()
    for module in list(sys.modules.values()):
        package_path = getattr(module, "__path__", None)
        if isinstance(package_path, list):
            package_path[:] = [relocate(p) for p in package_path]

def block(event, args):
    if event == "import" and args[0] == "_posixsubprocess":
        raise PermissionError("subprocesses are disabled in the sandbox")
    if event.startswith(("socket.", "subprocess.", "os.exec", "os.posix_spawn", "os.spawn",
                         "os.system", "ctypes.")):
        raise PermissionError(event + " is disabled in the sandbox")

def run_untrusted():
    uid, gid = cfg["drop_to"] or (os.getuid(), os.getgid())
    in_own_user_namespace = network == "namespace" and cfg["drop_to"] is None
    # Outside a user namespace of its own the limit counts every task the user has on the
    # host (including other sandboxes' and not yet reaped ones), so allow for those.
    others = 0 if in_own_user_namespace or not os.path.isdir("/proc") else tasks_of(uid)
    if cfg["drop_to"] is not None:
        if os.path.isdir("/proc/self/fd"):
            reach_stdlib_after_drop()
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
    set_limit("RLIMIT_NPROC", cfg["max_processes"] + others)
    if network != "namespace":
        sys.addaudithook(block)
    linecache.cache["<answer>"] = (len(source), None, source.splitlines(True), "<answer>")
    try:
        exec(compile(source, "<answer>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        code = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException as exc:
        traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # the output file hit RLIMIT_FSIZE, or the program closed the stream
            pass
    os._exit(code)

sys.stdout.flush()
supervisor = os.fork()
if supervisor:
    os._exit(0 if os.waitpid(supervisor, 0)[1] == 0 else 1)
if libc is not None:
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the launcher
worker = os.fork()
if worker == 0:
    run_untrusted()
status = os.waitpid(worker, 0)[1]
with open(cfg["status_path"], "w") as f:
    f.write(str(status))
os._exit(0)
'''


@dataclass(frozen=True)
class SandboxResult:
    ok: bool
    """The program finished in time with exit status 0."""
    timed_out: bool
    returncode: int
    """The program's exit status; -N when signal N ended it (-9 after a timeout)."""
    stdout: str
    stderr: str
    """Each stream is cut to its last 64 KiB."""
    network: str = ""
    """How the network was kept away: "namespace" (kernel) or "blocked" (audit hook)."""


def run_python(code: str, timeout_s: float = 5.0, memory_mb: int = 256, *,
               namespaces: bool = True) -> SandboxResult:
    """Run `code` as a program under the limits above; `namespaces=False` forces the fallback."""
    with tempfile.TemporaryDirectory(prefix="sandbox-io-") as io_name:
        io = Path(io_name)
        workdir = Path(tempfile.mkdtemp(prefix="sandbox-cwd-"))
        try:
            return _run(code, io, workdir, timeout_s, memory_mb, namespaces)
        finally:
            _remove(workdir)


def _run(code: str, io: Path, workdir: Path, timeout_s: float, memory_mb: int,
         namespaces: bool) -> SandboxResult:
    (io / "code.py").write_text(code, encoding="utf-8")
    drop_to = _unprivileged_ids() if os.geteuid() == 0 else None
    if drop_to is not None:
        os.chown(workdir, *drop_to)
    config = {
        "code_path": str(io / "code.py"),
        "status_path": str(io / "status"),
        "network_path": str(io / "network"),
        "memory_bytes": memory_mb * 1024 * 1024,
        "cpu_s": math.ceil(timeout_s) + 1,
        "file_bytes": _MAX_FILE_BYTES,
        "max_processes": MAX_PROCESSES,
        "namespaces": namespaces,
        "drop_to": drop_to,
    }
    env = {"PATH": "/usr/bin:/bin", "HOME": str(workdir), "TMPDIR": str(workdir), "LC_ALL": "C.UTF-8"}
    # Output goes to files, not pipes: RLIMIT_FSIZE bounds them, and a straggler holding a
    # pipe open cannot make us wait.
    with open(io / "stdout", "wb") as out, open(io / "stderr", "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-B", "-X", "utf8", "-c", _CHILD, json.dumps(config)],
            cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
            start_new_session=True)
    finished = _wait_unreaped(proc.pid, timeout_s)
    # Before reaping, so the group id cannot yet belong to anyone else; also clears
    # stragglers the program left behind when it finished in time.
    _kill_group(proc.pid)
    proc.wait()
    status_file = io / "status"
    returncode = (os.waitstatus_to_exitcode(int(status_file.read_text()))
                  if finished and status_file.exists() else proc.returncode)
    network_file = io / "network"
    return SandboxResult(
        ok=finished and returncode == 0,
        timed_out=not finished,
        returncode=returncode,
        stdout=_tail(io / "stdout"),
        stderr=_tail(io / "stderr"),
        network=network_file.read_text() if network_file.exists() else "",
    )


def _unprivileged_ids() -> tuple[int, int]:
    try:
        entry = pwd.getpwnam("nobody")
        return entry.pw_uid, entry.pw_gid
    except KeyError:
        return 65534, 65534


def _wait_unreaped(pid: int, timeout_s: float) -> bool:
    """Wait until `pid` exits or the timeout passes, leaving it unreaped; True if it exited."""
    deadline = time.monotonic() + timeout_s
    delay = 0.001
    while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        time.sleep(min(delay, remaining))
        delay = min(delay * 2, 0.025)
    return True


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _tail(path: Path) -> str:
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - _KEPT_OUTPUT_BYTES))
        return f.read().decode("utf-8", errors="replace")


def _remove(workdir: Path) -> None:
    # Killed processes of a torn-down namespace may still be exiting for a moment, and one
    # could recreate a file between rmtree's listing and its rmdir; retry briefly.
    deadline = time.monotonic() + _CLEANUP_GRACE_S
    while True:
        try:
            shutil.rmtree(workdir)
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if time.monotonic() > deadline:
                log.warning("could not remove sandbox directory %s: %s", workdir, exc)
                return
            time.sleep(0.05)
