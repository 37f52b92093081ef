"""The `lab` command. Each subcommand is an arguments function and a handler, registered in COMMANDS.

Handlers import what they need when they run, so `lab --help` stays fast and never loads torch.
"""

from __future__ import annotations

import argparse
import shlex
import functools
import math
import logging
import sys
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from lab.runner.calibrate import Calibration

DEFAULT_DB = "lab.db"


def _db_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db", default=DEFAULT_DB, metavar="PATH|URL",
                        help="the store: a SQLite file (commands that only read also take one compressed with xz, "
                             "X.db.xz) or a PostgreSQL URL, postgresql://user:password@host/db (printed with its "
                             f"password masked) (default: ./{DEFAULT_DB})")


def _run_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("ladder", nargs="?", metavar="LADDER.yaml", help="the ladder to run")
    parser.add_argument("--resume", metavar="RUN",
                        help="finish an interrupted run (its name, id, or ladder name for its latest run); no LADDER")
    parser.add_argument("--name", help="name of the new run (default: <ladder name>-<date>-<time>)")
    parser.add_argument("--runs-dir", default="runs", metavar="DIR", help="where boot logs go (default: ./runs)")
    parser.add_argument("--dry-run", action="store_true", help="validate the ladder and print its boots; run nothing")
    parser.add_argument("--calibrate", type=int, metavar="N",
                        help="first boot the control N times after a warm-up (`lab calibrate --boots N`), then run "
                             "the ladder and judge it with that noise (default: the ladder's keep.calibrate)")
    _time_budget_arg(parser)
    _db_arg(parser)


def _time_budget_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--time-budget", type=_seconds, metavar="SECONDS",
                        help="start no boot that the time left cannot hold, judged by the longest boot of its kind "
                             "this run has finished; what is left stays for `lab run --resume` (exit status 75)")


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds: {text!r}")
    return value


# sysexits' EX_TEMPFAIL: the run stopped on its time budget, and resuming it later continues it.
EXIT_OUT_OF_TIME = 75


def cmd_run(args: argparse.Namespace) -> int:
    import time

    from lab.analysis.verdicts import key_figure_missing
    from lab.ladder import render
    from lab.ladder.engines import kind_of
    from lab.ladder.validate import load_ladder
    from lab.report.listing import print_plan
    from lab.runner import calibrate
    from lab.runner.run import create, execute, resume
    from lab.store.db import open_store, shown

    console = _console()
    if bool(args.ladder) == bool(args.resume):
        raise UsageError("give either LADDER.yaml or --resume RUN")
    if args.resume and args.calibrate is not None:
        raise UsageError("--calibrate starts a new run; a resumed run is judged with the newest calibration stored")
    ladder = load_ladder(args.ladder)[0] if args.ladder else None
    boots = args.calibrate if args.calibrate is not None else ladder.keep.calibrate if ladder else None
    if boots is not None and not calibrate.MIN_BOOTS <= boots <= calibrate.MAX_BOOTS:
        raise UsageError(f"--calibrate {boots}: a calibration boots the control {calibrate.MIN_BOOTS} to "
                         f"{calibrate.MAX_BOOTS} times")
    if args.dry_run:
        if not ladder:
            raise UsageError("--dry-run needs LADDER.yaml")
        plan = render.plan(ladder)
        # What each arm would run (an engine arm its own engine), its environment first; the port is
        # chosen at each boot.
        commands = {arm.name: shlex.join([*(f"{k}={v}" for k, v in sorted(launch.env.items())), *launch.argv])
                    for arm in plan.arms for launch in [kind_of(arm.recipe).launch(arm, "{port}")]}
        out = _console(stdout=True)
        if boots:
            out.print(f"first a calibration: a warm-up, then {boots} boots of {ladder.windows[0].control_name} "
                      f"(`lab calibrate --boots {boots}`); then:", highlight=False)
        print_plan(out, plan, ladder, commands)
        return 0
    began = time.monotonic()
    store = open_store(args.db)
    try:
        if boots:
            done = calibrate.run_calibration(store, args.ladder, boots, console, runs_dir=args.runs_dir,
                                             time_budget_s=args.time_budget)
            _print_noise(done)
            if done.stopped or not done.rows:
                return _calibration_stopped(done, args)
        budget = None if args.time_budget is None else args.time_budget - (time.monotonic() - began)
        run = resume(store, args.resume) if args.resume else create(store, args.ladder, args.name, args.runs_dir)
        console.print(f"run [bold]{run.name}[/] (id {run.id}) → {shown(args.db)}; boot logs in {run.logs_dir}")
        outcome = execute(store, run, console, budget, db=args.db)
        missing = key_figure_missing(store, outcome.run_id) if outcome.boots and not outcome.out_of_time else None
    finally:
        store.close()
    counts = ", ".join(f"{n} {status}" for status, n in sorted(outcome.boots.items())) or "nothing booted"
    if outcome.out_of_time:
        console.print(f"run [bold]{outcome.name}[/] stopped: {counts}. `lab ls {outcome.name}` shows its boots.")
        _error(f"{outcome.out_of_time}; `lab run --resume {outcome.name}` continues it")
        return EXIT_OUT_OF_TIME
    console.print(f"run [bold]{outcome.name}[/] finished: {counts}. `lab ls {outcome.name}` shows its boots.")
    if outcome.boots and not outcome.measured_done:
        _error(f"no measured boot of run {outcome.name} succeeded; the log tails are in `lab ls {outcome.name}`")
        return 1
    if missing:
        _error(f"run {outcome.name} judged nothing: {missing}; `lab ls {outcome.name}` shows each boot's cells")
        return 1
    return 0


def _calibration_stopped(done: Calibration, args: argparse.Namespace) -> int:
    """The ladder is not run after a calibration that stopped early or measured nothing: say what was
    kept and what runs it."""
    kept = ("the noise above, from the control boots that finished, is stored: `lab run "
            f"{args.ladder} --db {args.db}` judges with it") if done.rows else "no noise was stored"
    if done.stopped == "interrupted":
        _error(f"calibration {done.run.name} interrupted before the ladder ran; {kept}")
        return 130
    if done.stopped:
        _error(f"calibration {done.run.name} stopped: {done.stopped}; the ladder was not run; {kept}")
        return EXIT_OUT_OF_TIME
    _error(f"calibration {done.run.name}: no key metric had 3 warm control boots, so the ladder was not run; "
           f"`lab ls {done.run.name} --db {args.db}` shows what happened")
    return 1


def _calibrate_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("ladder", nargs="?", metavar="LADDER.yaml", help="the ladder whose key metrics to calibrate")
    parser.add_argument("--resume", metavar="RUN", help="finish an interrupted calibration and measure its noise; "
                                                        "no LADDER")
    parser.add_argument("--boots", type=int, default=7, metavar="N",  # lab.runner.run.SUGGESTED_CALIBRATION_BOOTS
                        help="control boots in the A/A window (at least 3; default 7)")
    parser.add_argument("--name", help="name of the calibration run (default: <ladder>-calibration-<date>-<time>)")
    parser.add_argument("--runs-dir", default="runs", metavar="DIR", help="where boot logs go (default: ./runs)")
    _db_arg(parser)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from lab.runner import calibrate
    from lab.store.db import open_store

    if bool(args.ladder) == bool(args.resume):
        raise UsageError("give either LADDER.yaml or --resume RUN")
    store = open_store(args.db)
    try:
        try:
            done = (calibrate.resume_calibration(store, args.resume, _console()) if args.resume else
                    calibrate.run_calibration(store, args.ladder, args.boots, _console(), name=args.name,
                                              runs_dir=args.runs_dir))
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    finally:
        store.close()
    _print_noise(done)
    if done.stopped:
        _error((f"calibration {done.run.name} interrupted: the noise above is from the control boots that finished"
                if done.rows else f"calibration {done.run.name} interrupted before 3 warm control boots: no noise "
                                  "stored") + f"; `lab calibrate --resume {done.run.name}` finishes it")
        return 130
    if not done.rows:
        _error(f"no key metric had 3 warm control boots; `lab ls {done.run.name}` shows what happened")
        return 1
    return 0


def _print_noise(done: Calibration) -> None:
    from rich.table import Table

    table = Table("key metric", "boots", "boot-to-boot SD %", "drift %",
                  f"MDE % ({done.repeats} repeats, 80 % power)")
    for row in done.rows:
        table.add_row(row["metric"], str(row["boots"]), f"{math.expm1(row['sd_log']) * 100:.2f}",
                      f"{row['drift_pct']:.2f}", f"±{row['mde_pct']:.2f}")
    _console(stdout=True).print(table)


def _ls_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", nargs="?", metavar="RUN",
                        help="a run (name, id, or ladder name for its latest run): list its arms and boots")
    _db_arg(parser)


def cmd_ls(args: argparse.Namespace) -> int:
    from lab.report.listing import print_run, print_runs
    from lab.store.db import open_store

    store = open_store(args.db, read_only=True)
    try:
        if args.run:
            print_run(_console(stdout=True), store, args.run)
        else:
            print_runs(_console(stdout=True), store)
    finally:
        store.close()
    return 0


def _schema_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--output", metavar="FILE", help="write it here instead of printing it")


def cmd_schema(args: argparse.Namespace) -> int:
    import json

    from lab.ladder.ladder import json_schema

    text = json.dumps(json_schema(), indent=2) + "\n"
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


def _compare_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("a", metavar="A", help="the baseline: an arm of the latest run, or RUN:ARM")
    parser.add_argument("b", metavar="B", help="the candidate: an arm of the latest run, or RUN:ARM")
    parser.add_argument("--json", action="store_true", help="print the comparison as JSON, for machines")
    _db_arg(parser)


def cmd_compare(args: argparse.Namespace) -> int:
    import json

    from lab.analysis.compare import compare, print_comparison
    from lab.store.db import open_store

    store = open_store(args.db, read_only=True)
    try:
        comparison = compare(store, args.a, args.b)
    finally:
        store.close()
    if args.json:
        sys.stdout.write(json.dumps(comparison.to_dict(), indent=2, ensure_ascii=False) + "\n")
    else:
        print_comparison(_console(stdout=True), comparison)
    return 0


def _report_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", nargs="?", metavar="RUN",
                        help="a run (name, id, or ladder name for its latest run; default: the latest run)")
    parser.add_argument("--study", metavar="NAME", help="report a `lab tune` study instead of a run: its history, "
                                                           "parameter importances, Pareto front and confirmation")
    parser.add_argument("--out", default="reports", metavar="DIR",
                        help="the report goes to DIR/<run or study name>/ (default: ./reports)")
    _db_arg(parser)


def cmd_report(args: argparse.Namespace) -> int:
    from lab.report.build import write_report
    from lab.store.db import open_store

    if args.study and args.run:
        raise UsageError("give a RUN or --study NAME, not both")
    store = open_store(args.db, read_only=True)
    try:
        if args.study:
            from lab.report.tune import write_tune_report

            path = write_tune_report(store, args.study, args.out)
        else:
            path = write_report(store, args.run, args.out)
    finally:
        store.close()
    _console(stdout=True).print(f"report written to {path / 'index.html'} and {path / 'index.md'}", highlight=False)
    return 0


def _export_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", metavar="RUN", help="a run (name, id, or ladder name for its latest run)")
    parser.add_argument("--format", choices=("csv", "parquet", "json"), required=True,
                        help="csv and parquet: one file per table; json: one document")
    parser.add_argument("--out", default="exports", metavar="DIR",
                        help="the files go to DIR/<run name>/ (default: ./exports)")
    _db_arg(parser)


def cmd_export(args: argparse.Namespace) -> int:
    from lab.report.export import export_run
    from lab.store.db import open_store

    store = open_store(args.db, read_only=True)
    try:
        path = export_run(store, args.run, args.format, args.out)
    finally:
        store.close()
    _console(stdout=True).print(f"exported to {path}", highlight=False)
    return 0


def _sweep_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("ladder", metavar="LADDER.yaml", help="the ladder to run and file under its series")
    parser.add_argument("--label", required=True, help="what this point is (a commit, a date, an engine version); "
                                                       "unique in its series")
    parser.add_argument("--control-only", action="store_true",
                        help="boot only each window's control (opened and closed), not its arms")
    parser.add_argument("--name", help="name of the run (default: <ladder>-<label>-<date>-<time>)")
    parser.add_argument("--runs-dir", default="runs", metavar="DIR", help="where boot logs go (default: ./runs)")
    _time_budget_arg(parser)
    _db_arg(parser)


def cmd_sweep(args: argparse.Namespace) -> int:
    from lab.runner import sweep
    from lab.runner.run import execute
    from lab.store.db import open_store

    console = _console()
    store = open_store(args.db)
    try:
        run, series = sweep.create(store, args.ladder, args.label, args.control_only, args.name, args.runs_dir)
        console.print(f"run [bold]{run.name}[/] (id {run.id}) → series {series}, label {args.label}", highlight=False)
        outcome = execute(store, run, console, args.time_budget)
    finally:
        store.close()
    if outcome.out_of_time:
        _error(f"{outcome.out_of_time}; `lab run --resume {outcome.name}` continues it")
        return EXIT_OUT_OF_TIME
    if outcome.boots and not outcome.measured_done:
        _error(f"no measured boot of run {outcome.name} succeeded; the log tails are in `lab ls {outcome.name}`")
        return 1
    console.print(f"`lab history {series}` shows the series", highlight=False)
    return 0


def _history_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("series", nargs="?", metavar="SERIES",
                        help="a series name (<ladder>@<host>), or a ladder name with one series; none: list the series")
    parser.add_argument("--check", action="store_true",
                        help="gate on the latest label (for cron or CI); exit status 1: a confirmed regression, "
                             "2: the gate cannot run (unknown or ambiguous series, bad arguments, unreadable store), "
                             "3: nothing to compare yet, 4: the latest label ran a new base config")
    parser.add_argument("--html", metavar="DIR", help="also write DIR/history-<series>/index.html")
    _db_arg(parser)


def cmd_history(args: argparse.Namespace) -> int:
    from lab.report.history import Outcome, load, resolve
    from lab.store import reader
    from lab.store.db import StoreError, open_store

    out = _console(stdout=True)
    try:
        store = open_store(args.db, read_only=True)
    except StoreError as exc:
        _error(str(exc))
        return Outcome.BROKEN
    try:
        if args.series is None:
            if args.check:
                _error("--check needs a SERIES (or a ladder name with one series); `lab history` lists them")
                return Outcome.BROKEN
            points = reader.series_points(store)
            for series in dict.fromkeys(p.series for p in points):
                labels = [p.label for p in points if p.series == series]
                out.print(f"{series}: {len(labels)} labels, {labels[0]} … {labels[-1]}", highlight=False)
            return 0
        try:
            history = load(store, resolve(store, args.series))
        except LookupError as exc:
            _error(str(exc))
            return Outcome.BROKEN
    finally:
        store.close()
    _print_history(out, history)
    if args.html:
        from lab.report.history_page import write

        out.print(f"history page written to {write(history, args.html)}", highlight=False)
    if not args.check:
        return 0
    check = history.check()
    for line in check.warnings:
        _error(f"warning: {line}")
    for line in check.regressions:
        _error(f"regression: {line}")
    _error(f"check: {check.summary} (exit status {int(check.outcome)}: {check.outcome.name.lower().replace('_', ' ')})")
    return int(check.outcome)


def _print_history(out, history) -> None:  # rich Console, lab.report.history.History
    from rich.table import Table

    labels = history.labels
    out.print(f"series {history.series}: {len(labels)} labels ({labels[0]} … {labels[-1]}), KEEP threshold "
              f"{history.threshold_pct:g} %", highlight=False, markup=False)
    for line in history.base_changes():
        out.print(f"{line}; labels under different bases are not compared", highlight=False, markup=False)
    out.print("what this series detects under its current base (the noise the gate uses):", highlight=False)
    for line in history.detectable():
        out.print(f"  {line}", highlight=False, markup=False)
    for mh in history.metrics:
        table = Table("label", "run", mh.unit or "value", "control boots", "drift %", "base", title=mh.metric)
        for p in mh.points:
            base = history.bases[p.base]
            table.add_row(p.label, p.run, f"{p.value:.4g}" if p.value is not None else "-",
                          ", ".join(f"{v:.4g}" for v in p.boots),
                          f"{p.drift_pct:.2f}" if p.drift_pct is not None else "",
                          base.config_hash[:8] + (" (new)" if base.label == p.label and p.base else ""))
        out.print(table)
        for seg in mh.segments:
            a = seg.analysis
            if a is None:
                continue
            labels = [p.label for p in seg.points]
            under = f"labels {labels[0]} … {labels[-1]}: " if len(mh.segments) > 1 else ""
            if not seg.comparable:
                out.print(f"  {under}one label with a value: nothing to compare", highlight=False, markup=False)
                continue
            out.print(f"  {under}a departure must exceed ±{a.limit_pct:.2f} % (noise band ±{a.band_pct:.2f} %)",
                      highlight=False, markup=False)
            for step in a.steps:
                out.print(f"  step: {step.describe(labels, mh.unit, a.limit_pct)}", highlight=False, markup=False)
            for i in a.outliers:
                out.print(f"  outlier: label {labels[i]} (not a step: the next label is back)", highlight=False,
                          markup=False)
        if not mh.segments:
            out.print("  no label with a value: nothing to compare", highlight=False)


def _tune_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("tune", nargs="?", metavar="TUNE.yaml", help="the tune file: engine, space, objectives, "
                                                                      "constraints, budget")
    parser.add_argument("--name", help="the study's name (default: the tune file's name); run again to resume it, or "
                                       "give a new name to start afresh beside it")
    parser.add_argument("--trials", type=_positive_int, metavar="N",
                        help="the study's trial budget (default: the file's budget.trials); raise it later to go on")
    parser.add_argument("--dry-run", action="store_true",
                        help="check the tune file as `lab tune` does and print what the study would do; boot nothing")
    parser.add_argument("--runs-dir", default="runs", metavar="DIR", help="where boot logs go (default: ./runs)")
    parser.add_argument("--schema", action="store_true", help="print the tune file JSON Schema and exit")
    parser.add_argument("--worker", action="store_true",
                        help="only take trials of the study (several processes or hosts may); a plain `lab tune` "
                             "waits for them and runs the confirmation")
    parser.add_argument("--db", "--storage", dest="db", default=DEFAULT_DB, metavar="PATH|URL",
                        help="the store holding the study and the boots: a SQLite file, or postgresql://user@host/db "
                             f"shared by several hosts (default: ./{DEFAULT_DB})")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {text!r}")
    return value


# `lab tune` decided that no candidate beats the base configuration: a result, not an error.
EXIT_BASE_STAYS = 3


def cmd_tune(args: argparse.Namespace) -> int:
    import json

    import optuna

    from lab.runner.errors import Interrupted
    from lab.store.db import StoreError, open_store, scrubbed
    from lab.tune import confirm, study
    from lab.tune.spec import json_schema, load_tune

    if args.schema:
        sys.stdout.write(json.dumps(json_schema(), indent=2) + "\n")
        return 0
    if not args.tune:
        raise UsageError("give TUNE.yaml (or --schema)")
    console = _console()
    tune, text = load_tune(args.tune)
    if args.dry_run:
        return _tune_dry_run(args, tune, text)
    store = open_store(args.db)
    try:
        try:
            outcome = study.run(store, args.tune, args.name, args.runs_dir, console, worker=args.worker,
                                trials=args.trials)
        except Interrupted as exc:
            name = exc.args[0] if exc.args else args.name or tune.name
            _error(f"interrupted; study {name} goes on when `lab tune {args.tune}` is run again with the same "
                   "--name and --db")
            return 130
        except optuna.exceptions.StorageInternalError as exc:
            # Optuna's own message blames the data; the database's error is the cause.
            cause = exc.__cause__ or exc
            reason = scrubbed(f"{type(cause).__name__}: {' '.join(str(cause).split())}", store.url)
            raise StoreError(f"the study's store failed: {reason}; `lab tune {args.tune}` run again goes on") from exc
        name = outcome.study.study_name
        console.print(f"study {name}: {outcome.complete} trials measured, {outcome.failed} failed", highlight=False)
        if outcome.stopped:
            _error(f"study {name} stopped: {outcome.stopped}. Fix that, then run the same `lab tune` again: the "
                   "study goes on, and these two trials do not spend its budget")
            return 1
        if args.worker:
            console.print("the budget is spent; a plain `lab tune` on the same store confirms the best trials",
                          highlight=False)
            return 0
        if not outcome.complete:
            _error(f"study {name}: no trial was measured; `lab report --study {name}` lists why each failed")
            return 1
        result = confirm.confirm(store, outcome.study, tune, text, args.tune, args.runs_dir, console)
    finally:
        store.close()
    if result is None:
        _error(f"study {name}: the base stays: no feasible trial differs from it, so there is nothing to confirm "
               f"(exit status {EXIT_BASE_STAYS}); `lab report --study {name}` shows each trial's constraints")
        return EXIT_BASE_STAYS
    _print_confirmation(_console(stdout=True), tune, result)
    console.print(f"`lab report --study {name}` writes the study's report (history, importances, Pareto front, "
                  "trials with their constraints, confirmation)", highlight=False, markup=False)
    if result.winner is None:
        _error(f"the base stays: the confirmation ({result.run}) {result.why} (exit status {EXIT_BASE_STAYS})")
        return EXIT_BASE_STAYS
    return 0


def _tune_dry_run(args: argparse.Namespace, tune, text: str) -> int:  # tune: lab.tune.spec.TuneFile
    from lab.store.db import StoreError, open_store
    from lab.tune.preview import describe

    try:
        store = open_store(args.db, read_only=True)
        note = f"store {args.db}"
    except StoreError as exc:
        store, note = None, f"{exc}".split(";")[0]
    try:
        lines, refusal = describe(tune, text, args.tune, store, note, args.name, args.trials)
    finally:
        if store is not None:
            store.close()
    out = _console(stdout=True)
    for line in lines:
        out.print(line, highlight=False, markup=False, soft_wrap=True)
    if refusal:
        _error(refusal)
        return 1
    return 0


def _print_confirmation(out, tune, result) -> None:  # rich Console, TuneFile, lab.tune.confirmation.Confirmation
    from rich.table import Table

    table = Table("arm", "trial", "params", *(f"{o.metric} trial → confirmed (moved)" for o in tune.objectives),
                  "KEEP", title=f"confirmation {result.run}")
    for c in result.candidates:
        moved = [f"{t:.4g} → " + (f"{v:.4g} ({d:+.1f} %)" if v is not None and d is not None else "no value")
                 for t, v, d in zip(c.trial_values, c.confirmed, c.moved_pct())]
        params = ", ".join(f"{k.split(':', 1)[1]}={v}" for k, v in c.params.items())
        table.add_row(c.arm, str(c.trial), params, *moved, f"{c.decision}: {c.reason}")
    out.print(table)
    if result.winner:
        w = result.winner
        out.print(f"winner: {w.arm} (trial {w.trial}), kept by the confirmation ({result.why}); serve it with "
                  f"`lab serve --best {result.run}`", highlight=False, markup=False)


def _serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--best", required=True, metavar="RUN",
                        help="the run (name, id, or ladder name for its latest run) whose winner to serve: its kept "
                             "arm, or the best of several (the rule `lab tune` names its winner by)")
    parser.add_argument("--arm", metavar="NAME", help="serve this arm (or control) whatever its verdict")
    parser.add_argument("--host", default="127.0.0.1",
                        help="bind address of the bundled engine (default: 127.0.0.1); a command engine binds "
                             "where its command says")
    parser.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    parser.add_argument("--print", action="store_true", dest="print_only",
                        help="print the environment and command instead of running them")
    _db_arg(parser)


def cmd_serve(args: argparse.Namespace) -> int:
    from lab.runner.serve_best import choose, exec_engine
    from lab.store.db import open_store

    store = open_store(args.db, read_only=True)
    try:
        chosen = choose(store, args.best, args.arm, args.host, args.port)
    finally:
        store.close()
    out = _console(stdout=True)
    if args.print_only:
        sys.stdout.write(chosen.shell_line() + "\n")
        return 0
    out.print(f"arm {chosen.arm} of run {chosen.run} (window {chosen.window}): {chosen.decision} ({chosen.reason})",
              highlight=False, markup=False)
    out.print(f"why this arm: {chosen.picked}", highlight=False, markup=False)
    out.print(f"config hash {chosen.config_hash}", highlight=False)
    out.print(f"command: {chosen.shell_line()}", highlight=False, markup=False, soft_wrap=True)
    sys.stdout.flush()
    exec_engine(chosen)
    return 1  # not reached: the engine replaced this process


def _engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="passed to the engine: `lab engine serve --help`")


def cmd_engine(args: argparse.Namespace) -> int:
    return _engine(args.rest)


def _engine(argv: list[str]) -> int:
    from lab.engine.__main__ import main as engine_main  # loads torch: only when asked for

    return engine_main(argv) or 0


COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {
    "run": ("boot a ladder's arms one by one and store every figure and request", _run_args, cmd_run),
    "ls": ("list runs, or one run's arms and boots", _ls_args, cmd_ls),
    "calibrate": ("A/A runs of a ladder's control: each key metric's boot-to-boot noise, drift and minimum "
                  "detectable effect on this host, for KEEP", _calibrate_args, cmd_calibrate),
    "compare": ("two arms side by side: values, change, noise band, statistics, KEEP verdicts", _compare_args,
                cmd_compare),
    "report": ("write reports/<run>/ (index.html, index.md, PNG figures) for a run", _report_args, cmd_report),
    "export": ("write a run's tables as CSV, Parquet or JSON", _export_args, cmd_export),
    "schema": ("print the ladder JSON Schema (for editor completion)", _schema_args, cmd_schema),
    "sweep": ("run a ladder (or its controls) and file it under its series with a label, for `lab history`",
              _sweep_args, cmd_sweep),
    "history": ("a series' KEEP metrics across labels with steps and what it can detect; --check gates on the "
                "latest label", _history_args, cmd_history),
    "tune": ("search engine settings with Optuna, one stored boot per trial, then confirm the best few against "
             "warm controls by the KEEP rule", _tune_args, cmd_tune),
    "serve": ("serve the arm a run's KEEP rule kept (the best of several), exactly as it was measured (`--print`: "
              "show the command)",
              _serve_args, cmd_serve),
    "engine": ("the bundled engine: `lab engine serve [flags]`", _engine_args, cmd_engine),
}


class UsageError(Exception):
    """Wrong arguments; argparse-style exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lab", description="A benchmark-and-tuning laboratory for LLM serving "
                                                             "engines: one change per boot, bracketed by controls.")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_text, add_args, handler) in COMMANDS.items():
        # `lab engine --help` is the engine's help, so argparse must not claim -h there.
        command = sub.add_parser(name, help=help_text, description=help_text, add_help=name != "engine")
        add_args(command)
        command.set_defaults(handler=handler)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["engine"]:
        return _engine(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    _setup_logging(args.verbose)
    from lab.ladder.errors import LadderError
    from lab.runner.errors import Interrupted, RunError
    from lab.store.db import StoreError

    try:
        return args.handler(args)
    except LadderError as exc:
        for line in exc.lines():
            _error(line)
        return 2
    except UsageError as exc:
        parser.error(f"{args.command}: {exc}")
    except (RunError, StoreError, LookupError) as exc:
        if type(exc) in (IndexError, KeyError):
            raise  # a bug, not a lookup a user asked for: its traceback is what a report needs
        _error(str(exc))
        return 1
    except Interrupted as exc:
        _error(f"interrupted; finish it with `lab run --resume {exc.args[0]}`" if exc.args else "interrupted")
        return 130
    except KeyboardInterrupt:
        _error("interrupted")
        return 130
    return 1


@functools.cache
def _console(stdout: bool = False):  # -> rich.console.Console
    """One console per stream, so log lines and progress bars share it and do not garble each other."""
    from rich.console import Console

    return Console(stderr=not stdout)


def _error(message: str) -> None:
    from rich.markup import escape

    # soft_wrap: one line however long, so a script or a CI log gets the whole message on it.
    _console().print(f"[bold red]lab:[/] {escape(message)}", highlight=False, soft_wrap=True)


def _setup_logging(verbose: int) -> None:
    from rich.logging import RichHandler

    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(message)s", handlers=[RichHandler(console=_console(), show_path=False)])
    # One line per HTTP request drowns the run's own messages; show them only at -vv.
    logging.getLogger("httpx").setLevel(logging.DEBUG if verbose > 1 else logging.WARNING)
