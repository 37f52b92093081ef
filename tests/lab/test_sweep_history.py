"""`lab sweep` files real runs under a series; `lab history` reads them back, `--check` gates on them."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lab.cli import main as lab_main
from lab.store import reader
from lab.store.db import open_store
from tests.lab.conftest import KV_LABELS

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
    page = next((kv_series / "reports").glob("history-kv*/index.html")).read_text()
    assert "data:image/png;base64," in page and "2026-01-02" in page
    assert "No metric's latest level is a regression." in page


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
