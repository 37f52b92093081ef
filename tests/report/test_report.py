"""`lab report`: a real quickstart run's report has every figure its instruments allow, as valid PNGs,
in a self-contained HTML page and a Markdown page beside them; figures read on their own."""

from __future__ import annotations

import base64
import io
import re
from pathlib import Path

import matplotlib.image
import pytest
from matplotlib.figure import Figure
from sqlalchemy import select

from lab.report import figures
from lab.report.build import write_report
from lab.report.data import load
from lab.store import models as m
from lab.store.db import open_store
from lab.store.records import Cell
from tests.report.conftest import Boot, Quickstart, build_run, lab_cli

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# Figure file -> the instrument it needs (None: every run has it).
FIGURES = {"keep": None, "decode_ladder": "decode", "prefill": "prefill", "needle": "needle", "mixed": "mixed",
           "boot_timeline": None}


def assert_png(data: bytes) -> None:
    assert data.startswith(PNG_SIGNATURE) and len(data) > 5000
    pixels = matplotlib.image.imread(io.BytesIO(data), format="png")
    assert pixels.shape[0] > 200 and pixels.shape[1] > 400
    assert pixels.std() > 0.01  # not a blank canvas


@pytest.fixture(scope="module")
def report(quickstart: Quickstart) -> Path:
    done = lab_cli(["report", "--db", str(quickstart.db), "--out", "reports"], quickstart.directory)
    assert done.returncode == 0, done.stderr
    assert "report written to reports/qs/index.html and reports/qs/index.md" in done.stdout.replace("\n", "")
    return quickstart.directory / "reports" / "qs"


@pytest.mark.slow
def test_the_quickstart_report_has_every_figure_its_instruments_allow(report: Path, quickstart: Quickstart) -> None:
    measured = {name for name, _ in quickstart.ladder.instruments.sections()}
    expected = {name for name, needs in FIGURES.items() if needs is None or needs in measured}
    assert {p.stem for p in report.glob("*.png")} == expected
    for name in expected:
        assert_png((report / f"{name}.png").read_bytes())
    markdown = (report / "index.md").read_text()
    for name, needs in FIGURES.items():
        if name in expected:
            assert f"]({name}.png)" in markdown
        else:
            assert f"not measured: `{needs}` is not in this ladder" in markdown


@pytest.mark.slow
def test_the_html_report_is_self_contained(report: Path) -> None:
    page = (report / "index.html").read_text()
    embedded = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(embedded) == len(list(report.glob("*.png")))
    assert {base64.b64decode(e) for e in embedded} == {p.read_bytes() for p in report.glob("*.png")}
    assert not re.search(r'(src|href)="(https?:)?//', page) and "<link" not in page and "<script" not in page
    assert "<style>" in page


@pytest.mark.slow
def test_the_report_states_verdicts_ladder_and_environment(report: Path, quickstart: Quickstart) -> None:
    store = open_store(str(quickstart.db), read_only=True)
    with store.session() as s:
        ladder_text = s.scalar(select(m.Run.ladder_text).where(m.Run.name == quickstart.run))
    store.close()
    for page in ((report / "index.md").read_text(), (report / "index.html").read_text()):
        assert "C1mnbt256" in page and "C2nopc" in page
        assert "no key metric improves" in page or "(> 2 %)" in page or "inconclusive" in page
        assert "git_commit" in page and "packages.torch" in page
    assert ladder_text.strip() in (report / "index.md").read_text()
    page = (report / "index.html").read_text()
    assert re.search(r'<tr class="(keep|reject|inconclusive)"><td>C1mnbt256</td>', page)


def test_a_run_without_an_instrument_skips_its_figure_with_a_note(store, tmp_path: Path) -> None:
    boot = Boot(values={"memory.kv_pool_tokens": 1000.0, "memory.host_mem_available_floor_gib": 5.0})
    build_run(store, {"C0ctl/open": boot, "A1": boot, "A2": boot, "C0ctl/close": boot})
    directory = write_report(store, None, tmp_path / "reports")
    assert {p.name for p in directory.glob("*.png")} == {"keep.png", "boot_timeline.png"}
    markdown = (directory / "index.md").read_text()
    assert "_Decode ladder: not measured: `decode` is not in this ladder_" in markdown
    assert "| A1 | W1 | max-num-seqs=4 | reject |" in markdown


def test_report_of_a_run_with_no_cells_is_refused(store, tmp_path: Path) -> None:
    build_run(store, {})
    with pytest.raises(LookupError, match="run built has no stored cells yet; `lab ls built` shows its boots"):
        write_report(store, "built", tmp_path)
    done = lab_cli(["report", "nope", "--db", str(tmp_path / "lab.db")], tmp_path)
    assert done.returncode == 1 and "no run 'nope' in this store" in done.stderr


# --- each figure on constructed cells: three boots, so every line and panel has a neighbour ----------------

def cells_of(scale: float) -> dict[str, list[Cell]]:
    """Cells as the instruments store them, `scale` times a base shape."""
    decode = [Cell(metric, value * scale * (1 if metric == figures.DECODE_AGGREGATE else 1 / c), "tok/s",
                   params={figures.DECODE_X: c}, requests=[])
              for c, value in ((1, 10.0), (2, 18.0), (4, 30.0), (8, 44.0))
              for metric in (figures.DECODE_AGGREGATE, figures.DECODE_PER_STREAM)]
    prefill = [Cell(figures.PREFILL_METRIC, 400 * scale - length / 40 + rep, "tok/s",
                    params={figures.PREFILL_X: length}, repeat=rep, requests=[])
               for length in (128, 512, 2048) for rep in range(3)]
    needle = [Cell(figures.NEEDLE_METRIC, float(not (length == 4096 and depth == 0.5 and rep == 0)), "found",
                   params={figures.NEEDLE_LENGTH: length, figures.NEEDLE_DEPTH: depth}, repeat=rep, requests=[])
              for length in (1024, 4096) for depth in (0.0, 0.5, 1.0) for rep in range(2)]
    mixed = [Cell(figures.MIXED_ALONE, 0.1 * scale, "s", requests=[]),
             Cell(figures.MIXED_BEHIND, 2.9 * scale, "s", requests=[])]
    return {"decode": decode, "prefill": prefill, "needle": needle, "mixed": mixed}


@pytest.fixture
def constructed(store):
    build_run(store, {"C0ctl/open": Boot(cells=cells_of(1.0)), "A1": Boot(cells=cells_of(1.2)),
                      "A2": Boot(cells=cells_of(0.9), cold=True), "C0ctl/close": Boot(cells=cells_of(1.01))})
    data = load(store, 1)
    return data, figures.slot_styles(data.slots)


def legend(figure: Figure) -> list[str]:
    legends = [ax.get_legend() for ax in figure.axes if ax.get_legend() is not None]
    return [t.get_text() for t in legends[0].get_texts()]


def test_decode_ladder_draws_both_panels_one_line_per_warm_boot_controls_grey_dashed(constructed) -> None:
    data, styles = constructed
    figure = figures.decode_ladder(data.instrument_cells("decode"), styles)
    left, right = figure.axes
    assert legend(figure) == ["controls (2 boots)", "A1 (1 boot)"]  # the cold A2 is no figure
    assert [line.get_linestyle() for line in left.get_lines()] == ["--", "-", "--"]
    assert list(left.get_lines()[1].get_ydata()) == pytest.approx([12.0, 21.6, 36.0, 52.8])
    assert list(right.get_lines()[1].get_ydata()) == pytest.approx([12.0, 10.8, 9.0, 6.6])
    assert left.get_xlabel() == "concurrent streams" and "tok/s" in left.get_ylabel()
    assert figure.get_suptitle().startswith("Decode ladder")
    assert_png(figures.png(figure))


def test_prefill_is_median_throughput_against_a_log_length_axis(constructed) -> None:
    data, styles = constructed
    figure = figures.prefill(data.instrument_cells("prefill"), styles)
    [ax] = figure.axes
    assert ax.get_xscale() == "log" and "tokens" in ax.get_xlabel() and "tok/s" in ax.get_ylabel()
    assert list(ax.get_lines()[0].get_xdata()) == [128, 512, 2048]
    assert list(ax.get_lines()[0].get_ydata()) == pytest.approx([397.8, 388.2, 349.8])  # median of the repeats
    assert legend(figure) == ["controls (2 boots)", "A1 (1 boot)"]
    assert_png(figures.png(figure))


def test_needle_is_a_found_rate_heat_map_per_boot(constructed) -> None:
    data, styles = constructed
    figure = figures.needle(data.instrument_cells("needle"), styles)
    panels = [ax for ax in figure.axes if ax.get_title()]
    assert [ax.get_title() for ax in panels] == ["C0ctl/open", "A1", "C0ctl/close"]
    grid = panels[0].get_images()[0].get_array()
    assert grid.shape == (3, 2) and grid[1, 1] == 0.5 and grid.sum() == 5.5  # one miss in two at 4096, 50 %
    assert panels[0].get_xlabel() == "context length (tokens)" and panels[0].get_ylabel() == "needle depth"
    assert any("found rate" in ax.get_ylabel() for ax in figure.axes)  # the colour bar says what colour means
    assert_png(figures.png(figure))


def test_mixed_traffic_groups_alone_and_behind_per_boot(constructed) -> None:
    data, styles = constructed
    figure = figures.mixed(data.instrument_cells("mixed"), styles)
    [ax] = figure.axes
    heights = [bar.get_height() for bar in ax.patches]
    assert heights == pytest.approx([0.1, 0.12, 0.101, 2.9, 3.48, 2.929])
    assert [t.get_text() for t in ax.get_xticklabels()] == ["C0ctl/open", "A1", "C0ctl/close"]
    assert "time to first token" in ax.get_ylabel() and legend(figure) == ["alone", "behind a long prefill"]
    assert_png(figures.png(figure))


def test_keep_and_timeline_figures_show_every_arm_and_boot(constructed) -> None:
    data, _ = constructed
    keep = figures.keep_deltas(data.verdicts)
    assert [t.get_text() for t in keep.axes[0].get_yticklabels()] == ["A1", "A2"]
    timeline = figures.boot_timeline(data.boots, data.steps)
    labels = [t.get_text() for t in timeline.axes[0].get_yticklabels()]
    assert labels == ["C0ctl/open", "A1", "A2", "C0ctl/close"]
    assert "cold (never used for KEEP)" in legend(timeline)
    for figure in (keep, timeline):
        assert_png(figures.png(figure))


def test_invalid_cells_are_named_in_the_figure_table_and_under_their_figure(store, tmp_path: Path) -> None:
    """A level whose streams an engine interrupted stores invalid cells; the report says so where the
    figure and the table would show them, instead of drawing the ladder without that level."""
    interrupted = "the stream was cut after 1 of 8 tokens: another request interrupted it"
    cells = cells_of(1.0)
    cells["decode"] += [Cell(metric, None, "tok/s", params={figures.DECODE_X: 16}, valid=False, note=interrupted,
                             requests=[]) for metric in (figures.DECODE_AGGREGATE, figures.DECODE_PER_STREAM)]
    build_run(store, {"C0ctl/open": Boot(cells=cells), "A1": Boot(cells=cells_of(1.2)),
                      "A2": Boot(cells=cells_of(0.9)), "C0ctl/close": Boot(cells=cells_of(1.01))})
    markdown = (write_report(store, None, tmp_path / "reports") / "index.md").read_text()
    assert ("2 decode cells are invalid and left out of this figure (level=16 (C0ctl/open)); the commonest "
            f"reason (2 of them): {interrupted}") in markdown
    rows = [line for line in markdown.splitlines() if "level=16" in line and line.startswith("| decode")]
    assert len(rows) == 2 and all("invalid" in row and interrupted in row for row in rows), rows
