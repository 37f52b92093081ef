"""`lab calibrate LADDER`: measure how much a ladder's key metrics move when nothing changes.

It runs the ladder's control alone, booted again and again in one window after a warm-up boot
(A/A: C C C C …, the same instruments and host hygiene as the ladder), and treats every control between two
others as an arm that changes nothing: its effect is the log ratio against its neighbours
interpolated at its place, exactly as `lab.analysis.effects` judges a real arm boot. The spread of those
A/A effects is the boot-to-boot noise of each key metric on this host; with it the store keeps the
widest drift among the controls and the minimum detectable effect at the ladder's own `repeats:`.
`lab.analysis.verdicts` uses the newest calibration of a ladder on the host its run booted on.

`lab run LADDER --calibrate N` (or the ladder's `keep: {calibrate: N}`) runs exactly this first,
then the ladder, so the ladder's verdicts are judged with the noise just measured (`run_calibration`).
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console

from lab.analysis import effects, verdicts
from lab.analysis.stats import median_of_repeats, noise_band
from lab.ladder.validate import load_ladder, parse_ladder
from lab.runner.errors import Interrupted, RunError
from lab.runner.run import create_from_text, execute
from lab.store import reader, writer
from lab.store.db import Store
from lab.store.rows import RunRecord

log = logging.getLogger("lab.calibrate")
MIN_BOOTS = 3  # two controls bracket the third: one A/A effect
# The derived ladder's first line ends with this and the original ladder's `repeats:`.
REPEATS = "the ladder's repeats:"
MAX_BOOTS = 21  # one window: the ladder's `repeats:` (at most 20) + 1


@dataclass(frozen=True)
class Calibration:
    """A calibration run as `run_calibration` left it: its noise rows, and why it stopped early, if it did."""

    run: RunRecord
    repeats: int  # the ladder's own `repeats:`, which each row's MDE is for
    rows: list[dict[str, Any]]
    stopped: str | None = None  # "interrupted", or why the time budget ran out


def run_calibration(store: Store, ladder_path: str | Path, boots: int, console: Console, *, name: str | None = None,
                    runs_dir: str | Path = "runs", time_budget_s: float | None = None) -> Calibration:
    """Create, boot and measure a calibration of the ladder (ValueError for too few boots). A Ctrl-C,
    SIGTERM or the end of the time budget late in it still measures the warm controls it finished:
    they are A/A evidence all the same."""
    run, repeats = create(store, ladder_path, boots, name, runs_dir)
    console.print(f"calibration run [bold]{run.name}[/] (id {run.id}): a warm-up, then {boots} boots of the control")
    stopped = None
    try:
        # Its traps name the lines of the ladder as written, not of the A/A ladder derived from it.
        stopped = execute(store, run, console, time_budget_s, ladder_text=Path(ladder_path).read_text()).out_of_time
    except Interrupted:
        stopped = "interrupted"
    return Calibration(run, repeats, measure(store, run.id, repeats), stopped)


def resume_calibration(store: Store, ref: str, console: Console, time_budget_s: float | None = None) -> Calibration:
    """Finish a calibration a Ctrl-C, SIGTERM, kill or time budget stopped: boot what is left of it,
    then measure its noise, as `run_calibration` would have."""
    run = reader.find_run(store, ref)
    found = re.match(rf"# A/A calibration of .*; {re.escape(REPEATS)} (\d+)\n", run.ladder_text)
    if found is None:
        raise RunError(f"run {run.name} is not a calibration; `lab run --resume {run.name}` finishes it")
    repeats = int(found.group(1))
    console.print(f"calibration run [bold]{run.name}[/] (id {run.id}): resumed")
    stopped = None
    try:
        stopped = execute(store, run, console, time_budget_s).out_of_time
    except Interrupted:
        stopped = "interrupted"
    return Calibration(run, repeats, measure(store, run.id, repeats), stopped)


def create(store: Store, ladder_path: str | Path, boots: int, name: str | None,
           runs_dir: str | Path = "runs") -> tuple[RunRecord, int]:
    """Validate the ladder, then store the A/A run (its control booted `boots` times in one window);
    returns the run and the ladder's own `repeats:`, which the minimum detectable effect is for."""
    if boots < MIN_BOOTS:
        raise ValueError(f"--boots {boots}: a calibration needs at least {MIN_BOOTS} (each inner boot is "
                         "judged against the two around it)")
    if boots > MAX_BOOTS:
        raise ValueError(f"--boots {boots}: a calibration boots its control in one window, at most {MAX_BOOTS} times")
    ladder, text = load_ladder(ladder_path)
    data = yaml.safe_load(text)
    first = ladder.windows[0]
    data["windows"] = [{"name": "AA", "control": first.control_name}]
    data["repeats"] = boots  # a window with no arms boots its control `repeats` times
    data.setdefault("keep", {})["gates"] = []  # gates judge arms; there are none
    data["keep"].pop("calibrate", None)  # what asks for this calibration, not part of it
    # A cold boot is no sample of warm noise: warm the caches once, unmeasured, with the control.
    data["hygiene"] = {**(data.get("hygiene") or {}), "warmup_boot": True}
    description = f"A/A calibration of {ladder.name} ({Path(ladder_path).name}), {boots} control boots"
    data["description"] = description
    derived = f"# {description}; {REPEATS} {ladder.repeats}\n" + yaml.safe_dump(data, sort_keys=False)
    run = create_from_text(store, parse_ladder(derived, f"{ladder_path} (calibration)"), derived, ladder_path,
                           name, runs_dir, stem=f"{ladder.name}-calibration")
    return run, ladder.repeats


def measure(store: Store, run_id: int, repeats: int, power: float = effects.POWER) -> list[dict[str, Any]]:
    """The noise model of a finished calibration run, stored and returned (one row per key metric)."""
    evidence = verdicts.load(store, run_id)
    controls = [s for s in evidence.slots if s.role == "control" and s.measured and not s.cold]
    rows = []
    for selector in evidence.spec.metrics:
        placed = []
        for slot in controls:
            found = evidence.select(slot, selector)
            if found.values:
                placed.append((float(slot.idx), median_of_repeats(found.values)))
        if len(placed) < MIN_BOOTS or min(v for _, v in placed) <= 0:
            log.warning("%s: %d usable warm control boots; no noise model", selector.label, len(placed))
            continue
        aa = [math.log(placed[i][1] / effects.interpolate([placed[i - 1], placed[i + 1]], placed[i][0]))
              for i in range(1, len(placed) - 1)]
        # The true A/A effect is 0, so every one of them is a degree of freedom.
        sd = math.sqrt(sum(e * e for e in aa) / len(aa))
        values = [v for _, v in placed]
        rows.append({"metric": selector.label, "boots": len(placed), "sd_log": sd, "df": len(aa),
                     "drift_pct": noise_band(max(values), min(values)) * 100,
                     "mde_pct": effects.mde_pct(sd, repeats, len(aa) + repeats - 1, power=power),
                     "repeats": repeats, "power": power})
    writer.write_noise(store, run_id=run_id, ladder_name=evidence.ladder.name,
                       host=reader.boot_host(store, run_id) or "", rows=rows)
    return rows
