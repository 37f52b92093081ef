"""A run's rows as pandas frames: the stored tables as they are, and the joined views figures use.

`RunData` holds a run's stored tables (`lab.store.frames`, what `lab export` writes) and adds to
cells, boots, steps and qeval items the slot they belong to (arm, role, position, window, a
readable label), so a figure can group by arm without joining anything itself. Times are UTC.
Its verdicts are judged now from the cells (`lab.analysis.verdicts.judge`), not read from the
stored verdict table, so a report says what the KEEP rule decides on the data as it is now.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pandas as pd

from lab.analysis import verdicts as keep_verdicts
from lab.store.db import Store
from lab.store.frames import run_tables


@dataclass
class RunData:
    run: dict[str, Any]
    arms: pd.DataFrame
    slots: pd.DataFrame  # + arm, label
    boots: pd.DataFrame  # + idx, arm, slot_role, position, window, label
    steps: pd.DataFrame  # + the same slot columns
    cells: pd.DataFrame  # + the same slot columns, and the boot's cold flag and status
    qeval: pd.DataFrame  # qeval items + the same slot columns
    verdicts: pd.DataFrame  # arm, window, decision, reasons, detail (`lab.analysis.verdicts.detail`)

    def instrument_cells(self, instrument: str) -> pd.DataFrame:
        """Valid cells of one instrument from warm, finished boots, params expanded into columns."""
        cells = self.cells[(self.cells["instrument"] == instrument) & self.cells["valid"]
                           & self.cells["value"].notna() & (self.cells["slot_status"] == "done") & ~self.cells["cold"]]
        if cells.empty:
            return cells
        params = pd.DataFrame(list(cells["params"]), index=cells.index)
        # A param named like a cell column (say `window`) must not shadow it.
        params = params.rename(columns={c: f"param_{c}" for c in params.columns if c in cells.columns})
        return cells.join(params)


def load(store: Store, run_id: int) -> RunData:
    raw = run_tables(store, run_id, include=("runs", "arms", "slots", "boots", "steps", "cells", "qeval_items"))
    arms = raw["arms"]
    names = arms.set_index("id")["name"]
    slots = raw["slots"].assign(arm=lambda f: f["arm_id"].map(names))
    slots["label"] = [slot_label(arm, role, position) for arm, role, position
                      in zip(slots["arm"], slots["role"], slots["position"])]
    slot_columns = slots.set_index("id")[["idx", "arm", "role", "position", "window", "label", "status"]].rename(
        columns={"role": "slot_role", "status": "slot_status"})
    boots = raw["boots"].join(slot_columns, on="slot_id")
    steps = raw["steps"].join(slot_columns, on="slot_id")
    cells = raw["cells"].join(slot_columns, on="slot_id").join(
        boots.set_index("id")[["cold", "status", "attempt"]].rename(columns={"status": "boot_status"}), on="boot_id")
    qeval = raw["qeval_items"].join(slot_columns, on="slot_id").join(
        boots.set_index("id")[["cold"]], on="boot_id")
    return RunData(run=raw["runs"].iloc[0].to_dict(), arms=arms, slots=slots, boots=boots, steps=steps, cells=cells,
                   qeval=qeval, verdicts=judged(store, run_id))


def judged(store: Store, run_id: int) -> pd.DataFrame:
    """One row per judged arm, in ladder order: its KEEP verdict on the run's cells as they are now."""
    evidence = keep_verdicts.load(store, run_id)
    rows = [{"arm": arm, "window": evidence.window(arm), "decision": str(verdict.decision),
             "reasons": list(verdict.reasons), "detail": keep_verdicts.detail(evidence, arm, verdict)}
            for arm, verdict in keep_verdicts.judge(evidence).items()]
    return pd.DataFrame(rows, columns=["arm", "window", "decision", "reasons", "detail"])


def slot_label(arm: str, role: str, position: str) -> str:
    """How a slot is named to people: the arm, and for a control or the warm-up where it stands."""
    return arm if role == "arm" else f"{arm}/{position}"
