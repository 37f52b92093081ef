"""`lab report [RUN]`: write `<out>/<run name>/` with `index.md`, a self-contained `index.html` and
one PNG per figure. The KEEP verdicts are judged in memory from the run's cells with the newest
calibration (`lab.report.data`); the store is only read.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pandas as pd

from lab.ladder.validate import parse_ladder
from lab.report import borrowed, history_page
from lab.report import document as doc
from lab.report import tables
from lab.report.data import RunData, load
from lab.report.engines import engine_blocks
from lab.report.figures import Drawn, draw_all
from lab.store import reader
from lab.store.db import Store

log = logging.getLogger("lab.report")


def pick_run(store: Store, ref: str | None) -> tuple[int, str]:
    """(id, name) of the run named by `ref`, or of the latest run; LookupError when there is none or it
    has no cells."""
    if ref is None:
        runs = reader.list_runs(store)
        if not runs:
            raise LookupError("this store has no runs; `lab run LADDER.yaml` makes one")
        run_id, name = runs[-1].id, runs[-1].name
    else:
        run = reader.find_run(store, ref)
        run_id, name = run.id, run.name
    if not reader.cell_count(store, run_id):
        raise LookupError(f"run {name} has no stored cells yet; `lab ls {name}` shows its boots")
    return run_id, name


def write_report(store: Store, ref: str | None, out: str | Path = "reports") -> Path:
    """Write the report of a run (default: the latest) and return its directory."""
    run_id, name = pick_run(store, ref)
    data = load(store, run_id)
    ladder = parse_ladder(data.run["ladder_text"], f"{name} (stored ladder)")
    drawn = draw_all(data, [instrument for instrument, _ in ladder.instruments.sections()])
    directory = Path(out) / name.replace("/", "_")
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob("*.png"):  # a figure that is skipped now must not linger from an earlier report
        stale.unlink()
    for figure in drawn:
        if figure.png is not None:
            (directory / f"{figure.name}.png").write_bytes(figure.png)
    blocks = _blocks(data, ladder.description, drawn, _calibration(store, run_id, data.run["ladder_name"]),
                     engine_blocks(data, ladder), ladder.compare_only)
    blocks += _history_links(store, data.run["ladder_name"], Path(out))
    title = f"Run {name}"
    (directory / "index.md").write_text(doc.markdown(title, blocks))
    (directory / "index.html").write_text(doc.html_document(title, blocks))
    log.info("report of %s written to %s", name, directory)
    return directory


def _history_links(store: Store, ladder_name: str, out: Path) -> list[doc.Block]:
    """Where this ladder's nightly series are: a link to each one's history page written beside this
    report, or the command that writes it; nothing when the ladder was never swept."""
    series = list(dict.fromkeys(p.series for p in reader.series_points(store) if p.ladder_name == ladder_name))
    if not series:
        return []
    blocks: list[doc.Block] = [doc.Heading("History")]
    for name in series:
        folder = history_page.folder_name(name)
        if (out / folder / "index.html").exists():
            blocks.append(doc.Link(f"Ladder {ladder_name} is tracked by `lab sweep` in series {name}:",
                                   "its history page", f"../{folder}/index.html"))
        else:
            blocks.append(doc.Paragraph(f"Ladder {ladder_name} is tracked by `lab sweep` in series {name}; "
                                        f"`lab history {name} --html {out}` writes its history page beside "
                                        "this report, and the next `lab report` links it."))
    return blocks


def _calibration(store: Store, run_id: int, ladder_name: str) -> pd.DataFrame:
    """The newest noise model of the run's ladder on the host it booted on (what its verdicts used),
    with the calibration run's name; empty when that ladder was never calibrated there."""
    host = reader.boot_host(store, run_id)
    rows = reader.latest_noise(store, ladder_name, host) if host is not None else []
    if not rows:
        return pd.DataFrame()
    name = reader.run_name(store, rows[0].run_id)
    return pd.DataFrame([{"metric": r.metric, "run_name": name, "boots": r.boots, "sd_log": r.sd_log,
                          "drift_pct": r.drift_pct, "mde_pct": r.mde_pct, "repeats": r.repeats, "power": r.power,
                          "created_at": r.created_at} for r in rows])


def _blocks(data: RunData, description: str, drawn: list[Drawn], noise: pd.DataFrame,
            engines: list[doc.Block], compare_only: bool) -> list[doc.Block]:
    run = data.run
    figures = {d.name: d for d in drawn}
    boots = data.boots
    done = int((boots["status"] == "done").sum())
    summary = (f"Ladder {run['ladder_name']}" + (f" ({description})" if description else "") +
               f", {run['engine_kind']} engine, ladder sha256 {run['ladder_sha256'][:12]}. Run {run['status']}, "
               f"started {run['created_at']:%Y-%m-%d %H:%M} UTC; {len(data.slots)} planned boots, {done} finished, "
               f"{len(boots) - done} did not.")
    blocks: list[doc.Block] = [doc.Paragraph(summary)]
    warnings = run.get("warnings")
    if isinstance(warnings, list) and warnings:  # None, or NaN in a frame of stores written before the column
        blocks += [doc.Heading("Warnings"),
                   doc.Paragraph("What the first measured boot showed about the ladder, each with its fix:"),
                   doc.Items(list(warnings))]
    blocks.append(doc.Heading("KEEP verdicts"))

    armless = not (data.arms["role"] == "arm").any()
    keep = tables.keep_table(data)
    if armless:
        blocks.append(doc.Paragraph(_armless(data)))
    elif keep.empty and compare_only:
        blocks.append(doc.Paragraph("No verdicts: the ladder is `compare_only`, its arms are compared with their "
                                    "controls, not judged.", note=True))
    elif keep.empty:
        blocks.append(doc.Paragraph("No verdicts: the ladder names no key metric.", note=True))
    else:
        counts = keep["verdict"].value_counts()
        blocks.append(doc.Paragraph("Each arm against the warm controls of its own window. "
                                    + ", ".join(f"{counts.get(d, 0)} {d}" for d in doc.VERDICT_CLASSES) + "."))
        blocks.append(doc.TableBlock(keep, row_class="verdict"))
        blocks.append(doc.Items([f"{arm}: " + " · ".join(why) for arm, why in tables.reasons(data).items()]))
    if not armless:
        blocks.append(doc.FigureBlock(figures["keep"]))
    blocks += engines

    if not noise.empty:
        blocks.append(doc.Heading("Calibration"))
        blocks.append(doc.Paragraph("Boot-to-boot noise of each key metric measured by A/A boots of the control "
                                    "(`lab calibrate`), which the verdicts above pool into their intervals; the "
                                    "MDE is the smallest effect the ladder's design resolves with that power at "
                                    "95 % confidence."))
        blocks.append(doc.TableBlock(tables.calibration_table(noise)))
    elif not armless:  # with nothing judged, there is nothing a calibration would sharpen
        blocks.append(doc.Heading("Calibration"))
        blocks.append(doc.Paragraph("No calibration of this ladder on this host: a metric judged on one boot per "
                                    "arm has no interval and no known minimum detectable effect "
                                    "(`lab calibrate LADDER` measures them).", note=True))

    for name, heading, instrument in (("decode_ladder", "Decode ladder", "decode"), ("prefill", "Prefill", "prefill"),
                                      ("needle", "Needle retrieval", "needle"), ("mixed", "Mixed traffic", "mixed")):
        blocks += [doc.Heading(heading), doc.FigureBlock(figures[name])]
        why = tables.invalid_reason(data, instrument)
        if why:
            blocks.append(doc.Paragraph(why, note=True))

    blocks.append(doc.Heading("Quality"))
    qeval = tables.qeval_table(data)
    blocks.append(doc.Paragraph("qeval, task by task against the window's opening control "
                                "(broke: passed on the control, failed here; exact McNemar p of broke vs fixed)."))
    blocks.append(doc.TableBlock(qeval) if not qeval.empty
                  else doc.Paragraph("No qeval items from a warm finished boot.", note=True))
    agreement = tables.agreement_table(data)
    blocks.append(doc.Paragraph("Greedy agreement with the window's control (same prompts at T=0)."))
    blocks.append(doc.TableBlock(agreement) if not agreement.empty
                  else doc.Paragraph("No agreement figures from a warm finished boot.", note=True))

    blocks += [doc.Heading("Boots"), doc.FigureBlock(figures["boot_timeline"]),
               doc.TableBlock(tables.boots_table(data))]
    figures_table = borrowed.beside(tables.figures_table(data), borrowed.rows_of(run))
    blocks += [doc.Heading("Every stored figure"),
               doc.Collapsed("Median of repeats per boot; cold boots marked (never used for KEEP)",
                             [doc.TableBlock(figures_table)])]
    blocks += borrowed.blocks(borrowed.rows_of(run))
    blocks += [doc.Heading("Ladder"), doc.Code(run["ladder_text"], "yaml")]
    blocks += [doc.Heading("Environment"), doc.TableBlock(tables.fingerprint_table(data))]
    return blocks


def _armless(data: RunData) -> str:
    """What a run with no arms is: one measured boot with nothing to compare it with, or its controls."""
    measured = data.slots[data.slots["role"] != "warmup"]
    controls = ", ".join(dict.fromkeys(measured["arm"]))
    if len(measured) == len(measured["window"].unique()):
        return (f"No KEEP table: this run has no arms, one measured boot per window ({controls}), and a one-boot "
                "run has no control to compare with, so nothing is judged. The figures below are that boot's "
                "measurements; `lab compare RUN:CONTROL OTHER:CONTROL` sets two such runs side by side (a "
                "difference, with no interval from one boot a side).")
    return (f"No KEEP table: this run has no arms, only its controls ({controls}), so nothing is judged. The "
            "figures below are their measurements; how far the controls moved is the drift between them.")
