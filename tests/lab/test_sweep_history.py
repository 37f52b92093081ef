"""`lab sweep` files real runs under a series; `lab history` reads them back, `--check` gates on them."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from lab.cli import main as lab_main
from lab.store import reader
from lab.store.db import open_store
from tests.lab.conftest import KV_LABELS, KV_LADDER, REPO

pytestmark = pytest.mark.slow


def test_each_label_is_a_run_under_one_series_the_control_only_ones_of_the_controls(kv_series: Path) -> None:
    store = open_store(str(kv_series / "lab.db"))
    try:
        points = reader.series_points(store)
        assert [p.label for p in points] == list(KV_LABELS)
        assert len({p.series for p in points}) == 1 and points[0].series.startswith("kv@")
        slots = [[(s.arm, s.position, s.status) for s in reader.slots(store, p.run_id)] for p in points]
        assert slots[0] == [("C0ctl", "open", "done"), ("A1kv16m", "arm", "done"), ("C0ctl", "close", "done")]
        assert slots[1] == slots[2] == [("C0ctl", "open", "done"), ("C0ctl", "close", "done")]
        described = [yaml.safe_load(reader.find_run(store, str(p.run_id)).ladder_text).get("description", "")
                     for p in points]
        assert "controls only" not in described[0]
        assert described[1].endswith("controls only") and described[2].endswith("controls only")
    finally:
        store.close()


def test_history_shows_the_labels_and_check_passes_a_steady_series(kv_series: Path,
                                                                  capsys: pytest.CaptureFixture[str],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "250")
    assert lab_main(["history", "kv", "--check", "--html", str(kv_series / "reports"), "--db",
                     str(kv_series / "lab.db")]) == 0
    out = capsys.readouterr().out
    assert "memory.kv_pool_tokens" in out and "2026-01-03" in out and "step:" not in out
    # What the series can detect comes first, before any table.
    detects = "memory.kv_pool_tokens: changes larger than ±2.0 %, set by the KEEP threshold (2 %)"
    assert detects in out.split("┏")[0]
    page = next((kv_series / "reports").glob("history-kv*/index.html")).read_text()
    assert "data:image/png;base64," in page and "2026-01-02" in page
    assert "No metric's latest level is a regression." in page
    assert page.index("What this series detects") < page.index(detects) < page.index("<img")


def test_the_run_report_links_its_series_history_page(kv_series: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db, out = str(kv_series / "lab.db"), kv_series / "linked"
    assert lab_main(["report", "kv", "--out", str(out), "--db", db]) == 0
    [report] = list(out.iterdir())
    assert f"--html {out}` writes its history page" in (report / "index.md").read_text()  # no page yet
    assert lab_main(["history", "kv", "--html", str(out), "--db", db]) == 0
    assert lab_main(["report", "kv", "--out", str(out), "--db", db]) == 0
    capsys.readouterr()
    md = (report / "index.md").read_text()
    href = md.split("## History")[1].split("[its history page](")[1].split(")")[0]
    assert "2026-01-03" in (report / href).read_text()  # the link reaches the series' page
    assert f'<a href="{href}">its history page</a>' in (report / "index.html").read_text()


def test_a_label_already_in_the_series_is_refused_in_one_line(kv_series: Path, capsys: pytest.CaptureFixture[str],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "250")
    code = lab_main(["sweep", str(kv_series / "kv.yaml"), "--label", KV_LABELS[1], "--control-only",
                     "--db", str(kv_series / "lab.db"), "--runs-dir", str(kv_series / "runs")])
    assert code == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"lab: label '{KV_LABELS[1]}' is already in series kv@") and err.endswith("pick another")
    store = open_store(str(kv_series / "lab.db"))
    try:
        assert len(reader.list_runs(store)) == 3  # nothing was stored for the refused label
    finally:
        store.close()


def cron_line(directory: Path) -> str:
    """The command of docs/loop.md's crontab line, as cron's shell gets it, pointed at `directory`, this
    checkout's lab, the KV ladder and the label in $LABEL (two runs a day must not share a label)."""
    docs = (REPO / "docs" / "loop.md").read_text()
    [line] = [line for line in docs.split("### cron", 1)[1].splitlines() if line.startswith("15 2 * * * ")]
    command = line.split(None, 5)[5].replace("\\%", "%")  # cron turns an unescaped % into a newline
    for documented, here in (("/srv/lab", str(directory)), (".venv/bin/lab", f"{sys.executable} -m lab"),
                             ("ladders/quickstart.yaml", "kv.yaml"), ("history quickstart", "history kv"),
                             ('"$(git rev-parse --short HEAD)-$(date +%F)"', '"$LABEL"')):
        assert documented in command, f"docs/loop.md's crontab line no longer has {documented!r}"
        command = command.replace(documented, here)
    return command


def test_the_documented_nightly_job_survives_a_base_change_with_its_own_status(tmp_path: Path) -> None:
    ladder = tmp_path / "kv.yaml"
    ladder.write_text(textwrap.dedent(KV_LADDER))
    command = cron_line(tmp_path)

    def nightly(label: str) -> tuple[str, str]:
        """What cron would mail, and the gate's last line in nightly.log."""
        done = subprocess.run(["sh", "-c", command], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                              env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "250", "LABEL": label})
        log = (tmp_path / "nightly.log").read_text()
        return done.stdout + done.stderr, " ".join(log[log.rindex("lab: check: "):].split()) if "lab: check: " in log else ""

    def gate() -> tuple[int, str]:
        done = subprocess.run([sys.executable, "-m", "lab", "history", "kv", "--check"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "250"})
        return done.returncode, " ".join(done.stderr.split())

    mailed, checked = nightly("n1")
    assert mailed == "" and checked.endswith("nothing to compare yet (exit status 3: no data)")
    mailed, checked = nightly("n2")
    assert mailed == "" and checked.endswith("(n1 … n2) (exit status 0: ok)")

    # One flag added to the base: the same series goes on, under a new base the gate names.
    ladder.write_text(ladder.read_text().replace("max-model-len: 512,", "max-model-len: 512, max-num-seqs: 4,"))
    mailed, checked = nightly("n3")
    assert mailed == ""
    assert "the base changed at label n3 (flags +max-num-seqs=4); nothing under it to compare with yet" in checked
    assert checked.endswith("(exit status 4: base changed)")
    status, said = gate()
    assert status == 4 and said.startswith(f"lab: check: series kv@{socket.gethostname()}: the base changed")
    page = next((tmp_path / "reports").glob("history-kv*/index.html")).read_text()
    assert "the base changed at label n3 (flags +max-num-seqs=4)" in page and "exit status 4" in page

    mailed, checked = nightly("n4")
    assert mailed == "" and checked.endswith("over 2 labels (n3 … n4) since the base changed at label n3 "
                                             "(exit status 0: ok)")
    assert gate()[0] == 0

    # A label already filed: the sweep fails, and that is mailed.
    mailed, _ = nightly("n4")
    assert mailed.startswith("lab nightly: exit status 1 (1: regression, 2: broken gate, else the sweep failed)")
    assert "label 'n4' is already in series kv@" in " ".join(mailed.split())

    # A gate that cannot run has its own status: not a regression, not silence.
    done = subprocess.run([sys.executable, "-m", "lab", "history", "kv@elsewhere", "--check"], cwd=tmp_path,
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 2 and "no series 'kv@elsewhere' in this store" in done.stderr
