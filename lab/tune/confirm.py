"""No winner from a single trial: the best few trials re-measured in a generated ladder.

The confirmation ladder boots the tune file's base configuration as the warm control, opening and
closing one window, with each candidate as an arm (`multi: true`: a trial changes several knobs),
and the KEEP rule judges them on the tune's objectives (key metrics) and constraints (gates). It is
an ordinary run (`lab ls`, `lab report`, `lab compare`, `lab serve --best` work on it) named
`<study>-confirm`. Candidates: with one objective, the best feasible trials; with several, the
feasible Pareto front, best first objective first. Only a kept candidate can be the winner.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
import yaml
from rich.console import Console

from lab import verdicts
from lab.arms import render
from lab.arms.validate import parse_ladder
from lab.run import create_from_text, execute
from lab.stats import median_of_repeats
from lab.store import reader
from lab.store.db import Store
from lab.tune import trial as trials
from lab.tune.spec import TuneFile

CONTROL = "C0base"


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


def candidates(study: optuna.Study, tune: TuneFile) -> list[optuna.trial.FrozenTrial]:
    """The best feasible trials, at most `confirm.top`, with distinct values."""
    feasible = [t for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
                if all(c <= 0 for c in t.user_attrs.get("constraints") or [])]
    maximize = study.directions[0] == optuna.study.StudyDirection.MAXIMIZE
    if len(tune.objectives) > 1:
        front = {t.number for t in study.best_trials}
        feasible = [t for t in feasible if t.number in front]
    ranked = sorted(feasible, key=lambda t: t.values[0], reverse=maximize)
    chosen, seen = [], set()
    for t in ranked:
        key = tuple(sorted(t.params.items()))
        if key not in seen:
            seen.add(key)
            chosen.append(t)
    return chosen[:tune.confirm.top]


def confirm(store: Store, study: optuna.Study, tune: TuneFile, text: str, tune_path: str | Path,
            runs_dir: str | Path, console: Console) -> Confirmation | None:
    """Run (or finish, or reread) the confirmation ladder and name the winner; None without candidates."""
    data = yaml.safe_load(text)
    name = f"{study.study_name}-confirm"
    base_hash = _control_hash(tune, data, {}, {})
    arms, picked = [], []
    for t in candidates(study, tune):
        flags, env = trials.changes(tune.space, t.params)
        if _control_hash(tune, data, flags, env) == base_hash:
            continue  # the base itself: nothing to confirm against the base
        arms.append({"name": f"T{t.number:03d}", "flags": flags, "env": {k: render.env_value(v) for k, v in env.items()},
                     "multi": True})
        picked.append(t)
    if not arms:
        return None
    done = {r.name: r for r in reader.list_runs(store)}
    if name in done and done[name].status == "done":
        run_id = done[name].id
    else:
        if name in done:
            run = reader.find_run(store, name)
        else:
            ladder_text = f"# confirmation of study {study.study_name}\n" + trials.ladder_text(
                tune, data, CONTROL, {}, {}, arms=arms, repeats=tune.confirm.repeats, name=tune.name,
                warmup=bool(tune.hygiene.warmup_boot))
            ladder = parse_ladder(ladder_text, f"{tune_path} (confirmation)")
            run = create_from_text(store, ladder, ladder_text, tune_path, name, runs_dir)
        console.print(f"confirmation run [bold]{run.name}[/]: {CONTROL} brackets "
                      f"{', '.join(a['name'] for a in arms)}", highlight=False)
        execute(store, run, console)
        run_id = run.id
    return _read(store, run_id, name, picked, tune)


def stored(store: Store, study: optuna.Study, tune: TuneFile) -> Confirmation | None:
    """The study's finished confirmation as stored, without running anything; None before it ran."""
    name = f"{study.study_name}-confirm"
    done = {r.name: r for r in reader.list_runs(store)}
    if name not in done or done[name].status != "done":
        return None
    numbers = {int(a.name[1:]) for a in reader.arms(store, done[name].id) if a.role == "arm"}
    picked = [t for t in study.get_trials(deepcopy=False) if t.number in numbers]
    return _read(store, done[name].id, name, picked, tune)


def _read(store: Store, run_id: int, name: str, picked: list[optuna.trial.FrozenTrial], tune: TuneFile) -> Confirmation:
    evidence = verdicts.load(store, run_id)
    stored = reader.verdicts(store, run_id)
    maximize = [(o.direction or ("maximize" if evidence.higher_is_better(s) else "minimize")) == "maximize"
                for o, s in zip(tune.objectives, evidence.spec.metrics)]
    found = []
    for t in picked:
        arm = f"T{t.number:03d}"
        confirmed: list[float | None] = []
        for selector in evidence.spec.metrics:
            values = [median_of_repeats(evidence.select(s, selector).values) for s in evidence.arm_slots(arm)
                      if evidence.select(s, selector).values]
            confirmed.append(statistics.median(values) if values else None)
        verdict = stored.get(arm)
        found.append(Candidate(arm, t.number, dict(t.params), list(t.values), confirmed,
                               verdict.decision if verdict else "no verdict",
                               verdict.reasons[0] if verdict and verdict.reasons else ""))
    kept = [c for c in found if c.decision == "keep" and c.confirmed[0] is not None]
    winner = (max(kept, key=lambda c: c.confirmed[0] if maximize[0] else -c.confirmed[0])) if kept else None
    return Confirmation(name, found, winner)


def _control_hash(tune: TuneFile, data: dict[str, Any], flags: dict[str, Any], env: dict[str, Any]) -> str:
    text = trials.ladder_text(tune, data, CONTROL, flags, env)
    return render.plan(parse_ladder(text, "tune")).arms[0].config_hash
