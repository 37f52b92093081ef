"""Boots as real processes: every way one can end is stored, and the ladder goes on."""

from __future__ import annotations

import os
import re
from pathlib import Path

import psutil
from sqlalchemy import select

from lab.store import models as m
from lab.store.db import Store
from tests.lab.conftest import stub_ladder

def ladder_with(tmp_path: Path, *arms: str, hygiene: str = "", **engine: object) -> Path:
    """One window: C0ctl, the given arms, C0ctl; the memory instrument."""
    body = ("windows:\n  - name: W1\n    control: C0ctl\n    arms:\n"
            + "".join(f"      - {a}\n" for a in arms)
            + "instruments:\n  memory:\n" + hygiene)
    return stub_ladder(tmp_path, body, **engine)


def boots(store: Store) -> list[tuple[m.Slot, m.Boot]]:
    with store.session() as s:
        rows = s.execute(select(m.Slot, m.Boot).join(m.Boot, m.Boot.slot_id == m.Slot.id)
                         .order_by(m.Slot.idx, m.Boot.attempt)).all()
        for slot, _ in rows:
            _ = slot.arm
        return [tuple(r) for r in rows]


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_engine_that_exits_at_once_is_a_failed_boot_and_the_next_arm_runs(tmp_path, lab, store) -> None:
    path = ladder_with(tmp_path, "{name: A1exit, flags: {exit: 3}}", "{name: A2, flags: {seqs: 2}}")
    assert lab("run", str(path)) == 0
    rows = boots(store)
    assert [(slot.arm.name, boot.status) for slot, boot in rows] == [
        ("C0ctl", "done"), ("A1exit", "failed"), ("A2", "done"), ("C0ctl", "done")]
    failed = rows[1][1]
    assert failed.exit_status == 3
    assert failed.reason == "engine exited with status 3 before it was ready"
    assert "exiting with 3 as asked" in failed.log_tail
    assert Path(failed.log_path).name == "01-A1exit.log"
    assert failed.argv[-2:] == ["--exit", "3"]
    done = rows[2][1]
    assert done.ready_s > 0 and done.stopped_by == "SIGTERM" and done.fingerprint["python"]
    assert done.cold is False and rows[0][1].cold is True  # a command engine's first boot of the run is cold
    with store.session() as s:
        assert s.scalar(select(m.Run.status)) == "done"
        assert s.scalars(select(m.Slot.status).order_by(m.Slot.idx)).all() == ["done", "failed", "done", "done"]


def test_never_ready_engine_times_out_and_its_whole_group_is_gone(tmp_path, lab, store) -> None:
    child_file = tmp_path / "child.pid"
    arm = f"{{name: A1, multi: true, flags: {{never-ready: true, child-pid-file: {child_file}}}}}"
    path = ladder_with(tmp_path, arm, ready_timeout_s=3, bool_style="switch")
    assert lab("run", str(path)) == 0
    slot, boot = boots(store)[1]
    assert boot.status == "failed"
    assert boot.reason.startswith("not ready after 3 s (last: HTTP 503")
    assert gone(boot.pid) and gone(int(child_file.read_text()))


def test_engine_ignoring_sigterm_is_killed_after_the_grace_period(tmp_path, lab, store) -> None:
    path = ladder_with(tmp_path, "{name: A1, flags: {ignore-term: true}}", bool_style="switch")
    assert lab("run", str(path)) == 0
    slot, boot = boots(store)[1]
    assert (boot.status, boot.stopped_by, boot.exit_status) == ("done", "SIGKILL", -9)
    assert (boot.stopped_at - boot.ready_at).total_seconds() >= 2
    assert gone(boot.pid)


def test_engine_dying_mid_arm_is_recorded_with_what_it_finished(tmp_path, lab, store) -> None:
    path = ladder_with(tmp_path, "{name: A1, flags: {die-on-stats: true}}", bool_style="switch")
    assert lab("run", str(path)) == 0
    rows = boots(store)
    slot, boot = rows[1]
    assert boot.status == "died" and boot.exit_status == 3
    assert boot.reason == "engine exited with status 3 during memory snapshot"
    assert "dying on /v1/stats" in boot.log_tail
    assert rows[2][1].status == "done"  # the closing control still ran


def test_memory_floor_not_met_fails_each_boot_with_the_reason(tmp_path, lab, store) -> None:
    # A floor above the host's whole memory is refused before the run; one just below it (the
    # kernel always keeps more than 0.1 % for itself) passes the validator and is never met.
    floor = round(psutil.virtual_memory().total / 1024**3 * 0.999, 3)
    path = ladder_with(tmp_path, "{name: A1, flags: {seqs: 2}}",
                       hygiene=f"hygiene: {{min_mem_available_gib: {floor}, mem_wait_s: 1}}\n")
    assert lab("run", str(path)) == 1  # nothing was measured: the command fails
    rows = boots(store)
    assert len(rows) == 3 and {b.status for _, b in rows} == {"failed"}
    assert all(b.pid is None for _, b in rows)  # no engine was started
    assert rows[0][1].reason.startswith("host MemAvailable ") and f"< floor {floor:g} GiB after waiting 1 s" in \
        rows[0][1].reason


def test_command_engine_boot_stores_its_exact_argv_and_env(tmp_path, lab, store, monkeypatch) -> None:
    monkeypatch.setenv("LAB_ENGINE_MAX_NUM_SEQS", "1")  # a stray export must not reach any engine
    path = ladder_with(tmp_path, "{name: A1, env: {STUB_ENV: hello}}")
    assert lab("run", str(path)) == 0
    slot, boot = boots(store)[1]
    assert boot.env == {"STUB_ENV": "hello"} and boot.env_removed == ["LAB_ENGINE_MAX_NUM_SEQS"]
    assert boot.argv[2:] == ["--port", str(boot.port), "--model", "stub"]
    log = Path(boot.log_path).read_text()
    assert "STUB_ENV=hello" in log
    assert boot.engine_stats == {"v1_models": {"object": "list", "data": [{"id": "stub", "seqs": ""}]}}
    with store.session() as s:
        cells = s.scalars(select(m.Cell).where(m.Cell.boot_id == boot.id)).all()
        assert [(c.metric, c.unit, c.valid) for c in cells] == [("host_mem_available_floor_gib", "GiB", True)]
        step = s.get_one(m.Step, cells[0].step_id)
        request = s.scalar(select(m.Request).where(m.Request.step_id == step.id))
        assert (step.instrument, step.key, request.endpoint, request.status) == ("memory", "snapshot", "/v1/stats", 404)


def test_lab_ls_lists_runs_then_one_runs_arms_and_boots(tmp_path, lab, capsys) -> None:
    path = ladder_with(tmp_path, "{name: A1exit, flags: {exit: 4}}")
    assert lab("run", str(path), "--name", "first") == 0
    capsys.readouterr()
    assert lab("ls") == 0
    out = capsys.readouterr().out
    assert "first" in out and "stub" in out and "done" in out
    assert lab("ls", "first") == 0
    out = capsys.readouterr().out
    for text in ("C0ctl", "A1exit", "control/open", "control/close", "failed", "exiting with 4 as asked"):
        assert text in out
    assert "1 valid" in out  # the memory cell of each control
    assert lab("ls", "nope") == 1
    assert "no run 'nope'" in capsys.readouterr().err
    assert lab("run", str(path), "--name", "first") == 1  # names are unique
    assert "a run named 'first' exists" in capsys.readouterr().err
    assert os.path.exists(tmp_path / "lab.db")


def test_lab_ls_counts_each_boots_invalid_cells_and_says_why(tmp_path, lab, capsys) -> None:
    body = ("windows:\n  - name: W1\n    control: C0ctl\n    arms:\n      - {name: A1, flags: {seqs: 2}}\n"
            "instruments:\n  decode: {levels: [1], max_tokens: 4}\n"
            "keep:\n  metrics: [{metric: decode.agg_tok_s, where: {level: 1}}]\n")
    # Every boot finished, yet none measured its key metric: the run fails, and says why.
    assert lab("run", str(stub_ladder(tmp_path, body)), "--name", "probe") == 1
    assert "run probe judged nothing: every key-metric cell (decode.agg_tok_s[level=1]) is invalid; commonest " \
           "reason: refused at the capability probe: the engine streams no usage" in capsys.readouterr().err
    assert lab("ls", "probe") == 0
    out = capsys.readouterr().out
    # The stub streams no usage and has no tokenizer: the capability probe finds that at each
    # boot, so decode sends nothing and stores its cells invalid with the reason, and the listing
    # says so per boot, with the probe's findings.
    why = "refused at the capability probe: the engine streams no usage and its"  # the table wraps the rest
    per_boot = re.findall(r"0 valid, (\d+) invalid \((\d+): " + re.escape(why), out)
    assert len(per_boot) == 3 and all(n == m != "0" for n, m in per_boot), out  # every cell, for one reason
    # decode's largest request (max_tokens + its prompts' bound) less the probe's 8 generated tokens,
    # sized by estimate: no tokenizer
    assert "boots 00, 01, 02: 252≈-token prompt ✓ · usage ✗ (uncountable) · ignore_eos unknown · logprobs ✗ · " \
           "tokenizer ✗ · metrics ✗ · stats ✗ · cache reset ✗" in out, out


def test_engine_command_that_cannot_start_is_a_failed_boot(tmp_path, lab, store, capsys) -> None:
    path = ladder_with(tmp_path, "{name: A1, flags: {seqs: 2}}")
    path.write_text(path.read_text().replace("command: [", "command: [no-such-engine-binary, "))
    assert lab("run", str(path)) == 1
    reasons = {b.reason for _, b in boots(store)}
    assert reasons == {"cannot start no-such-engine-binary: No such file or directory"}
    assert "no measured boot of run" in capsys.readouterr().err


def test_engines_listen_only_on_the_ports_the_ladder_allows(tmp_path, lab, store) -> None:
    """A firewall, or a second lab on the host, confines the engines to a range (hygiene.ports); a
    boot that finds every port of it taken fails with that reason, and the ladder goes on."""
    import socket

    from lab.runner.boot import free_port

    first = free_port()
    path = ladder_with(tmp_path, "{name: A1, flags: {seqs: 2}}", hygiene=f"hygiene: {{ports: [{first}, {first}]}}\n")
    assert lab("run", str(path)) == 0
    assert [boot.port for _, boot in boots(store)] == [first, first, first]
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the last boot left it in TIME_WAIT
        taken.bind(("127.0.0.1", first))
        taken.listen()
        assert lab("run", str(path)) == 1
    rows = [(slot, boot) for slot, boot in boots(store) if boot.run_id == 2]
    assert [(boot.status, boot.reason) for _, boot in rows] == [("failed", f"no free port in {first}-{first} "
                                                                           "(hygiene.ports)")] * 3
    assert "{port}" in rows[0][1].argv  # what would have run, the port left unfilled
