"""`lab tune TUNE.yaml --dry-run`: the tune file checked as `lab tune` checks it before its first
trial, and what the study would do, without booting or writing anything: whether the store holds
the study already (and whether this file may resume it), the sampler, the warm-up, the space, the
objectives, the constraints and the confirmation."""

from __future__ import annotations

from pathlib import Path

import optuna
import yaml

from lab.ladder import render
from lab.ladder.validate import parse_ladder
from lab.store.db import Store
from lab.store.study_storage import has_studies, study_storage
from lab.tune import ladders, warmup
from lab.tune.budget import counted
from lab.tune.spec import Param, TuneFile
from lab.tune.study import conflict, describe_sampler


def describe(tune: TuneFile, text: str, tune_path: str | Path, store: Store | None, store_note: str, name: str | None,
             trials: int | None) -> tuple[list[str], str | None]:
    """(the lines to print, why `lab tune` would refuse to go on with this study, or None)."""
    study_name = name or tune.name
    budget = trials or tune.budget.trials
    refusal = None
    state = f"a new study ({store_note})"
    if store is not None and has_studies(store) and study_name in optuna.get_all_study_names(study_storage(store)):
        study = optuna.load_study(study_name=study_name, storage=study_storage(store))
        refusal = conflict(study, tune, text, tune_path)
        state = refusal or f"resumes: {len(counted(study))} of its {budget} trials taken"
    base_text = ladders.ladder_text(tune, yaml.safe_load(text), ladders.CONTROL, {}, {})
    ladder = parse_ladder(base_text, f"{tune_path} (base)")
    base = render.plan(ladder).arms[0]
    warm, why = warmup.wanted(tune)
    lines = [f"tune file {tune_path}: valid; the base configuration {base.config_hash} passes every check `lab run` "
             "makes of a ladder",
             f"study {study_name}: {state}",
             f"sampler: {describe_sampler(tune, budget)}",
             f"warm-up boot: {'on' if warm else 'off'} ({why})",
             "space: " + "; ".join(_param(p) for p in tune.space),
             "objectives: " + ", ".join(f"{o.metric}{_where(o.where)}" + (f" ({o.direction})" if o.direction else "")
                                        for o in tune.objectives),
             "constraints: " + (", ".join(f"{g.metric}{_where(g.where)}"
                                          + (f" >= {g.min:g}" if g.min is not None else "")
                                          + (f" <= {g.max:g}" if g.max is not None else "")
                                          for g in tune.constraints) or "none"),
             f"budget: {budget} trials, one boot each" + (f", or {tune.budget.time_s:g} s of trials"
                                                          if tune.budget.time_s else ""),
             f"then: the best {tune.confirm.top} feasible trials confirmed as arms against the base "
             f"({tune.confirm.repeats} repeat{'s' if tune.confirm.repeats > 1 else ''}, KEEP threshold "
             f"{tune.confirm.threshold_pct:g} %) in run {study_name}-confirm"]
    return lines, refusal


def _param(p: Param) -> str:
    if p.int is not None:
        shown = f"{p.int.low}..{p.int.high}" + (f" step {p.int.step}" if p.int.step > 1 else "")
        return f"{p.name} {shown}" + (" (log)" if p.int.log else "")
    if p.float is not None:
        return f"{p.name} {p.float.low:g}..{p.float.high:g}" + (" (log)" if p.float.log else "")
    return f"{p.name} one of {', '.join(str(c) for c in p.choices or [])}"


def _where(where: dict) -> str:
    return "[" + ",".join(f"{k}={v}" for k, v in sorted(where.items())) + "]" if where else ""
