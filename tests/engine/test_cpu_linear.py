"""The CPU product layout is measured per host at load, kept in a choices file, and reused."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lab.engine.model import cpu_linear
from lab.engine.model.cpu_linear import (NARROW_MAX_ROWS, ROW_BUCKETS, CpuLinear, choice_builds, choices_path, host_key,
                                         narrow_linear)


@pytest.fixture(autouse=True)
def quiet_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """Treat the host as quiet whatever else runs on it, so the figures are written."""
    monkeypatch.setattr(cpu_linear, "MAX_WAITING_SHARE", float("inf"))


def small_model() -> tuple[list[tuple[torch.Tensor, ...]], list[torch.Tensor]]:
    """Two layers of a fused q|k|v, an output and an MLP pair, and an LM head: the model's shapes."""
    gen = torch.Generator().manual_seed(0)

    def w(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen)

    layers = [(w(96, 64), w(64, 64), w(256, 64), w(64, 128)) for _ in range(2)]
    return layers, [w(512, 64)]


def stored(root: Path) -> dict:
    return json.loads(choices_path(root).read_text("utf-8"))


def test_first_load_measures_every_shape_and_writes_the_choices(tmp_path: Path) -> None:
    layers, head = small_model()
    before = len(choice_builds())
    op = CpuLinear.for_model(layers, head, root=tmp_path)
    assert choice_builds()[before:] == [choices_path(tmp_path)]
    data = stored(tmp_path)
    assert data["host"] == host_key()
    assert set(data["shapes"]) == {"float32 96x64", "float32 64x64", "float32 256x64", "float32 64x128",
                                   "float32 512x64"}
    for entries in data["shapes"].values():
        assert [e["rows"] for e in entries] == list(ROW_BUCKETS)
        for e in entries:
            assert e["linear_us"] > 0 and e["narrow_us"] > 0
            assert e["narrow"] == (e["narrow_us"] < e["linear_us"])  # the faster layout is the one chosen
    assert op.narrow[(512, 64)] == tuple(e["narrow"] for e in data["shapes"]["float32 512x64"])


def test_a_later_load_uses_the_file_without_measuring(tmp_path: Path) -> None:
    layers, head = small_model()
    CpuLinear.for_model(layers, head, root=tmp_path)
    # Every choice set to the narrow product: a load that measured would not agree with all of them.
    data = stored(tmp_path)
    for entries in data["shapes"].values():
        for e in entries:
            e["narrow"] = True
    choices_path(tmp_path).write_text(json.dumps(data), "utf-8")
    before = len(choice_builds())
    op = CpuLinear.for_model(layers, head, root=tmp_path)
    assert len(choice_builds()) == before
    assert all(all(wins) for wins in op.narrow.values())
    assert stored(tmp_path) == data


def test_a_new_shape_is_measured_and_added_to_the_file(tmp_path: Path) -> None:
    layers, head = small_model()
    CpuLinear.for_model(layers, head, root=tmp_path)
    before = len(choice_builds())
    CpuLinear.for_model(layers, [torch.randn(320, 64)], root=tmp_path)
    assert len(choice_builds()) == before + 1
    assert {"float32 512x64", "float32 320x64"} <= set(stored(tmp_path)["shapes"])


@pytest.mark.parametrize("damage", ["{not json", '{"format": 1, "host": {}, "shapes": 3}', "[]",
                                    "GARBAGE-HOST"])
def test_a_damaged_file_is_ignored_with_a_warning_and_rebuilt(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                              damage: str) -> None:
    layers, head = small_model()
    path = choices_path(tmp_path)
    path.parent.mkdir(parents=True)
    if damage == "GARBAGE-HOST":
        damage = json.dumps({"format": 1, "host": host_key(), "shapes": {"float32 96x64": [{"rows": 1}]}})
    path.write_text(damage, "utf-8")
    caplog.set_level(logging.WARNING, logger="lab.engine.model.cpu_linear")
    before = len(choice_builds())
    CpuLinear.for_model(layers, head, root=tmp_path)
    assert len(choice_builds()) == before + 1
    assert any("measuring again" in r.getMessage() for r in caplog.records)
    assert len(stored(tmp_path)["shapes"]) == 5


def test_an_unwritable_cache_root_only_warns(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    layers, head = small_model()
    root = tmp_path / "a-file"
    root.write_text("not a directory")  # mkdir under it fails, as in a read-only home
    caplog.set_level(logging.WARNING, logger="lab.engine.model.cpu_linear")
    op = CpuLinear.for_model(layers, head, root=root)
    assert any("could not write" in r.getMessage() for r in caplog.records)
    x = torch.randn(3, 64)
    torch.testing.assert_close(op(x, head[0]), F.linear(x, head[0]))


def test_figures_measured_on_a_busy_host_serve_the_boot_but_are_not_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(cpu_linear, "MAX_WAITING_SHARE", -1.0)  # any time waiting for a core is too much
    caplog.set_level(logging.WARNING, logger="lab.engine.model.cpu_linear")
    layers, head = small_model()
    before = len(choice_builds())
    op = CpuLinear.for_model(layers, head, root=tmp_path)
    assert len(choice_builds()) == before + 1
    assert not choices_path(tmp_path).exists()
    assert set(op.narrow) == {(96, 64), (64, 64), (256, 64), (64, 128), (512, 64)}
    assert any("busy" in r.getMessage() for r in caplog.records)
    # A second load in the same process keeps this one's layouts rather than measuring anew.
    again = CpuLinear.for_model(layers, head, root=tmp_path)
    assert again.narrow == op.narrow
    assert len(choice_builds()) == before + 1


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 33, NARROW_MAX_ROWS, NARROW_MAX_ROWS + 1, 200])
@pytest.mark.parametrize("narrow", [True, False])
def test_either_layout_gives_f_linear_s_result(rows: int, narrow: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 64, generator=gen)
    bias = torch.randn(96, generator=gen)
    x = torch.randn(rows, 64, generator=gen)
    op = CpuLinear({(96, 64): tuple(narrow for _ in ROW_BUCKETS)})
    torch.testing.assert_close(op(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(op(x, w, bias), F.linear(x, w, bias), rtol=1e-5, atol=1e-5)
    assert op(x, w).is_contiguous()


def test_the_narrow_product_of_one_row() -> None:
    w, x = torch.randn(40, 24), torch.randn(1, 24)
    y = narrow_linear(x, w)
    assert y.shape == (1, 40)
    torch.testing.assert_close(y, F.linear(x, w), rtol=1e-5, atol=1e-5)
