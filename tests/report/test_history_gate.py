"""`lab history --check` on series filed through the store's writer, one run per label built cell by cell:
a confirmed regression is status 1 with what, how much and since when; a ladder swept on two hosts is a
broken gate (2) until one is named; series an earlier lab named with the config hash are read as one."""

from __future__ import annotations

from pathlib import Path

import pytest

from lab.cli import main as lab_main
from lab.store import writer
from tests.report.conftest import Boot, build_run

KEY = "memory.kv_pool_tokens"


def file_label(store, label: str, kv: float, host: str = "nightly-host", series: str | None = None,
               config_hash: str = "c0ffee00c0ffee00") -> None:
    """A sweep of the built ladder's control alone under `label`: two control boots measuring `kv`."""
    control = Boot(values={KEY: kv, "memory.host_mem_available_floor_gib": 5.0})
    run_id = build_run(store, {"C0ctl/open": control, "C0ctl/close": control}, name=f"{host}-{label}")
    writer.add_series_point(store, series=series or f"built@{host}", label=label, run_id=run_id, ladder_name="built",
                            host=host, identity={"engine_kind": "bundled", "model": "smollm2-135m",
                                                 "control": "C0ctl", "control_config_hash": config_hash})


def check(store_path: Path, *args: str) -> int:
    return lab_main(["history", *args, "--check", "--db", str(store_path)])


@pytest.fixture(autouse=True)
def wide(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "250")


def test_a_confirmed_regression_is_status_1_naming_the_metric_the_change_and_its_first_label(
        store, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for n, kv in enumerate([1000.0] * 5 + [900.0] * 2):
        file_label(store, f"d{n}", kv)
    assert check(tmp_path / "lab.db", "built", "--html", str(tmp_path / "reports")) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert (f"lab: regression: {KEY} regressed -10.0 % since label d5 (run nightly-host-d5): regression of -10.0 % from "
            "label d5 (1000 → 900 tokens, 5 → 2 labels") in err
    assert err.endswith("lab: check: series built@nightly-host: 1 metric(s) regressed (labels d0 … d6) (exit status "
                        "1: regression)")
    page = next((tmp_path / "reports").glob("history-built*/index.html")).read_text()
    assert "regressed -10.0 % since label d5" in page and "exit status 1: regression" in page


def test_a_departure_on_the_last_label_is_a_warning_not_a_regression(store, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    for n, kv in enumerate([1000.0] * 5 + [900.0]):
        file_label(store, f"d{n}", kv)
    assert check(tmp_path / "lab.db", "built") == 0
    err = " ".join(capsys.readouterr().err.split())
    assert f"lab: warning: {KEY}: label d5 departs beyond ±2.0 % in the bad direction; unconfirmed" in err


def test_a_ladder_swept_on_two_hosts_is_a_broken_gate_until_one_is_named(store, tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    file_label(store, "d0", 1000.0, host="alpha")
    file_label(store, "d1", 1000.0, host="alpha")
    file_label(store, "d0", 1000.0, host="beta")
    assert check(tmp_path / "lab.db", "built") == 2
    assert capsys.readouterr().err.strip() == ("lab: ladder built has 2 series, one per host (built@alpha, built@beta); "
                                               "name one")
    assert check(tmp_path / "lab.db", "built@alpha") == 0
    assert check(tmp_path / "lab.db", "built@beta") == 3  # one label: nothing to compare yet
    assert check(tmp_path / "lab.db", "built@gamma") == 2
    assert lab_main(["history", "--check", "--db", str(tmp_path / "lab.db")]) == 2
    assert check(tmp_path / "absent.db", "built") == 2


def test_series_an_earlier_lab_named_by_config_hash_are_one_series_with_a_base_change(
        store, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # An earlier lab filed each base config under its own name, <ladder>@<host>:<hash>.
    for n in range(2):
        file_label(store, f"d{n}", 1000.0, series="built@nightly-host:aaaaaaaa", config_hash="aaaaaaaa11111111")
    file_label(store, "d2", 1000.0, series="built@nightly-host:bbbbbbbb", config_hash="bbbbbbbb22222222")
    assert lab_main(["history", "--db", str(tmp_path / "lab.db")]) == 0
    assert capsys.readouterr().out.strip() == "built@nightly-host: 3 labels, d0 … d2"
    assert check(tmp_path / "lab.db", "built@nightly-host:aaaaaaaa") == 4  # the old name still answers
    err = " ".join(capsys.readouterr().err.split())
    assert "the base changed at label d2 (config hash aaaaaaaa → bbbbbbbb)" in err
    # A label an earlier lab filed is taken in the series this lab files under.
    again = build_run(store, {}, name="again")
    with pytest.raises(ValueError, match="label 'd1' is already in series built@nightly-host "):
        writer.add_series_point(store, series="built@nightly-host", label="d1", run_id=again, ladder_name="built",
                                host="nightly-host", identity={})
