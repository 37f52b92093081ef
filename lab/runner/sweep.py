"""`lab sweep LADDER --label L`: a ladder run (or its control alone) filed under a series for `lab history`.

A series is one ladder on one host: `<ladder>@<host>`. What changes from label to label is what the
user is tracking (the engine's commit, a driver, a date). Each point also records the base config
its control ran (engine kind, model, flags, environment, the config and its hash), so a change to
the ladder's base keeps the series and `lab history` sees where the base changed and compares only
labels under one base. The run is an ordinary run: `lab ls`, `lab report` and `lab run --resume`
work on it.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import yaml

from lab.ladder import render
from lab.ladder.validate import load_ladder, parse_ladder
from lab.runner import fingerprint
from lab.runner.errors import RunError
from lab.runner.run import create_from_text
from lab.store import reader, writer
from lab.store.db import Store
from lab.store.rows import RunRecord, series_name

log = logging.getLogger("lab.sweep")


def create(store: Store, ladder_path: str | Path, label: str, control_only: bool, name: str | None,
           runs_dir: str | Path = "runs") -> tuple[RunRecord, str]:
    """Validate the ladder, store its run and file it under its series; returns the run and the series."""
    ladder, text = load_ladder(ladder_path)
    if control_only:
        # Each window's control alone, opened and closed: two warm boots per label to state its drift.
        data = yaml.safe_load(text)
        data["windows"] = [{"name": w.name, "control": w.control_name} for w in ladder.windows]
        # The report heads with the description: it must not name arms this run leaves out.
        data["description"] = f"{ladder.description + ', ' if ladder.description else ''}controls only"
        data["repeats"] = 2  # a window with no arms boots its control `repeats` times: open and close
        data.setdefault("keep", {})["gates"] = []  # gates judge arms; there are none
        text = f"# {ladder.name} ({Path(ladder_path).name}), controls only, for `lab sweep`\n" + \
            yaml.safe_dump(data, sort_keys=False)
        ladder = parse_ladder(text, f"{ladder_path} (controls only)")
    control = render.plan(ladder).arms[0]
    host = fingerprint.collect()["host"]
    series = series_name(ladder.name, host)
    taken = next((p for p in reader.series_points(store, series) if p.label == label), None)
    if taken is not None:
        raise RunError(f"label {label!r} is already in series {series} (run id {taken.run_id}); pick another")
    run = create_from_text(store, ladder, text, ladder_path, name, runs_dir, stem=f"{ladder.name}-{_plain(label)}")
    identity = {"engine_kind": ladder.engine.kind, "model": ladder.engine.model, "control": control.name,
                "control_config_hash": control.config_hash, "flags": control.flags, "env": control.env,
                "config": control.config}
    try:
        writer.add_series_point(store, series=series, label=label, run_id=run.id, ladder_name=ladder.name, host=host,
                                identity=identity)
    except ValueError as exc:  # another sweep filed the same label a moment ago
        writer.set_run_status(store, run.id, "failed", str(exc))
        raise RunError(str(exc)) from None
    log.info("run %s filed under series %s as %s", run.name, series, label)
    return run, series


def _plain(label: str) -> str:
    """A label as it may appear in a run name, which becomes a directory of boot logs."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", label)[:60]
