"""No winner from a single trial: the best few trials re-measured in a generated ladder.

The confirmation ladder boots the tune file's base configuration as the warm control, opening and
closing one window, with each candidate as an arm (`multi: true`: a trial changes several knobs),
and the KEEP rule judges them on the tune's objectives (key metrics) and constraints (gates). It is
an ordinary run (`lab ls`, `lab report`, `lab compare`, `lab serve --best` work on it) named
`<study>-confirm`. Candidates: with one objective, the best feasible trials; with several, the
feasible Pareto front, best first objective first. Only a kept candidate can be the winner, picked
by the rule `lab serve --best` serves by (`lab.analysis.winner`). The warm-up boot opens it as it
opens the trials (`lab.tune.warmup`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna
import yaml
from rich.console import Console

from lab.ladder import render
from lab.ladder.validate import parse_ladder
from lab.runner.run import create_from_text, execute
from lab.store import reader
from lab.store.db import Store
from lab.tune import confirmation
from lab.tune import ladders, warmup
from lab.tune.spec import TuneFile

CONTROL = ladders.CONTROL


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
            runs_dir: str | Path, console: Console) -> confirmation.Confirmation | None:
    """Run (or finish, or reread) the confirmation ladder and name the winner; None without candidates."""
    data = yaml.safe_load(text)
    name = f"{study.study_name}-confirm"
    base_hash = _control_hash(tune, data, {}, {})
    arms, picked = [], []
    for t in candidates(study, tune):
        flags, env = ladders.changes(tune.space, t.params)
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
            ladder_text = f"# confirmation of study {study.study_name}\n" + ladders.ladder_text(
                tune, data, CONTROL, {}, {}, arms=arms, repeats=tune.confirm.repeats, name=tune.name,
                warmup=warmup.wanted(tune)[0])
            ladder = parse_ladder(ladder_text, f"{tune_path} (confirmation)")
            run = create_from_text(store, ladder, ladder_text, tune_path, name, runs_dir)
        console.print(f"confirmation run [bold]{run.name}[/]: {CONTROL} brackets "
                      f"{', '.join(a['name'] for a in arms)}", highlight=False)
        execute(store, run, console)
        run_id = run.id
    return confirmation.read(store, run_id, name, picked, tune)


def _control_hash(tune: TuneFile, data: dict[str, Any], flags: dict[str, Any], env: dict[str, Any]) -> str:
    text = ladders.ladder_text(tune, data, CONTROL, flags, env)
    return render.plan(parse_ladder(text, "tune")).arms[0].config_hash
