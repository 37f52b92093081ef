"""qeval and needle on random weights: a real `dummy:smollm2-135m` server gets no completion request,
every cell says "not applicable" with the reason, and a verdict keyed on other metrics is not
touched by them; on real weights qeval still asks and scores."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.console import Console

from lab.analysis import compare
from lab.analysis import verdicts
from lab.instruments.needle import NeedleInstrument
from lab.instruments.qeval import QevalInstrument
from lab.report import tables
from lab.report.data import load
from lab.store.db import open_store
from lab.store.records import Cell
from tests.engine.server_process import engine_server
from tests.instruments.speed_boot import ENGINE_FLAGS, SpeedBench, Stored
from tests.report.conftest import Boot, build_run

DUMMY = "dummy:smollm2-135m"
REASON = f"not applicable: the engine serves random weights ({DUMMY}), so answers carry no knowledge"
QEVAL = {"per_category": 1}
NEEDLE = {"lengths": [256, 512], "depths": [0.5]}


@pytest.fixture(scope="module")
def dummy_bench(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SpeedBench]:
    tmp = tmp_path_factory.mktemp("dummy")
    store = open_store(str(tmp / "lab.db"))
    with engine_server(tmp, "--model", DUMMY, *ENGINE_FLAGS) as server:
        yield SpeedBench(store, server)
    store.close()


def measure(bench: SpeedBench, instrument: QevalInstrument | NeedleInstrument, params: dict) -> Stored:
    """The instrument on the dummy server, with the completions the engine finished meanwhile checked."""
    finished = bench.server.stats()["requests_finished"]
    stored = bench.measure(instrument, params, salt=f"na-{instrument.name}", model=DUMMY)
    assert bench.server.stats()["requests_finished"] == finished
    return stored


def test_qeval_on_random_weights_sends_nothing_and_every_cell_says_why(dummy_bench: SpeedBench) -> None:
    stored = measure(dummy_bench, QevalInstrument(), QEVAL)
    assert [(s.key, s.status) for s in stored.steps] == [("tasks", "ok")]
    assert not stored.requests
    # Every metric qeval declares, the paired ones included (this boot is an arm), one per category.
    assert {c.metric for c in stored.cells} == set(QevalInstrument().metrics(QevalInstrument.Params()))
    assert len(stored.of("category_score")) == 8
    assert all(not c.valid and c.value is None and c.note == REASON and c.request_ids == [] for c in stored.cells)


def test_needle_on_random_weights_sends_nothing_and_every_cell_says_why(dummy_bench: SpeedBench) -> None:
    stored = measure(dummy_bench, NeedleInstrument(), NEEDLE)
    assert [(s.key, s.status) for s in stored.steps] == [
        ("length=256/depth=0.5/rep=0", "ok"), ("length=512/depth=0.5/rep=0", "ok"), ("found_rate", "ok")]
    assert not stored.requests
    for length in (256, 512):
        for metric in ("found", "prefill_tok_s"):
            cell = stored.cell(metric, length=length, depth=0.5)
            assert not cell.valid and cell.value is None and cell.note == REASON
    rate = stored.cell("found_rate")
    assert not rate.valid and rate.value is None and rate.note == REASON


@pytest.mark.slow
def test_qeval_on_real_weights_still_asks_and_scores(bench: SpeedBench) -> None:
    stored = bench.measure(QevalInstrument(), {"tasks": ["arith_01", "clf_02"], "max_tokens_scale": 0.25},
                           salt="na-real")
    assert [r.endpoint for r in stored.requests.values()] == ["/v1/chat/completions"] * 2
    assert all(r.error is None for r in stored.requests.values())
    score = stored.cell("score")
    assert score.valid and score.value in (0.0, 0.5, 1.0) and "/2 passed" in score.note


# The ladder a user writes for speed work on random weights: qeval and needle listed, the rule on memory.
LADDER = f"""\
name: dummyrun
engine: {{kind: bundled, model: "{DUMMY}", flags: {{device: cpu}}}}
windows:
  - name: W1
    control: C0ctl
    arms:
      - {{name: A1, flags: {{max-num-seqs: 4}}}}
instruments:
  memory:
  qeval: {{per_category: 1}}
  needle: {{lengths: [256, 512], depths: [0.5]}}
keep:
  threshold_pct: 2
  metrics: [memory.kv_pool_tokens]
  gates:
    - {{metric: memory.host_mem_available_floor_gib, min: 1}}
"""


def test_a_verdict_compare_and_report_read_not_applicable_cells_as_neither_failure_nor_gap(
        dummy_bench: SpeedBench, tmp_path: Path) -> None:
    quality = {}
    for instrument, params in ((QevalInstrument(), QEVAL), (NeedleInstrument(), NEEDLE)):
        stored = measure(dummy_bench, instrument, params)
        quality[instrument.name] = [Cell(c.metric, c.value, c.unit, dict(c.params), c.repeat, c.valid, c.note, [])
                                    for c in stored.cells]
    store = open_store(str(tmp_path / "lab.db"))
    try:
        run_id = build_run(store, {
            label: Boot(values={"memory.kv_pool_tokens": kv, "memory.host_mem_available_floor_gib": 5.0},
                        cells=quality)
            for label, kv in (("C0ctl/open", 1000), ("A1", 1100), ("C0ctl/close", 1000))}, ladder=LADDER)
        verdict = verdicts.judge(verdicts.load(store, run_id))["A1"]
        assert str(verdict.decision) == "keep", verdict.reasons
        assert not [r for r in verdict.reasons if "qeval" in r or "needle" in r or "invalid" in r]

        comparison = compare.compare(store, "C0ctl", "A1")
        assert [row.metric for row in comparison.rows] == ["memory.kv_pool_tokens",
                                                           "memory.host_mem_available_floor_gib"]
        assert comparison.quality.qeval is None
        assert comparison.verdicts["A1"]["decision"] == "keep"
        console = Console(record=True, width=250)
        compare.print_comparison(console, comparison)
        assert "KEEP A1: keep" in console.export_text()

        data = load(store, run_id)
        qeval = tables.qeval_table(data)
        assert list(qeval["boot"]) == ["C0ctl/open", "A1", "C0ctl/close"] and set(qeval["note"]) == {REASON}
        figures = tables.figures_table(data)
        needle = figures[(figures["instrument"] == "needle") & (figures["metric"] == "found_rate")]
        assert needle[["C0ctl/open", "A1", "C0ctl/close", "note"]].values.tolist() == [["n/a"] * 3 + [REASON]]
        kv = figures[figures["metric"] == "kv_pool_tokens"]
        assert kv[["C0ctl/open", "A1", "note"]].values.tolist() == [["1,000.0", "1,100.0", ""]]
    finally:
        store.close()
