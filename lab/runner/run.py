"""`lab run`: plan a ladder into the store, then boot its slots in order; `--resume` finishes a run.

The store is the source of truth for what is left: a run resumes from its stored ladder text,
re-derives the same plan, stops any engine a killed `lab run` left behind, and boots every slot
still pending, running only the instrument steps that slot has not stored yet.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import psutil
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from lab.analysis import traps, verdicts
from lab.analysis.keep import Decision, MetricStatus, Verdict
from lab.instruments import REGISTRY
from lab.ladder import borrowed, render, yaml_lines
from lab.ladder.ladder import Ladder
from lab.ladder.validate import load_ladder, parse_ladder
from lab.runner import boot as engine_boot
from lab.runner import fingerprint
from lab.runner.errors import Interrupted, RunError, stop_on_sigterm
from lab.runner.slot import RunContext, run_slot
from lab.store import reader, writer
from lab.store.db import Store, StoreError, shown
from lab.store.rows import ArmRecord, RunRecord, SlotRecord

log = logging.getLogger("lab.run")


@dataclass
class Outcome:
    run_id: int
    name: str
    boots: dict[str, int] = field(default_factory=dict)  # final status -> count, this invocation
    measured_done: int = 0  # boots of this invocation that finished and were measured (not warm-ups)
    failures: list[str] = field(default_factory=list)
    # Why the run stopped with boots left to do, when its time budget could not hold the next one.
    out_of_time: str | None = None


def create(store: Store, ladder_path: str | Path, name: str | None = None, runs_dir: str | Path = "runs") -> RunRecord:
    """Validate the ladder and store the run with its arms and planned slots."""
    ladder, text = load_ladder(ladder_path)
    return create_from_text(store, ladder, text, ladder_path, name, runs_dir)


def create_from_text(store: Store, ladder: Ladder, text: str, ladder_path: str | Path, name: str | None,
                     runs_dir: str | Path, stem: str | None = None) -> RunRecord:
    """Store a run of a ladder already validated from `text` (a calibration derives its own)."""
    plan = render.plan(ladder)
    # Read once, here: the run keeps the figures it was created with, whatever the file says later.
    figures = borrowed.load(borrowed.path_of(ladder.borrowed, ladder_path)) if ladder.borrowed else None
    taken = {r.name for r in reader.list_runs(store)}
    if name is not None and name in taken:
        raise RunError(f"a run named {name!r} exists; resume it with `lab run --resume {name}` or pick another --name")
    chosen = name is not None
    if name is None:
        stem = name = f"{stem or ladder.name}-{datetime.now():%Y%m%d-%H%M%S}"
        n = 1
        while name in taken:  # two runs of one ladder within a second
            n += 1
            name = f"{stem}-{n}"
    while True:
        try:
            run_id = writer.create_run(store, name=name, ladder_name=ladder.name,
                                       ladder_path=str(Path(ladder_path).resolve()), ladder_text=text,
                                       sha256=hashlib.sha256(text.encode()).hexdigest(), engine_kind=ladder.engine.kind,
                                       logs_dir=str((Path(runs_dir) / name).resolve()), plan=plan,
                                       borrowed=figures)
            return reader.find_run(store, str(run_id))
        except writer.NameTaken:  # another `lab run` stored a run of this name since it was looked up
            if chosen:
                raise RunError(f"a run named {name!r} exists; resume it with `lab run --resume {name}` or pick "
                               "another --name") from None
            n += 1
            name = f"{stem}-{n}"


# A boot may run this much longer than the longest of its kind so far (an arm can be the slow one).
BUDGET_MARGIN = 1.15


def execute(store: Store, run: RunRecord, console: Console, time_budget_s: float | None = None,
            db: str | None = None, ladder_text: str | None = None) -> Outcome:
    """Boot every pending slot of the run in order; marks the run done, interrupted on Ctrl-C/SIGTERM,
    or failed with the reason when an exception ends it. With `time_budget_s`, a boot starts only
    when the time left can hold it, judged by the longest boot of its kind (warm-up or measured)
    this run has finished (BUDGET_MARGIN more); otherwise the run stops there, interrupted and
    resumable, with `Outcome.out_of_time` saying why. A boot of a kind never finished starts.
    With `db` (the store as `lab run --db` named it), an inconclusive verdict a calibration would
    decide prints the commands that decide it. The first measured boot's traps
    (`lab.analysis.traps`) are printed and stored with the run, naming lines of `ladder_text` (the
    ladder as its author wrote it; default: the run's own)."""
    try:
        return _execute(store, run, console, time_budget_s, db, ladder_text or run.ladder_text)
    except RunError:
        raise  # refused before it started (another process owns it, another plan): nothing to mark
    except StoreError as exc:
        # The store refuses writes or stopped answering (a full disk, a read-only file, a server gone):
        # the run cannot even be marked. It stays as the store last had it, which `lab run --resume`
        # reads as a run whose process is gone.
        raise StoreError(f"{exc}; run {run.name} stays as it was, `lab run --resume {run.name}` continues it "
                         "once the store answers again") from None
    except Exception as exc:
        # A bug or an exhausted host, not a request to stop: say so in the store, never "running".
        reason = _one_line(exc)
        log.exception("run %s failed", run.name)
        writer.set_run_status(store, run.id, "failed", reason)
        raise RunError(f"run {run.name} failed: {reason}; `lab run --resume {run.name}` retries what is "
                       "left") from exc


def _execute(store: Store, run: RunRecord, console: Console, time_budget_s: float | None,
             db: str | None, ladder_text: str) -> Outcome:
    began = time.monotonic()
    ladder = parse_ladder(run.ladder_text, f"{run.name} (stored ladder)")
    plan = render.plan(ladder)
    slots = reader.slots(store, run.id)
    _check_plan(run, plan, slots, reader.arms(store, run.id))
    _claim(store, run)
    _stop_left_behind(store, run, max(arm.recipe.stop_grace_s for arm in plan.arms))
    rc = RunContext(store=store, run_id=run.id, run_name=run.name, logs_dir=Path(run.logs_dir), ladder=ladder,
                    plan=plan, fingerprint=fingerprint.collect(),
                    instruments={name: REGISTRY[name]() for name, _ in ladder.instruments.sections()})
    pending = [s for s in slots if s.status == "pending"]
    first_measured = min((s.idx for s in slots if s.role != "warmup"), default=None)
    outcome = Outcome(run.id, run.name)
    writer.set_run_status(store, run.id, "running")
    columns = (SpinnerColumn(), TextColumn("[bold]{task.fields[boot]}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn(), TextColumn("{task.description}"))
    with stop_on_sigterm(), Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("", total=len(pending), boot="boots")
        rc.status = lambda text: progress.update(task, description=text)
        try:
            for slot in pending:
                if time_budget_s is not None:
                    outcome.out_of_time = _out_of_time(store, run, slot, time_budget_s - (time.monotonic() - began))
                    if outcome.out_of_time:
                        break
                status = run_slot(rc, slot)
                outcome.boots[status] = outcome.boots.get(status, 0) + 1
                outcome.measured_done += status == "done" and slot.role != "warmup"
                label = f"{slot.idx:02d} {slot.arm}" + (f" ({slot.position})" if slot.role != "arm" else "")
                if status != "done":
                    outcome.failures.append(f"{label}: {status}")
                progress.console.print(f"{'✓' if status == 'done' else '✗'} {label}: {status}")
                if status != "done" and slot.idx == slots[0].idx:
                    refusal = _too_long(store, run, ladder, slot, ladder_text)
                    if refusal:  # every later boot would fail the same way: spend none of them
                        writer.set_run_status(store, run.id, "failed", refusal)
                        raise RunError(f"run {run.name} stopped after its first boot: {refusal}")
                if status == "done" and slot.idx == first_measured:
                    for text in first_boot_warnings(store, run.id, slot.idx, ladder_text):
                        progress.console.print(f"[yellow]warning[/]: {escape(text)}", highlight=False)
                if slot.position == "close" and slot.window and ladder.compare_only:
                    progress.console.print(f"  window {slot.window}: compared, not judged (compare_only)")
                elif slot.position == "close" and slot.window:
                    # The window is complete: judge its arms now, so the store holds verdicts even if
                    # a later window is interrupted.
                    for arm, verdict in store_verdicts(store, run.id, slot.window).items():
                        progress.console.print(f"  KEEP {arm}: [bold]{verdict.decision}[/] "
                                               f"({escape(verdict.reasons[0])})")
                        hint = how_to_decide(run, verdict, db) if db is not None else None
                        if hint:
                            progress.console.print(f"    {escape(hint)}", highlight=False)
                progress.advance(task)
        except (Interrupted, KeyboardInterrupt):
            writer.set_run_status(store, run.id, "interrupted")
            raise Interrupted(run.name) from None
        except Exception:
            raise  # execute() records it as the run's failure
        except BaseException:
            writer.set_run_status(store, run.id, "interrupted")
            raise
        if outcome.out_of_time:
            progress.update(task, description="stopped: out of time")
            writer.set_run_status(store, run.id, "interrupted", outcome.out_of_time)
            return outcome
        progress.update(task, description="finished")
    writer.set_run_status(store, run.id, "done")
    return outcome


# What an inconclusive verdict's hint suggests, `lab calibrate`'s default: five A/A effects, so a
# one-boot interval's t factor is 2.6 (it is 4.3 with the two of 4 boots).
SUGGESTED_CALIBRATION_BOOTS = 7


def how_to_decide(run: RunRecord, verdict: Verdict, db: str) -> str | None:
    """The commands that would decide an inconclusive verdict held back by a key metric with no noise
    model (its controls drifted, or one warm control): a calibration, then the report judges again;
    None for any other verdict."""
    held = [row for row in verdict.metrics
            if row.status in (MetricStatus.DRIFT, MetricStatus.UNDECIDED) and row.interval is None]
    if verdict.decision is not Decision.INCONCLUSIVE or not held:
        return None
    k = SUGGESTED_CALIBRATION_BOOTS
    db = shown(db)  # a password never reaches the console, a log or cron mail
    hint = (f"to decide it: `lab calibrate {run.ladder_path} --boots {k} --db {db}` then "
            f"`lab report {run.name} --db {db}`, or `lab run {run.ladder_path} --calibrate {k}` next time")
    # keep.judge says "opening control C0ctl/open booted cold: excluded from the verdict".
    if any(len(row.control_values) == 1 for row in held) and any(
            "control" in reason and "booted cold" in reason for reason in verdict.reasons):
        hint += "; a warm-up boot (`hygiene.warmup_boot: true`) keeps the first control from booting cold"
    return hint


def _too_long(store: Store, run: RunRecord, ladder: Ladder, slot: SlotRecord, ladder_text: str) -> str | None:
    """Why every boot of the run will fail, when its first boot found the ladder's largest request
    longer than the engine's context (`lab.analysis.traps.too_long`)."""
    located, _ = yaml_lines.load(ladder_text)
    boots = next(s for s in reader.slots(store, run.id) if s.idx == slot.idx).boots
    if located is None or not boots:
        return None
    return traps.too_long(ladder, located, boots[-1].capabilities, f"{slot.arm} ({slot.position})")


def first_boot_warnings(store: Store, run_id: int, slot_idx: int, ladder_text: str) -> list[str]:
    """The traps the run's first measured boot shows (`lab.analysis.traps`), stored with the run."""
    located, _ = yaml_lines.load(ladder_text)
    if located is None:
        return []
    evidence = verdicts.load(store, run_id)
    found = traps.first_boot(evidence, next(s for s in evidence.slots if s.idx == slot_idx), located)
    if found:
        writer.add_run_warnings(store, run_id, found)
    return found


def _out_of_time(store: Store, run: RunRecord, slot: SlotRecord, left_s: float) -> str | None:
    """Why `slot` must not start with `left_s` seconds of the budget left, or None when it may."""
    longest = reader.longest_boot_s(store, run.id, warmup=slot.role == "warmup")
    if longest is None or longest * BUDGET_MARGIN <= left_s:
        return None
    kind = "warm-up" if slot.role == "warmup" else "measured"
    return (f"{max(left_s, 0):.0f} s of the time budget left, and this run's longest {kind} boot took "
            f"{longest:.0f} s: stopped before slot {slot.idx} ({slot.arm})")


def store_verdicts(store: Store, run_id: int, window: str) -> dict[str, Verdict]:
    """Judge the arms of a window that just closed and store their verdicts, each replacing any
    earlier one of its arm: the run's record of what it decided. Only `lab run` writes verdicts;
    every reader judges again in memory (`lab.analysis.verdicts`)."""
    evidence = verdicts.load(store, run_id)
    judged = verdicts.judge(evidence, window)
    for arm, verdict in judged.items():
        writer.write_verdict(store, run_id=run_id, arm=arm, decision=str(verdict.decision), reasons=verdict.reasons,
                             detail=verdicts.detail(evidence, arm, verdict))
    return judged


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}"[:300] if text else type(exc).__name__


def resume(store: Store, ref: str) -> RunRecord:
    run = reader.find_run(store, ref)
    if run.status == "done" and all(s.status != "pending" for s in reader.slots(store, run.id)):
        raise RunError(f"run {run.name} is already complete; `lab ls {run.name}` shows it")
    return run


def _check_plan(run: RunRecord, plan: render.Plan, slots: list[SlotRecord], arms: list[ArmRecord]) -> None:
    """A resumed run must plan exactly what was stored, or its cells would not line up."""
    stored = [(s.idx, s.arm, s.role, s.position, s.window) for s in slots]
    planned = [(s.idx, s.arm, s.role, s.position, s.window) for s in plan.slots]
    hashes = {a.name: a.config_hash for a in arms}
    if stored != planned or hashes != {a.name: a.config_hash for a in plan.arms}:
        raise RunError(f"run {run.name} was planned differently by an earlier lab version; start a new run instead")


def _claim(store: Store, run: RunRecord) -> None:
    """Refuse a run another live `lab run` is working on; otherwise take it over."""
    if run.owner_pid is not None and run.owner_pid != os.getpid():
        try:
            owner = psutil.Process(run.owner_pid)
            if run.owner_started is not None and abs(owner.create_time() - run.owner_started) < 0.01:
                raise RunError(f"run {run.name} is still running in process {run.owner_pid}; "
                               "let it finish, or stop it before resuming")
        except psutil.Error:
            pass  # that process is gone: the run is ours to finish
    me = psutil.Process()
    writer.claim_run(store, run.id, me.pid, me.create_time())


def _stop_left_behind(store: Store, run: RunRecord, grace_s: float) -> None:
    """Engines of a `lab run` that was killed outright: stop their process groups, mark them interrupted."""
    for boot in reader.live_boots(store, run.id):
        stopped = boot.pid is not None and engine_boot.stop_orphan(boot.pid, boot.pid_started, grace_s)
        if stopped:
            log.info("stopped engine pid %d left running by an interrupted run", boot.pid)
        tail = engine_boot.log_tail(Path(boot.log_path)) if boot.log_path else None
        writer.update_boot(store, boot.id, status="interrupted", reason="lab run was killed during this boot",
                           log_tail=tail)
