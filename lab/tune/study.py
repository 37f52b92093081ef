"""`lab tune TUNE.yaml`: an Optuna study whose every trial is one stored boot, then a confirmation.

Optuna's study lives in the lab's own database (its tables beside the lab's), so one file holds
the trials and the boots that measured them: the trial carries its run and boot as user
attributes, the lab's `tune_trial` row carries the Optuna trial. TPE searches one objective or
several, seeded, given the constraints (so infeasible regions are learned), and modelling the
trials after a random start of a third of the budget. A boot that fails is a failed trial with its
reason and log tail, and the study goes on, unless the boot before it failed the same way: a
failure that repeats is the host's or the base configuration's, and every trial would meet it, so
the study stops and says why.

Resuming after kill -9: a trial left running by a process that is gone is marked failed (its
engine, if still up, is stopped as `lab run --resume` stops one) and does not spend the budget,
and the study asks for new trials until the budget is spent. Trial n is drawn by a sampler seeded
with (seed, n) from the study's stored history, so processes sharing a study never draw alike from
the same seed, and a resumed study draws as an uninterrupted one would from the same history.

Several processes, on one host or many (`--storage postgresql://…`), share a study: each takes
the next trial under the store's lock, so the budget is never overrun and no trial is run twice.
A trial records its host and process; only a `lab tune` on that host may declare it abandoned.
`--worker` processes only take trials; one plain `lab tune` waits for the trials still running
elsewhere, then runs the confirmation on its own host.
"""

from __future__ import annotations

import logging
import os
import re
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
from lab.runner import boot as engine_boot
from lab.runner.errors import Interrupted, RunError, stop_on_sigterm
from lab.store import reader, writer
from lab.store.db import Store
from lab.store.study_storage import study_storage
from lab.tune import budget as study_budget
from lab.tune import constraints
from lab.tune import trial as trial_run
from lab.tune import warmup
from lab.tune.spec import Param, TuneFile, load_tune, parse_tune, same_study

log = logging.getLogger("lab.tune")
POLL_S = 2.0  # how often a plain `lab tune` looks whether other processes' trials have ended


@dataclass
class StudyOutcome:
    study: optuna.Study
    complete: int
    failed: int
    stopped: str | None = None  # why the study stopped before its budget was spent


def open_study(store: Store, tune: TuneFile, text: str, name: str, tune_path: str | Path) -> optuna.Study:
    """Create or load the study in the store's database; a study another tune file started is refused
    with how to resume it or start afresh. A changed budget (or description) continues the study."""
    storage = study_storage(store)
    directions = [o.direction or ("maximize" if _higher(tune, o.metric) else "minimize") for o in tune.objectives]
    study = optuna.create_study(storage=storage, study_name=name, directions=directions, load_if_exists=True,
                                sampler=_sampler(tune, 0, tune.budget.trials))
    stored = study.user_attrs.get("tune_text")
    if stored is None:
        study.set_user_attr("tune_text", text)
    elif stored != text:
        refusal = conflict(study, tune, text, tune_path)
        if refusal:
            raise RunError(refusal)
        study.set_user_attr("tune_text", text)
    return study


def conflict(study: optuna.Study, tune: TuneFile, text: str, tune_path: str | Path) -> str | None:
    """Why `tune` cannot continue `study` (with what to do instead), or None when it can."""
    stored = study.user_attrs.get("tune_text")
    if stored is None or stored == text or same_study(parse_tune(stored, f"{study.study_name} (stored)"), tune):
        return None
    old, new = stored.splitlines(), text.splitlines()
    at = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
    was = old[at].strip() if at < len(old) else "(the end of the file)"
    now = new[at].strip() if at < len(new) else "(the end of the file)"
    names = set(optuna.get_all_study_names(study._storage))
    fresh = next(f"{study.study_name}-{n}" for n in range(2, 10_000) if f"{study.study_name}-{n}" not in names)
    return (f"study {study.study_name} in this store was started from another version of this tune file "
            f"(line {at + 1} was {was!r}, is {now!r}; only budget and description may change): restore that "
            f"version to resume it, or start a new study beside it with `lab tune {tune_path} --name {fresh}` "
            f"(`lab report --study {study.study_name}` still reads the old one)")


def run(store: Store, tune_path: str | Path, name: str | None, runs_dir: str | Path, console: Console,
        worker: bool = False, trials: int | None = None) -> StudyOutcome:
    """Take trials until the study's budget (`trials`, else the file's) is spent, or two boots in a
    row fail the same way; unless `worker`, then wait for the trials other processes are still
    measuring, so that the confirmation sees them all."""
    tune, text = load_tune(tune_path)
    data = yaml.safe_load(text)
    study_name = name or tune.name
    budget = trials or tune.budget.trials
    study = open_study(store, tune, text, study_name, tune_path)
    _fail_abandoned(store, study, tune.engine.stop_grace_s)
    warm, why = warmup.wanted(tune)
    console.print(f"study {study_name}: {len(study_budget.counted(study))} of {budget} trials taken; "
                  f"{describe_sampler(tune, budget)}; warm-up boot: {'on' if warm else 'off'} ({why})",
                  highlight=False, markup=False, soft_wrap=True)
    warmed = False  # an engine answered on this host in this process: caches are warm, a first boot is not
    last_failure: tuple[int, str] | None = None  # (trial, failure kind) of this process's latest boot, if it failed
    stopped = None
    columns = (SpinnerColumn(), TextColumn("[bold]trials"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.description}"))
    with stop_on_sigterm(), Progress(*columns, console=console) as progress:
        task = progress.add_task("", total=budget, completed=_finished(study))
        while (trial := _next_trial(store, study, tune, budget)) is not None:
            params = trial.params
            label = f"trial {trial.number} ({_shown(params)})"
            try:
                run_row, ladder, plan = trial_run.run_trial(store, tune, data, study_name, trial.number, params,
                                                            tune_path, runs_dir)
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

            def status(text: str, label: str = label) -> None:
                progress.update(task, description=f"{label}: {text}")

            try:
                if warm and not warmed:
                    warmed = _warm_up(store, tune, data, study_name, trial.number, tune_path, runs_dir, progress,
                                      status)
                measured = trial_run.boot(store, tune, run_row, ladder, plan, warmed, status=status)
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
                study_budget.exclude(study, trial.number, "interrupted: the lab tune measuring it was stopped")
                raise Interrupted(study_name) from None
            warmed = warmed or measured.booted
            progress.console.print(_tell(store, study, tune, trial, measured), markup=False, highlight=False)
            if measured.values is None:
                kind = failure_kind(measured.reason or "")
                if last_failure is not None and last_failure[1] == kind:
                    stopped = (f"trials {last_failure[0]} and {trial.number} failed the same way, so every trial "
                               f"would: {measured.reason}")
                    for number in (last_failure[0], trial.number):
                        study_budget.exclude(study, number, "it stopped the study: two boots in a row failed the "
                                                            "same way")
                    break
                last_failure = (trial.number, kind)
            else:
                last_failure = None
            progress.update(task, completed=_finished(study))
        while stopped is None and not worker and (running := _running(study)):
            progress.update(task, completed=_finished(study),
                            description=f"waiting for {_shown_running(running)}")
            time.sleep(POLL_S)
    states = [t.state for t in study.get_trials(deepcopy=False)]
    return StudyOutcome(study, states.count(optuna.trial.TrialState.COMPLETE),
                        states.count(optuna.trial.TrialState.FAIL), stopped)


def _tell(store: Store, study: optuna.Study, tune: TuneFile, trial: optuna.Trial,
          measured: trial_run.Measured) -> str:
    """Record the trial's outcome in the study (for the sampler) and the store; the line that says it."""
    label = f"trial {trial.number} ({_shown(trial.params)})"
    trial.set_user_attr("boot_id", measured.boot_id)
    trial.set_user_attr(constraints.VIOLATIONS, measured.constraints)
    trial.set_user_attr(constraints.FIGURES, measured.constraint_values)
    for key, value in (("cold", measured.cold), ("rebooted", measured.rebooted)):
        if value:
            trial.set_user_attr(key, value)
    if measured.values is None:
        trial.set_user_attr("reason", measured.reason)
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
        writer.finish_trial(store, study.study_name, trial.number, state="failed", boot_id=measured.boot_id,
                            reason=measured.reason)
        return f"✗ {label}: {measured.reason}"
    for gate, value in zip(tune.constraints, measured.constraints):
        trial.set_constraint(constraints.key(gate), value)  # <= 0 feasible; the sampler learns from it
    study.tell(trial, measured.values)
    writer.finish_trial(store, study.study_name, trial.number, state="complete", boot_id=measured.boot_id,
                        values=measured.values, constraints=measured.constraints)
    broken = constraints.broken(tune.constraints, measured.constraint_values)
    cold = (f"; booted cold twice ({measured.cold}): its figures may be slow" if measured.cold else
            f"; measured on a second boot, the first was {measured.rebooted}" if measured.rebooted else "")
    return (f"✓ {label}: {_shown_values(tune, measured.values)}{f' (infeasible: {broken})' if broken else ''}{cold}; "
            f"best so far {_best(study, tune)}")


def _warm_up(store: Store, tune: TuneFile, data: dict[str, Any], study: str, number: int, tune_path: str | Path,
             runs_dir: str | Path, progress: Progress, status: Any) -> bool:
    """Boot the base configuration once, unmeasured; whether an engine answered."""
    run_row, ladder, plan = trial_run.warmup_run(store, tune, data, study, number, tune_path, runs_dir)
    try:
        outcome, reason = trial_run.boot_once(store, run_row, ladder, plan, False,
                                           status=lambda t: status(f"warm-up: {t}"))
    except (Interrupted, KeyboardInterrupt):
        writer.set_run_status(store, run_row.id, "interrupted")
        raise
    if outcome == "done":
        progress.console.print(f"✓ warm-up {run_row.name}: the base configuration booted once, unmeasured",
                               markup=False, highlight=False)
        return True
    progress.console.print(f"✗ warm-up {run_row.name}: {outcome}: {reason}; the first trial boots cold (and again "
                           "if it comes up cold)", markup=False, highlight=False)
    return False


def failure_kind(reason: str) -> str:
    """What two failed boots must share to count as one failure repeated: the reason without its log
    tail and with every number blanked (ports, pids, run names and sizes differ from boot to boot)."""
    return re.sub(r"\d+", "#", reason.split("; log tail:")[0])


def describe_sampler(tune: TuneFile, budget: int) -> str:
    startup = startup_trials(budget)
    first = f"first {startup} measured trials" if startup > 1 else "first measured trial"
    return (f"TPE (seed {tune.seed}) draws the {first} at random, then each from a model of the trials so far"
            + (" and their constraints" if tune.constraints else ""))


def startup_trials(budget: int) -> int:
    """Measured trials TPE draws at random before it models the rest. Optuna's default, 10, is made
    for budgets of a hundred trials or more: a smaller study would be random search from first to
    last. A third of the budget explores the space evenly and leaves two thirds to the model; at
    least one, as the model needs a measured trial to start from."""
    return max(1, round(budget / 3))


def _next_trial(store: Store, study: optuna.Study, tune: TuneFile, budget: int) -> optuna.Trial | None:
    """The next trial with its parameters drawn, or None when the budget is spent. Counting the
    trials and asking for one happen under the store's lock, so processes sharing the study
    never overrun its budget between them."""
    with store.lock(f"lab tune {study.study_name}"):
        if len(study_budget.counted(study)) >= budget or _out_of_time(study, tune):
            return None
        study.sampler = _sampler(tune, len(study.get_trials(deepcopy=False)), budget)
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
        study_budget.exclude(study, frozen.number, "abandoned: the lab tune measuring it was killed")
        study._storage.set_trial_state_values(frozen._trial_id, optuna.trial.TrialState.FAIL)
        log.warning("trial %d was left running by a lab tune that is gone: failed", frozen.number)


def _alive(pid: int, started: float | None) -> bool:
    try:
        return started is not None and abs(psutil.Process(pid).create_time() - started) < 0.01
    except psutil.Error:
        return False


def _finished(study: optuna.Study) -> int:
    return sum(t.state.is_finished() for t in study_budget.counted(study))


def _out_of_time(study: optuna.Study, tune: TuneFile) -> bool:
    return tune.budget.time_s is not None and study_budget.spent_s(study) >= tune.budget.time_s


def _suggest(trial: optuna.Trial, param: Param) -> Any:
    if param.int is not None:
        return trial.suggest_int(param.name, param.int.low, param.int.high, step=param.int.step, log=param.int.log)
    if param.float is not None:
        return trial.suggest_float(param.name, param.float.low, param.float.high, log=param.float.log)
    return trial.suggest_categorical(param.name, param.choices)


def _sampler(tune: TuneFile, number: int, budget: int) -> optuna.samplers.BaseSampler:
    """The sampler that draws trial `number`: TPE for one objective or several (it reads the
    constraints each trial sets with Trial.set_constraint, so infeasible regions are learned), its
    random start scaled to the budget (`startup_trials`)."""
    seed = int(np.random.SeedSequence([tune.seed, number]).generate_state(1)[0])
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup_trials(budget))


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
