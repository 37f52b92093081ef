"""A window that compares engines, side by side: one row per figure, the control engine's value and
each engine arm's, their ratio, and the KEEP interval of a key metric where the verdict has one;
then what each engine said of itself (its version) and what the capability probe found at its boot.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from lab.instruments.capabilities import summary
from lab.ladder.engines import kind_of
from lab.ladder.ladder import Ladder
from lab.ladder.render import engine_windows
from lab.report import borrowed
from lab.report import document as doc
from lab.report.data import RunData


def engine_blocks(data: RunData, ladder: Ladder) -> list[doc.Block]:
    """The report's section for the windows with engine arms; none when the ladder has none."""
    windows = [w for w in ladder.windows if w.name in engine_windows(ladder)]
    if not windows:
        return []
    blocks: list[doc.Block] = [doc.Heading("Engines side by side")]
    for window in windows:
        engines = {window.control_name: kind_of(ladder.engine).label()}
        engines |= {arm.name: kind_of(arm.engine).label() for arm in window.arms if arm.engine is not None}
        table = borrowed.beside(side_by_side(data, window.name, engines), borrowed.rows_of(data.run))
        blocks.append(doc.Paragraph(f"Window {window.name}: every engine was sent the same prompts; each value is "
                                    "the median over the warm finished boots of that engine (controls: opening, "
                                    "between and closing), the ratio is arm over control."))
        blocks.append(doc.TableBlock(table) if not table.empty
                      else doc.Paragraph("No figure from a warm finished boot of these engines.", note=True))
        blocks.append(doc.Items(engine_lines(data, window.name, engines)))
    return blocks


def side_by_side(data: RunData, window: str, engines: dict[str, str]) -> pd.DataFrame:
    """metric, params, unit, the control's value, then each engine arm's value and ratio to it."""
    cells = data.cells
    cells = cells[(cells["window"] == window) & cells["arm"].isin(list(engines)) & (cells["slot_role"] != "warmup")
                  & cells["valid"] & cells["value"].notna() & (cells["slot_status"] == "done") & ~cells["cold"]]
    if cells.empty:
        return pd.DataFrame()
    cells = cells.assign(params_text=cells["params"].map(_params))
    keys = ["instrument", "metric", "params_text", "unit"]
    per_boot = cells.groupby([*keys, "arm", "boot_id"], sort=False)["value"].median()
    per_engine = per_boot.groupby(level=[0, 1, 2, 3, 4], sort=False).median()
    control, *arms = engines
    rows = []
    for (instrument, metric, params, unit), values in per_engine.groupby(level=[0, 1, 2, 3], sort=False):
        by_arm = values.droplevel([0, 1, 2, 3]).to_dict()
        base = by_arm.get(control)
        row: dict[str, Any] = {"metric": f"{instrument}.{metric}", "params": params, "unit": unit,
                               f"{control} ({engines[control]})": _number(base)}
        for arm in arms:
            value = by_arm.get(arm)
            row[f"{arm} ({engines[arm]})"] = _number(value)
            ratio = "–" if value is None or not base else f"{value / base:.3g}×"
            interval = _interval(data, arm, f"{instrument}.{metric}", params)
            row[f"{arm} / {control}"] = ratio + (f" ({interval})" if interval else "")
        rows.append(row)
    return pd.DataFrame(rows)


def engine_lines(data: RunData, window: str, engines: dict[str, str]) -> list[str]:
    """Each engine's version (what it says of itself, or the lab's own) and its first measured boot's
    capability probe findings."""
    boots = data.boots[(data.boots["window"] == window) & (data.boots["status"] == "done")]
    lines = []
    for arm, label in engines.items():
        mine = boots[boots["arm"] == arm]
        if mine.empty:
            lines.append(f"{arm} ({label}): no finished boot")
            continue
        boot = mine.iloc[0]
        fingerprint = boot["fingerprint"] if isinstance(boot["fingerprint"], dict) else {}
        version = fingerprint.get("engine")
        if isinstance(version, dict):
            said = f"{version.get('name')} {version.get('version')} ({version.get('source')})"
        elif label.startswith("bundled:"):
            said = f"the lab's own engine, lab {fingerprint.get('lab_version', '?')} at commit " \
                   f"{str(fingerprint.get('git_commit', '?'))[:12]}"
        else:
            said = "version unknown (no /version, no package metadata)"
        caps = boot["capabilities"] if isinstance(boot["capabilities"], dict) else None
        probe = summary(caps) if caps else "not probed"
        lines.append(f"{arm} ({label}): {said}; probe: {probe}")
    return lines


def _interval(data: RunData, arm: str, metric: str, params: str) -> str | None:
    """The KEEP interval of the arm's key metric that selects these cells, when its verdict has one."""
    verdict = data.verdicts[data.verdicts["arm"] == arm]
    if verdict.empty:
        return None
    for row in verdict.iloc[0]["detail"].get("metrics", []):
        name, _, where = str(row.get("name", "")).partition("[")
        chosen = [part for part in where.rstrip("]").split(",") if part]
        found = row.get("interval")
        if name == metric and all(part in params.split(", ") for part in chosen) and found:
            return f"effect {found['effect_pct']:+.1f} % (better +), CI [{found['low_pct']:+.1f}, " \
                   f"{found['high_pct']:+.1f}] %"
    return None


def _params(params: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items())


def _number(value: float | None) -> str:
    if value is None:
        return "–"
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
