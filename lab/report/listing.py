"""Tables for people: runs in a store, one run's arms and boots, a ladder's planned boots."""

from __future__ import annotations

import json

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from lab.instruments.capabilities import summary
from lab.ladder.ladder import Ladder
from lab.ladder.render import Plan
from lab.store import reader
from lab.store.db import Store
from lab.store.rows import CellHealth

STATUS_STYLE = {"done": "green", "running": "yellow", "ready": "yellow", "starting": "yellow", "pending": "dim"}
TAIL_LINES = 8


def _status(text: str) -> str:
    return f"[{STATUS_STYLE.get(text, 'red')}]{text}[/]"


def _change(change: dict) -> str:
    return ", ".join(f"{k}={json.dumps(v) if not isinstance(v, str) else v}"
                     for part in ("engine", "flags", "env") for k, v in change.get(part, {}).items()) or "-"


def print_runs(console: Console, store: Store) -> None:
    runs = reader.list_runs(store)
    if not runs:
        console.print("no runs in this store yet; start one with `lab run LADDER.yaml`")
        return
    table = Table("id", "name", "ladder", "engine", "started", "status", "slots", "boots ok", "boots failed")
    for r in runs:
        table.add_row(str(r.id), r.name, r.ladder, r.engine_kind, f"{r.created_at:%Y-%m-%d %H:%M}", _status(r.status),
                      str(r.slots), str(r.boots_ok), str(r.boots_failed))
    console.print(table)


def print_run(console: Console, store: Store, ref: str) -> None:
    run = reader.find_run(store, ref)
    console.print(f"[bold]{run.name}[/] (id {run.id}) · ladder {run.ladder_name} sha256 {run.ladder_sha256[:12]} · "
                  f"{run.engine_kind} engine · {_status(run.status)}"
                  + (f" ({escape(run.reason)})" if run.reason else "") + f" · logs {run.logs_dir}")
    for text in run.warnings or []:  # what its first measured boot showed about the ladder
        console.print(f"[yellow]warning[/]: {escape(text)}", highlight=False)
    arms = Table("arm", "window", "role", "change", "config hash", title="arms", title_justify="left")
    for arm in reader.arms(store, run.id):
        arms.add_row(arm.name, arm.window, arm.role, escape(_change(arm.change)), arm.config_hash)
    console.print(arms)
    verdicts = reader.stored_verdicts(store, run.id)
    if verdicts:
        console.print(_tally(verdicts), highlight=False)
    boots = Table("slot", "window", "arm", "role", "try", "status", "cold", "ready s", "exit", "stop", "cells",
                  "reason", title="boots", title_justify="left")
    health = reader.cell_health(store, run.id)
    failed, probed = [], []
    for slot in reader.slots(store, run.id):
        role = slot.role if slot.role != "control" else f"control/{slot.position}"
        if not slot.boots:
            boots.add_row(str(slot.idx), slot.window or "-", slot.arm, role, "-", _status("pending"), "", "", "",
                          "", "", "")
        for boot in slot.boots:
            probed.append((slot, boot))
            boots.add_row(str(slot.idx), slot.window or "-", slot.arm, role, str(boot.attempt),
                          _status(boot.status), "cold" if boot.cold else "",
                          f"{boot.ready_s:.1f}" if boot.ready_s is not None else "",
                          "" if boot.exit_status is None else str(boot.exit_status), boot.stopped_by or "",
                          _cells(health.get(boot.id)), escape(boot.reason or ""))
            if boot.status not in ("done", "starting", "ready") and boot.log_tail:
                failed.append((slot, boot))
    console.print(boots)
    _print_capabilities(console, probed)
    for slot, boot in failed:
        tail = "\n".join(boot.log_tail.rstrip().splitlines()[-TAIL_LINES:])
        console.print(f"[bold]{slot.idx:02d} {slot.arm}[/] try {boot.attempt}, {boot.log_path}:", highlight=False)
        console.print(escape(tail), style="dim", highlight=False)


def _tally(verdicts: dict) -> str:
    """`verdicts: 1 keep, 8 reject (2 regressed, 6 no effect), 1 inconclusive`, as `lab run` stored them
    (`lab report` and `lab compare` judge again with the newest calibration)."""
    decisions = [v.decision for v in verdicts.values()]
    why: dict[str, int] = {}
    for v in verdicts.values():
        if v.decision == "reject":
            detail = v.detail or {}
            kind = ("gate failed" if any(g and not g.get("passed") for g in detail.get("gates", {}).values())
                    else "regressed" if any(r.get("status") == "regressed" for r in detail.get("metrics", []))
                    else "no effect")
            why[kind] = why.get(kind, 0) + 1
    reasons = f" ({', '.join(f'{n} {kind}' for kind, n in why.items())})" if why else ""
    return (f"verdicts: {decisions.count('keep')} keep, {decisions.count('reject')} reject{reasons}, "
            f"{decisions.count('inconclusive')} inconclusive")


def _print_capabilities(console: Console, boots: list) -> None:
    """What the capability probe found, once per distinct finding with the boots that share it."""
    found: dict[str, list[str]] = {}
    for slot, boot in boots:
        line = summary(boot.capabilities) or "not probed (the boot never answered)"
        found.setdefault(line, []).append(f"{slot.idx:02d}" + (f"/{boot.attempt}" if boot.attempt > 1 else ""))
    if not boots:
        return
    console.print("[bold]capabilities[/] (probed at each boot's ready)")
    for line, which in found.items():
        console.print(f"  boots {', '.join(which)}: {escape(line)}", highlight=False)


def _cells(health: CellHealth | None) -> str:
    """`41 valid`, or `41 valid, 4 invalid (3: the response carried no usage)`: why a boot that is
    done still judges nothing."""
    if health is None:
        return ""
    if not health.invalid:
        return f"{health.valid} valid"
    why = f" ({health.top_count}: {escape(health.top_reason)})" if health.top_reason else ""
    return f"{health.valid} valid, [red]{health.invalid} invalid[/]{why}"


def print_plan(console: Console, plan: Plan, ladder: Ladder, commands: dict[str, str] | None = None) -> None:
    """The planned boots, what a window with no arms does; with `commands` (arm name -> its rendered
    command line), each arm's command."""
    table = Table("slot", "window", "arm", "role", "position", "change", "config hash")
    arms = {a.name: a for a in plan.arms}
    for slot in plan.slots:
        arm = arms[slot.arm]
        table.add_row(str(slot.idx), slot.window or "-", slot.arm, slot.role, slot.position,
                      escape(_change(arm.change)), arm.config_hash)
    console.print(table)
    rules = [f"keep.{part}" for part in ("metrics", "gates") if getattr(ladder.keep, part)]
    for window in ladder.windows:
        if window.arms:
            continue
        boots = sum(slot.window == window.name and slot.role == "control" for slot in plan.slots)
        line = (f"window {window.name} has no arms: {window.control_name} is measured "
                f"{'once' if boots == 1 else f'{boots} times'} and nothing is judged")
        if rules:
            line += f" ({' and '.join(rules)} are measured, not judged)"
        console.print(escape(line), highlight=False)
    for name, line in (commands or {}).items():
        console.print(f"[bold]{name}[/]: {escape(line)}", soft_wrap=True, highlight=False)
