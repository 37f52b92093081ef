"""A study's confirmation run read back from the store: each candidate's confirmed objectives and
verdict, and the winner (what `lab report --study` and `lab tune` print), picked by the rule
`lab serve --best` serves by (`lab.analysis.winner`). Running it is `lab.tune.confirm`."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

import optuna

from lab.analysis import verdicts, winner
from lab.analysis.stats import median_of_repeats
from lab.store import reader
from lab.store.db import Store
from lab.tune.spec import TuneFile


@dataclass(frozen=True)
class Candidate:
    arm: str
    trial: int
    params: dict[str, Any]
    trial_values: list[float]
    confirmed: list[float | None]
    decision: str
    reason: str

    def moved_pct(self) -> list[float | None]:
        """How far each confirmed objective moved from the trial's own figure, in %."""
        return [None if c is None or t == 0 else (c - t) * 100 / abs(t)
                for t, c in zip(self.trial_values, self.confirmed)]


@dataclass(frozen=True)
class Confirmation:
    run: str
    candidates: list[Candidate]
    winner: Candidate | None
    why: str  # why the winner won (`lab.analysis.winner`, the rule `lab serve --best` serves by), or why none did


def stored(store: Store, study: optuna.Study, tune: TuneFile) -> Confirmation | None:
    """The study's finished confirmation as stored, without running anything; None before it ran."""
    name = f"{study.study_name}-confirm"
    done = {r.name: r for r in reader.list_runs(store)}
    if name not in done or done[name].status != "done":
        return None
    numbers = {int(a.name[1:]) for a in reader.arms(store, done[name].id) if a.role == "arm"}
    picked = [t for t in study.get_trials(deepcopy=False) if t.number in numbers]
    return read(store, done[name].id, name, picked, tune)


def read(store: Store, run_id: int, name: str, picked: list[optuna.trial.FrozenTrial], tune: TuneFile) -> Confirmation:
    evidence = verdicts.load(store, run_id)
    judged = verdicts.judge(evidence)
    found = []
    for t in picked:
        arm = f"T{t.number:03d}"
        confirmed: list[float | None] = []
        for selector in evidence.spec.metrics:
            values = [median_of_repeats(evidence.select(s, selector).values) for s in evidence.arm_slots(arm)
                      if evidence.select(s, selector).values]
            confirmed.append(statistics.median(values) if values else None)
        verdict = judged.get(arm)
        found.append(Candidate(arm, t.number, dict(t.params), list(t.values), confirmed,
                               str(verdict.decision) if verdict else "no verdict",
                               verdict.reasons[0] if verdict and verdict.reasons else ""))
    best = winner.pick(judged)
    return Confirmation(name, found, next((c for c in found if c.arm == best.arm), None), best.why)
