"""`lab export RUN`: every table of one run, readable back by pandas, and nothing of another run."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from lab.report.export import export_run
from lab.runner.run import store_verdicts
from lab.store.records import Cell
from tests.report.conftest import Boot, build_run, lab_cli

TABLES = ("runs", "arms", "slots", "boots", "steps", "cells", "requests", "qeval_items", "verdicts")


@pytest.fixture
def two_runs(store) -> None:
    params = Boot(values={"memory.kv_pool_tokens": [1000.0, 1010.0], "memory.host_mem_available_floor_gib": 5.0},
                  cells={"memory": [Cell("kv_pool_gib", 0.25, "GiB", params={"pool": "main", "n": 2},
                                         requests=[])]},
                  items={"t1": True, "t2": False})
    build_run(store, {"C0ctl/open": params, "A1": params, "C0ctl/close": params}, name="one")
    store_verdicts(store, 1, "W1")  # as `lab run` does when the window closes
    build_run(store, {"C0ctl/open": params}, name="other")


def test_csv_is_one_file_per_table_with_only_the_runs_rows(store, two_runs, tmp_path: Path) -> None:
    directory = export_run(store, "one", "csv", tmp_path)
    assert directory == tmp_path / "one"
    assert sorted(p.name for p in directory.iterdir()) == sorted(f"{t}.csv" for t in TABLES)
    cells = pd.read_csv(directory / "cells.csv")
    assert len(cells) == 3 * 4  # three boots: two kv repeats, a floor and a params cell each
    assert set(pd.read_csv(directory / "runs.csv")["name"]) == {"one"}
    params = cells.loc[cells["metric"] == "kv_pool_gib", "params"].iloc[0]
    assert json.loads(params) == {"pool": "main", "n": 2}  # nested values as JSON text
    assert list(pd.read_csv(directory / "verdicts.csv")["decision"]) == ["reject", "inconclusive"]  # A2 never booted
    assert len(pd.read_csv(directory / "qeval_items.csv")) == 6


def test_parquet_reads_back_with_the_same_rows(store, two_runs, tmp_path: Path) -> None:
    directory = export_run(store, "one", "parquet", tmp_path)
    boots = pd.read_parquet(directory / "boots.parquet")
    assert len(boots) == 3 and list(boots["status"]) == ["done"] * 3
    assert pd.api.types.is_datetime64_any_dtype(boots["started_at"])
    assert len(pd.read_parquet(directory / "cells.parquet")) == 12


def test_json_is_one_document_with_nested_values_kept(store, two_runs, tmp_path: Path) -> None:
    directory = export_run(store, "one", "json", tmp_path)
    document = json.loads((directory / "one.json").read_text())
    assert document["run"] == "one" and list(document["tables"]) == list(TABLES)
    cell = next(c for c in document["tables"]["cells"] if c["metric"] == "kv_pool_gib")
    assert cell["params"] == {"pool": "main", "n": 2}
    assert document["tables"]["boots"][0]["ready_at"].startswith("20")  # ISO 8601
    verdict = document["tables"]["verdicts"][0]
    assert verdict["decision"] == "reject" and verdict["detail"]["metrics"][0]["name"] == "memory.kv_pool_tokens"


@pytest.mark.parametrize("fmt", ["csv", "json"])
def test_lab_export_prints_where_it_wrote(store, two_runs, tmp_path: Path, fmt: str) -> None:
    done = lab_cli(["export", "one", "--format", fmt, "--db", str(tmp_path / "lab.db"), "--out", "out"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"exported to {Path('out') / 'one'}"
    assert (tmp_path / "out" / "one").is_dir()


def test_lab_export_of_an_unknown_run_says_so(store, two_runs, tmp_path: Path) -> None:
    done = lab_cli(["export", "nope", "--format", "csv", "--db", str(tmp_path / "lab.db")], tmp_path)
    assert done.returncode == 1 and "no run 'nope' in this store; `lab ls` lists the runs" in done.stderr
