"""The report's tables as DataFrames: KEEP verdicts, qeval paired counts, agreement, boots,
every stored figure, and the environment fingerprint.
"""

from __future__ import annotations

import json
from typing import Any

import pandas as pd

from lab.analysis.keep import pct_text
from lab.instruments.paired import paired_counts
from lab.instruments.base import NOT_APPLICABLE
from lab.instruments.capabilities import summary
from lab.report.data import RunData


def keep_table(data: RunData) -> pd.DataFrame:
    """One row per judged arm: its change, decision, each key metric's Δ % (better positive, as in the
    KEEP lines), the controls' drift and the minimum detectable effect, gates, the deciding reason.
    Percentages carry the precision the rule compared them at: a 2.02 % drift that left a metric undecided
    against a 2 % limit reads 2.02, never 2.0."""
    changes = data.arms.set_index("name")["change"]
    rows = []
    for verdict in data.verdicts.itertuples():
        detail = verdict.detail
        threshold = detail.get("threshold_pct") or 0.0
        # Verdicts stored before the limit was recorded had none other than the threshold.
        drift_limit = detail.get("drift_limit_pct") or threshold
        row: dict[str, Any] = {"arm": verdict.arm, "window": verdict.window, "change": _change(changes[verdict.arm]),
                               "verdict": verdict.decision}
        for metric in detail.get("metrics", []):
            delta = metric.get("delta_pct")
            row[f"{metric['name']} Δ % (better +)"] = ("–" if delta is None
                                                       else pct_text(delta, threshold, signed=True))
            drift = metric.get("drift_pct")
            row[f"{metric['name']} controls apart %"] = ("–" if drift is None
                                                         else pct_text(drift, drift_limit, signed=False))
            interval = metric.get("interval")
            row[f"{metric['name']} MDE %"] = ("unknown" if not interval
                                              else f"±{pct_text(interval['mde_pct'], threshold, signed=False)}")
        for gate, result in detail.get("gates", {}).items():
            row[f"gate {gate}"] = "no result" if result is None else "holds" if result["passed"] else "fails"
        row["because"] = verdict.reasons[0] if verdict.reasons else ""
        rows.append(row)
    return pd.DataFrame(rows)


def reasons(data: RunData) -> dict[str, list[str]]:
    return {verdict.arm: list(verdict.reasons) for verdict in data.verdicts.itertuples()}


def qeval_table(data: RunData) -> pd.DataFrame:
    """Every measured boot against its window's opening control, task by task (what the qeval gate pairs);
    then every boot where qeval was not applicable, with the reason."""
    items = data.qeval[(data.qeval["slot_status"] == "done") & ~data.qeval["cold"]]
    rows = []
    for window, part in items.groupby("window", sort=False):
        opening = part[(part["slot_role"] == "control") & (part["position"] == "open")]
        reference = dict(zip(opening["task"], opening["passed"].astype(bool)))
        boots = part.groupby(["idx", "label"], sort=True)
        alone = boots.ngroups == 1
        for (_, label), boot in boots:
            if not opening.empty and boot["slot_id"].iloc[0] == opening["slot_id"].iloc[0] and not alone:
                continue
            outcome = dict(zip(boot["task"], boot["passed"].astype(bool)))
            row = {"window": window, "boot": label, "tasks": len(outcome), "passed": sum(outcome.values())}
            if alone:
                row["note"] = "the only boot of its window with qeval items: nothing to pair it with"
            elif reference:
                counts = paired_counts(reference, outcome)
                row.update({"control passed": sum(reference.values()), "broke": counts.broke, "fixed": counts.fixed,
                            "McNemar p (exact)": f"{counts.p_value:.3g}",
                            "broke tasks": ", ".join(sorted(t for t in reference.keys() & outcome.keys()
                                                            if reference[t] and not outcome[t])),
                            "fixed tasks": ", ".join(sorted(t for t in reference.keys() & outcome.keys()
                                                            if outcome[t] and not reference[t]))})
            else:
                row["note"] = "no warm opening control with qeval items: nothing to pair against"
            rows.append(row)
    cells = data.cells
    skipped = cells[(cells["instrument"] == "qeval") & (cells["metric"] == "score") & (cells["slot_status"] == "done")
                    & cells["note"].str.startswith(NOT_APPLICABLE)].sort_values("idx")
    rows += [{"window": cell.window, "boot": cell.label, "note": cell.note} for cell in skipped.itertuples()]
    return pd.DataFrame(rows)


def agreement_table(data: RunData) -> pd.DataFrame:
    """The agreement instrument's summary figures per boot (each against its window's control)."""
    cells = data.instrument_cells("agreement")
    if cells.empty:
        return cells
    summary = cells[cells["params"].map(len) == 0]
    table = summary.pivot_table(index=["idx", "label"], columns="metric", values="value", aggfunc="median")
    table.columns = [f"{c} ({_unit(summary, c)})" for c in table.columns]
    return table.reset_index(level="idx", drop=True).reset_index().rename(columns={"label": "boot"})


def figures_table(data: RunData) -> pd.DataFrame:
    """Every stored figure: instrument, metric and params down, boots across; median of repeats. An
    invalid cell is never dropped: it shows as "n/a" (not applicable on this engine) or "invalid",
    its reason in the `note` column."""
    cells = data.cells[data.cells["slot_role"] != "warmup"]
    cells = cells[~cells["valid"] | cells["value"].notna()]
    if cells.empty:
        return pd.DataFrame()
    cells = cells.assign(params_text=cells["params"].map(_params),
                         boot=cells["label"] + cells["cold"].map({True: " (cold)", False: ""}))
    index = ["instrument", "metric", "params_text", "unit"]
    parts = []
    figures = cells[cells["valid"]]
    if not figures.empty:
        parts.append(figures.pivot_table(index=index, columns="boot", values="value", aggfunc="median",
                                         sort=False).map(_number))
    skipped = cells[~cells["valid"]]
    if not skipped.empty:
        mark = skipped["note"].fillna("").str.startswith(NOT_APPLICABLE).map({True: "n/a", False: "invalid"})
        marks = skipped.assign(value=mark).pivot_table(index=index, columns="boot", values="value", aggfunc="first",
                                                       sort=False)
        parts.append(marks.assign(note=skipped.groupby(index, sort=False)["note"].first()))
    table = pd.concat(parts).fillna("")
    order = cells.drop_duplicates("boot").sort_values("idx")["boot"]
    table = table[[b for b in order if b in table.columns] + (["note"] if "note" in table.columns else [])]
    return table.reset_index().rename(columns={"params_text": "params"})


def calibration_table(noise: pd.DataFrame) -> pd.DataFrame:
    """The noise models (`lab calibrate`) the run's verdicts drew on, one row per key metric."""
    return pd.DataFrame({
        "metric": noise["metric"], "calibration run": noise["run_name"], "control boots": noise["boots"],
        "boot-to-boot SD %": noise["sd_log"].map(lambda v: f"{v * 100:.2f}"),
        "controls' drift %": noise["drift_pct"].map(lambda v: f"{v:.2f}"),
        "MDE %": [f"±{mde:.2f} at {repeats} repeat{'s' if repeats > 1 else ''}, {power * 100:g} % power"
                  for mde, repeats, power in zip(noise["mde_pct"], noise["repeats"], noise["power"])],
        "measured": noise["created_at"].map(lambda t: f"{t:%Y-%m-%d %H:%M} UTC"),
    })


def boots_table(data: RunData) -> pd.DataFrame:
    boots = data.boots.sort_values(["idx", "attempt"])
    return pd.DataFrame({
        "slot": boots["idx"], "boot": boots["label"], "window": boots["window"].fillna("warm-up"),
        "try": boots["attempt"], "status": boots["status"], "cold": boots["cold"].map({True: "cold", False: ""}),
        "ready s": boots["ready_s"].map(lambda v: "" if pd.isna(v) else f"{v:.1f}"),
        "reason": boots["reason"].fillna(""),
        "capabilities": boots["capabilities"].map(lambda caps: summary(caps) if isinstance(caps, dict) else ""),
    })


def invalid_reason(data: RunData, instrument: str) -> str | None:
    """How many of an instrument's measured cells are invalid, hence missing from its figure, and
    their commonest note; None when every cell is valid."""
    cells = data.cells[(data.cells["instrument"] == instrument) & ~data.cells["valid"]
                       & (data.cells["slot_role"] != "warmup")]
    if cells.empty:
        return None
    notes = cells["note"].fillna("").value_counts()
    which = ", ".join(sorted({f"{p} ({label})" for p, label in zip(cells["params"].map(_params), cells["label"])})[:6])
    return (f"{len(cells)} {instrument} cells are invalid and left out of this figure ({which}"
            f"{', …' if len(cells) > 6 else ''}); the commonest reason ({notes.iloc[0]} of them): "
            f"{notes.index[0] or 'none given'}")


def fingerprint_table(data: RunData) -> pd.DataFrame:
    """The environment every boot recorded; a key whose value differs between boots lists each value."""
    values: dict[str, dict[str, list[str]]] = {}
    for boot in data.boots.itertuples():
        for key, value in _flatten(boot.fingerprint or {}).items():
            values.setdefault(key, {}).setdefault(value, []).append(boot.label)
    rows = []
    for key, seen in values.items():
        if len(seen) == 1:
            rows.append({"key": key, "value": next(iter(seen))})
        else:
            rows.append({"key": key, "value": "; ".join(f"{v} ({', '.join(b)})" for v, b in seen.items())})
    return pd.DataFrame(rows)


def _flatten(value: Any, prefix: str = "") -> dict[str, str]:
    if isinstance(value, dict):
        out: dict[str, str] = {}
        for key, inner in value.items():
            out.update(_flatten(inner, f"{prefix}{key}."))
        return out
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        out = {}
        for i, inner in enumerate(value):
            out.update(_flatten(inner, f"{prefix}{i}."))
        return out
    return {prefix.rstrip("."): json.dumps(value) if isinstance(value, list) else str(value)}


def _change(change: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for part in ("engine", "flags", "env") for k, v in change.get(part, {}).items()) or "-"


def _params(params: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items())


def _unit(cells: pd.DataFrame, metric: str) -> str:
    units = cells.loc[cells["metric"] == metric, "unit"].unique()
    return str(units[0]) if len(units) else ""


def _number(value: float) -> str:
    if pd.isna(value):
        return ""
    return f"{value:,.1f}" if abs(value) >= 100 else f"{value:.4g}"
