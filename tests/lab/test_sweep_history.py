"""`lab sweep` files real runs under a series; `lab history` reads them back, `--check` gates on them."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from lab.cli import main as lab_main
from lab.store import reader
from lab.store.db import open_store

pytestmark = pytest.mark.slow

LADDER = """\
    name: nightly
    engine:
      kind: bundled
      model: dummy:tiny
      flags: {device: cpu, max-model-len: 512, kv-cache-memory-bytes: 8388608}
    windows:
      - name: W1
        control: C0ctl
        arms:
          - {name: A1kv16m, flags: {kv-cache-memory-bytes: 16777216}}
    instruments:
      memory:
    keep:
      metrics: [memory.kv_pool_tokens]
    """


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three nightly labels of the controls alone (two dummy:tiny boots each)."""
    cwd = tmp_path_factory.mktemp("sweep")
    (cwd / "nightly.yaml").write_text(textwrap.dedent(LADDER))
    for label in ("2026-01-01", "2026-01-02", "2026-01-03"):
        code = lab_main(["sweep", str(cwd / "nightly.yaml"), "--label", label, "--control-only",
                         "--db", str(cwd / "lab.db"), "--runs-dir", str(cwd / "runs")])
        assert code == 0
    return cwd


def test_each_label_is_a_run_of_the_controls_under_one_series(swept: Path) -> None:
    store = open_store(str(swept / "lab.db"))
    try:
        points = reader.series_points(store)
        assert [p.label for p in points] == ["2026-01-01", "2026-01-02", "2026-01-03"]
        assert len({p.series for p in points}) == 1 and points[0].series.startswith("nightly@")
        for point in points:
            slots = reader.slots(store, point.run_id)
            assert [(s.arm.name, s.position, s.status) for s in slots] == [("C0ctl", "open", "done"),
                                                                         ("C0ctl", "close", "done")]
    finally:
        store.close()


def test_history_shows_the_labels_and_check_passes_a_steady_series(swept: Path, capsys: pytest.CaptureFixture[str],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "250")
    assert lab_main(["history", "nightly", "--check", "--html", str(swept / "reports"), "--db",
                     str(swept / "lab.db")]) == 0
    out = capsys.readouterr().out
    assert "memory.kv_pool_tokens" in out and "2026-01-03" in out and "step:" not in out
    page = next((swept / "reports").glob("history-nightly*/index.html")).read_text()
    assert "data:image/png;base64," in page and "2026-01-02" in page
    assert "No metric's latest level is a regression." in page


def test_the_run_report_links_its_series_history_page(swept: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db, out = str(swept / "lab.db"), swept / "linked"
    assert lab_main(["report", "nightly", "--out", str(out), "--db", db]) == 0
    [report] = list(out.iterdir())
    assert f"--html {out}` writes its history page" in (report / "index.md").read_text()  # no page yet
    assert lab_main(["history", "nightly", "--html", str(out), "--db", db]) == 0
    assert lab_main(["report", "nightly", "--out", str(out), "--db", db]) == 0
    capsys.readouterr()
    md = (report / "index.md").read_text()
    href = md.split("## History")[1].split("[its history page](")[1].split(")")[0]
    assert "2026-01-03" in (report / href).read_text()  # the link reaches the series' page
    assert f'<a href="{href}">its history page</a>' in (report / "index.html").read_text()


def test_a_label_already_in_the_series_is_refused_in_one_line(swept: Path, capsys: pytest.CaptureFixture[str],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "250")
    code = lab_main(["sweep", str(swept / "nightly.yaml"), "--label", "2026-01-02", "--control-only",
                     "--db", str(swept / "lab.db"), "--runs-dir", str(swept / "runs")])
    assert code == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("lab: label '2026-01-02' is already in series nightly@") and err.endswith("pick another")
    store = open_store(str(swept / "lab.db"))
    try:
        assert len(reader.list_runs(store)) == 3  # nothing was stored for the refused label
    finally:
        store.close()
