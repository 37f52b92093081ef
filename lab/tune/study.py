"""`lab tune TUNE.yaml`: an Optuna study whose every trial is one stored boot, then a confirmation.

Optuna's study lives in the lab's own database (its tables beside the lab's), so one file holds
the trials and the boots that measured them: the trial carries its run and boot as user
attributes, the lab's `tune_trial` row carries the Optuna trial. TPE searches one objective,
NSGA-II several, both seeded and both given the constraints, so infeasible regions are learned.
A boot that fails is a failed trial with its reason and log tail, and the study goes on.

Resuming after kill -9: a trial left running by a process that is gone is marked failed (its
engine, if still up, is stopped as `lab run --resume` stops one), and the study asks for new
trials until the budget is spent. Trial n is drawn by a sampler seeded with (seed, n) from the
study's stored history, so processes sharing a study never draw alike from the same seed, and a
resumed study draws as an uninterrupted one would from the same history.

Several processes, on one host or many (`--storage postgresql://…`), share a study: each takes
the next trial under the store's lock, so the budget is never overrun and no trial is run twice.
A trial records its host and process; only a `lab tune` on that host may declare it abandoned.
`--worker` processes only take trials; one plain `lab tune` waits for the trials still running
elsewhere, then runs the confirmation on its own host.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import optuna
import psutil
import yaml
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from lab.ladder.errors import LadderError
from lab.ladder.ladder import Gate
from lab.runner import boot as engine_boot
from lab.runner.errors import Interrupted, RunError, stop_on_sigterm
from lab.store import reader, writer
from lab.store.db import Store
from lab.store.study_storage import study_storage
from lab.tune import trial as trials
from lab.tune.spec import Param, TuneFile, load_tune

log = logging.getLogger("lab.tune")
CONSTRAINTS = "constraints"
POLL_S = 2.0  # how often a plain `lab tune` looks whether other processes' trials have ended


@dataclass
class StudyOutcome:
    study: optuna.Study
    complete: int
    failed: int


def open_study(store: Store, tune: TuneFile, text: str, name: str) -> optuna.Study:
    """Create or load the study in the store's database; a study of other tune text is refused."""
    storage = study_storage(store)
    directions = [o.direction or ("maximize" if _higher(tune, o.metric) else "minimize") for o in tune.objectives]
    study = optuna.create_study(storage=storage, study_name=name, directions=directions, load_if_exists=True,
                                sampler=_sampler(tune, 0))
    stored = study.user_attrs.get("tune_text")
    if stored is None:
        study.set_user_attr("tune_text", text)
    elif stored != text:
        raise RunError(f"study {name} was started from another tune file; pick another --name")
    return study


def run(store: Store, tune_path: str | Path, name: str | None, runs_dir: str | Path, console: Console,
        worker: bool = False) -> StudyOutcome:
    """Take trials until the study's budget is spent; unless `worker`, then wait for the trials other
    processes are still measuring, so that the confirmation sees them all."""
    tune, text = load_tune(tune_path)
    data = yaml.safe_load(text)
    study_name = name or tune.name
    study = open_study(store, tune, text, study_name)
    _fail_abandoned(store, study, tune.engine.stop_grace_s)
    columns = (SpinnerColumn(), TextColumn("[bold]trials"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.description}"))
    with stop_on_sigterm(), Progress(*columns, console=console) as progress:
        task = progress.add_task("", total=tune.budget.trials, completed=_finished(study))
        while (trial := _next_trial(store, study, tune)) is not None:
            params = trial.params
            label = f"trial {trial.number} ({_shown(params)})"
            try:
                run_row, ladder, plan = trials.run_trial(store, tune, data, study_name, trial.number, params, tune_path,
                                                         runs_dir)
            except LadderError as exc:  # the engine would refuse these values: a failed trial, not a failed study
                reason = " ".join(exc.lines())
                trial.set_user_attr("reason", reason)
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
                progress.console.print(f"✗ {label}: refused: {reason}", markup=False, highlight=False)
                progress.update(task, completed=_finished(study))
                continue
            trial.set_user_attr("run", run_row.name)
            writer.add_trial(store, study=study_name, number=trial.number, optuna_trial_id=trial._trial_id,
                             params=params, run_id=run_row.id)
            try:
                measured = trials.boot(store, tune, run_row, ladder, plan,
                                       status=lambda t, label=label: progress.update(task, description=f"{label}: {t}"))
            except (Interrupted, KeyboardInterrupt):
                # Failed now, not left running: a plain `lab tune` waiting for the study's trials
                # would otherwise wait for it until a `lab tune` on this host is started again.
                reason = "interrupted: lab tune was stopped during this trial"
                writer.set_run_status(store, run_row.id, "interrupted", reason)
                booted = [b for s in reader.slots(store, run_row.id) for b in s.boots]
                writer.finish_trial(store, study_name, trial.number, state="failed",
                                    boot_id=booted[-1].id if booted else None, reason=reason)
                trial.set_user_attr("reason", reason)
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
                raise Interrupted(study_name) from None
            trial.set_user_attr("boot_id", measured.boot_id)
            trial.set_user_attr(CONSTRAINTS, measured.constraints)
            if measured.values is not None:
                for gate, value in zip(tune.constraints, measured.constraints):
                    trial.set_constraint(_gate_key(gate), value)  # <= 0 feasible; the samplers learn from it
            if measured.values is None:
                trial.set_user_attr("reason", measured.reason)
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
                writer.finish_trial(store, study_name, trial.number, state="failed", boot_id=measured.boot_id,
                                    reason=measured.reason)
                progress.console.print(f"✗ {label}: {measured.reason}", markup=False, highlight=False)
            else:
                study.tell(trial, measured.values)
                writer.finish_trial(store, study_name, trial.number, state="complete", boot_id=measured.boot_id,
                                    values=measured.values, constraints=measured.constraints)
                feasible = all(c <= 0 for c in measured.constraints)
                progress.console.print(f"✓ {label}: {_shown_values(tune, measured.values)}"
                                       f"{'' if feasible else ' (violates a constraint)'}; best so far "
                                       f"{_best(study, tune)}", markup=False, highlight=False)
            progress.update(task, completed=_finished(study))
        while not worker and (running := _running(study)):
            progress.update(task, completed=_finished(study),
                            description=f"waiting for {_shown_running(running)}")
            time.sleep(POLL_S)
    states = [t.state for t in study.get_trials(deepcopy=False)]
    return StudyOutcome(study, states.count(optuna.trial.TrialState.COMPLETE),
                        states.count(optuna.trial.TrialState.FAIL))


def _next_trial(store: Store, study: optuna.Study, tune: TuneFile) -> optuna.Trial | None:
    """The next trial with its parameters drawn, or None when the budget is spent. Counting the
    trials and asking for one happen under the store's lock, so processes sharing the study
    never overrun its budget between them."""
    with store.lock(f"lab tune {study.study_name}"):
        if len(study.get_trials(deepcopy=False)) >= tune.budget.trials or _out_of_time(study, tune):
            return None
        study.sampler = _sampler(tune, len(study.get_trials(deepcopy=False)))
        trial = study.ask()
        for param in tune.space:
            _suggest(trial, param)
        me = psutil.Process()
        trial.set_user_attr("host", socket.gethostname())
        trial.set_user_attr("pid", me.pid)
        trial.set_user_attr("pid_started", me.create_time())
        return trial


def _running(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    return study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))


def _shown_running(running: list[optuna.trial.FrozenTrial]) -> str:
    return ", ".join(f"trial {t.number} on {t.user_attrs.get('host', '?')}" for t in running)


def _fail_abandoned(store: Store, study: optuna.Study, grace_s: float) -> None:
    """Trials this host left running in a `lab tune` that is gone: stop their engine, fail them, keep
    their runs. Another host's trials are that host's to judge: its process cannot be seen from here."""
    for frozen in _running(study):
        if frozen.user_attrs.get("host", socket.gethostname()) != socket.gethostname():
            continue
        pid, started = frozen.user_attrs.get("pid"), frozen.user_attrs.get("pid_started")
        if pid is not None and pid != os.getpid() and _alive(pid, started):
            continue  # another `lab tune` on this host is measuring it
        run_name = frozen.user_attrs.get("run")
        if run_name is not None:
            run_row = reader.find_run(store, run_name)
            for boot in reader.live_boots(store, run_row.id):
                if boot.pid is not None and engine_boot.stop_orphan(boot.pid, boot.pid_started, grace_s):
                    log.info("stopped engine pid %d left by an interrupted trial", boot.pid)
                writer.update_boot(store, boot.id, status="interrupted", reason="lab tune was killed during this boot")
            writer.set_run_status(store, run_row.id, "interrupted", "lab tune was killed during this trial")
            booted = [b for slot in reader.slots(store, run_row.id) for b in slot.boots]
            writer.finish_trial(store, study.study_name, frozen.number, state="failed",
                                boot_id=booted[-1].id if booted else None,
                                reason="interrupted: lab tune was killed during this trial")
            if booted:
                study._storage.set_trial_user_attr(frozen._trial_id, "boot_id", booted[-1].id)
        study._storage.set_trial_user_attr(frozen._trial_id, "reason", "interrupted: lab tune was killed")
        study._storage.set_trial_state_values(frozen._trial_id, optuna.trial.TrialState.FAIL)
        log.warning("trial %d was left running by a lab tune that is gone: failed", frozen.number)


def _alive(pid: int, started: float | None) -> bool:
    try:
        return started is not None and abs(psutil.Process(pid).create_time() - started) < 0.01
    except psutil.Error:
        return False


def _finished(study: optuna.Study) -> int:
    return sum(t.state.is_finished() for t in study.get_trials(deepcopy=False))


def _out_of_time(study: optuna.Study, tune: TuneFile) -> bool:
    if tune.budget.time_s is None:
        return False
    spent = sum((t.datetime_complete - t.datetime_start).total_seconds()
                for t in study.get_trials(deepcopy=False) if t.datetime_complete and t.datetime_start)
    return spent >= tune.budget.time_s


def _suggest(trial: optuna.Trial, param: Param) -> Any:
    if param.int is not None:
        return trial.suggest_int(param.name, param.int.low, param.int.high, step=param.int.step, log=param.int.log)
    if param.float is not None:
        return trial.suggest_float(param.name, param.float.low, param.float.high, log=param.float.log)
    return trial.suggest_categorical(param.name, param.choices)


def _sampler(tune: TuneFile, number: int) -> optuna.samplers.BaseSampler:
    """The sampler that draws trial `number`. Both kinds read the constraints each trial sets
    (Trial.set_constraint), so infeasible regions are learned."""
    seed = int(np.random.SeedSequence([tune.seed, number]).generate_state(1)[0])
    if len(tune.objectives) == 1:
        return optuna.samplers.TPESampler(seed=seed)
    return optuna.samplers.NSGAIISampler(seed=seed)


def _gate_key(gate: Gate) -> str:
    where = ",".join(f"{k}={v}" for k, v in sorted(gate.where.items()))
    return gate.metric + (f"[{where}]" if where else "")


def _higher(tune: TuneFile, metric: str) -> bool:
    from lab.instruments import REGISTRY

    instrument, _, name = metric.partition(".")
    return dict(REGISTRY[instrument]().metrics(getattr(tune.instruments, instrument)))[name] == "higher"


def _shown(params: dict[str, Any]) -> str:
    return ", ".join(f"{k.split(':', 1)[1]}={v:.4g}" if isinstance(v, float) else f"{k.split(':', 1)[1]}={v}"
                     for k, v in params.items())


def _shown_values(tune: TuneFile, values: Sequence[float]) -> str:
    return ", ".join(f"{o.metric}={v:.4g}" for o, v in zip(tune.objectives, values))


def _best(study: optuna.Study, tune: TuneFile) -> str:
    try:
        best = study.best_trials
    except ValueError:
        return "none feasible"
    if not best:
        return "none feasible"
    if len(tune.objectives) == 1:
        return f"{best[0].values[0]:.4g} (trial {best[0].number})"
    return f"{len(best)} on the Pareto front"
