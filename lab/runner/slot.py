"""One planned boot of a run, start to finish: hygiene gate, boot, check, measure, stop, record.

Every way a boot can end is stored as an outcome: `done`; `failed` (memory gate not met, engine
exited or never answered before the ready timeout, its port taken by another process); `refused`
(it booted a config other than the arm's); `died` (the engine exited while instruments ran);
`hung` (a step's requests went unanswered for the ladder's `request_timeout_s`, and so did a
1-token completion after it: the engine is stopped). A boot whose port another process took is
booted again on another port, as the slot's next attempt. Only an interrupted `lab run` leaves a
slot pending, for `lab run --resume` to boot again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from lab.instruments import capabilities
from lab.instruments.base import BootContext, Instrument
from lab.instruments.receipt import Receipt
from lab.ladder.engines import Launch, Recipe, kind_of
from lab.ladder.ladder import Ladder
from lab.ladder.render import Plan, prompt_seed
from lab.runner import boot as engine_boot
from lab.runner.engine_control import ProcessControl
from lab.runner.fingerprint import engine_version
from lab.runner.hygiene import MemoryGate, wait_for_memory
from lab.runner.mem_sampler import MemSampler
from lab.runner.neighbour import beside
from lab.store import reader, writer
from lab.store.db import Store
from lab.store.records import Cell, StepResult
from lab.store.rows import SlotRecord
from lab.store.stored_rows import StoredRows

log = logging.getLogger("lab.run")
# How long an engine gets to show its exit after a step whose requests failed (see alive_after).
DEATH_GRACE_S = 2.0
# The capability probe's large request when no instrument declares a longer one.
MIN_PROBE_PROMPT = 64
# Boots of one slot whose port another process took before the engine listened on it.
PORT_ATTEMPTS = 3


@dataclass
class RunContext:
    store: Store
    run_id: int
    run_name: str
    logs_dir: Path
    ladder: Ladder
    plan: Plan
    fingerprint: dict[str, Any]
    instruments: dict[str, Instrument]
    status: Callable[[str], None] = field(default=lambda text: None)
    # An engine already answered on this host before this run's first boot (a tune's warm-up or
    # earlier trial, each a run of its own): its first boot is then not taken as cold by default.
    engine_warmed: bool = False


def log_path(rc: RunContext, slot: SlotRecord, attempt: int) -> Path:
    suffix = f"-{slot.position}" if slot.role != "arm" else ""
    again = f"-a{attempt}" if attempt > 1 else ""
    return rc.logs_dir / "boots" / f"{slot.idx:02d}-{slot.arm}{suffix}{again}.log"


def run_slot(rc: RunContext, slot: SlotRecord) -> str:
    """Boot and measure one slot; returns the boot's final status. A measured boot of a ladder with
    `hygiene.neighbour` has that process beside it from before its engine starts until it ends, and
    stores it in its fingerprint."""
    neighbour = rc.ladder.hygiene.neighbour
    if neighbour is None or slot.role == "warmup":
        return _boot_slot(rc, slot)
    path = log_path(rc, slot, len(slot.boots) + 1)
    with beside(neighbour, path.with_name(f"{path.stem}-neighbour.log")) as record:
        return _boot_slot(replace(rc, fingerprint={**rc.fingerprint, "neighbour": record}), slot)


def _boot_slot(rc: RunContext, slot: SlotRecord) -> str:
    label = f"{slot.window or 'warm-up'} {slot.arm}" + (f" ({slot.position})" if slot.role == "control" else "")
    hygiene = rc.ladder.hygiene
    rc.status(f"{label}: checking host memory")
    gate = wait_for_memory(hygiene.min_mem_available_gib, hygiene.mem_wait_s,
                           on_wait=lambda avail, waited: rc.status(
                               f"{label}: waiting for MemAvailable ≥ {hygiene.min_mem_available_gib:g} GiB "
                               f"({avail / 2**30:.1f} GiB, {waited:.0f} s)"))
    attempts = 1
    status, port_taken = _boot(rc, slot, label, gate)
    while port_taken is not None and attempts < PORT_ATTEMPTS:
        log.warning("%s: %s; booting it again on another port", label, port_taken)
        attempts += 1
        status, port_taken = _boot(rc, slot, label, gate)
    return status


def _boot(rc: RunContext, slot: SlotRecord, label: str, gate: MemoryGate) -> tuple[str, str | None]:
    """One boot of the slot: its final status, and why its port was not its own when it failed so."""
    engine = _engine(rc, slot)
    arm = rc.plan.arm(slot.arm)
    try:
        port: int | None = engine_boot.free_port(rc.ladder.hygiene.ports)
    except engine_boot.PortsBusy as exc:  # the boot is stored failed, its argv with the port unfilled
        port, gate = None, dataclasses.replace(gate, ok=False, reason=str(exc))
    spec = kind_of(_engine(rc, slot)).launch(arm, "{port}" if port is None else port)
    env, removed = engine_boot.child_env(spec.env)
    boot_id, attempt = writer.start_boot(
        rc.store, run_id=rc.run_id, slot_id=slot.id, port=port, argv=spec.argv, env=spec.env, env_removed=removed,
        api_base=spec.api_base, expected_config_hash=spec.expected_config_hash, mem_available_start=gate.mem_available,
        fingerprint=rc.fingerprint)
    if not gate.ok:
        return _fail(rc, slot, boot_id, "failed", gate.reason, None), None

    path = log_path(rc, slot, attempt)
    proc = engine_boot.EngineProcess(spec.argv, env, path)
    sampler = MemSampler().start()
    at_ready: dict[str, Any] | None = None  # /v1/stats at ready, once the boot passed its check
    rc.status(f"{label}: starting")
    try:
        try:
            proc.start()
        except OSError as exc:  # the engine's executable is missing or not runnable
            return _fail(rc, slot, boot_id, "failed", f"cannot start {spec.argv[0]}: {exc.strerror or exc}", None,
                         sampler), None
        writer.update_boot(rc.store, boot_id, pid=proc.pid, pid_started=proc.create_time(), log_path=str(path))
        ready = proc.wait_ready(spec.api_base, spec.model, spec.api_key, engine.ready_timeout_s,
                                on_poll=lambda t, last: rc.status(f"{label}: waiting for a completion ({t:.0f} s)"))
        # Whatever answered, or made the engine exit, may be another process on the engine's port.
        taken = engine_boot.port_taken(port, proc)
        if taken:
            return _fail(rc, slot, boot_id, "failed", taken, proc, sampler), taken
        if not ready.ok:
            return _fail(rc, slot, boot_id, "failed", ready.reason, proc, sampler), None
        refusal, stats, cold = _check(rc, slot, proc, spec)
        writer.update_boot(rc.store, boot_id, ready_at=writer.now(), ready_s=ready.seconds, cold=cold,
                           reason=_cold_reason((stats or {}).get("caches_built")) if cold else None,
                           booted_config_hash=stats.get("config_hash") if stats else None, engine_stats=stats,
                           status="ready")
        if refusal:
            return _fail(rc, slot, boot_id, "refused", refusal, proc, sampler), None
        rc.status(f"{label}: probing what the engine can do")
        caps = _probe(rc, spec, boot_id, slot)
        fields: dict[str, Any] = {"capabilities": caps}
        if not kind_of(engine).is_the_labs:  # the bundled engine's version is the lab's own
            fields["fingerprint"] = {**rc.fingerprint, "engine": engine_version(spec.argv, spec.base_url)}
        writer.update_boot(rc.store, boot_id, **fields)
        if not caps.get("answered"):
            large = caps.get("largest_prompt", {}).get("tokens")
            which = ("hygiene.probe_prompt_tokens" if caps.get("largest_prompt", {}).get("capped_from")
                     else "the ladder's largest")
            return _fail(rc, slot, boot_id, "failed", f"not ready: a {large}-token prompt ({which}) "
                         f"was not answered: {caps.get('error')}", proc, sampler), None
        at_ready = stats
        log.info("%s ready in %.1f s%s", label, ready.seconds, " (cold)" if cold else "")
        if slot.role != "warmup":
            ended = _measure(rc, slot, boot_id, attempt, spec, proc, sampler, label, caps)
            if ended:
                return _fail(rc, slot, boot_id, *ended, proc, sampler), None
        rc.status(f"{label}: stopping")
        _recheck_cold(rc, slot, proc, spec, boot_id, at_ready, label)
        stopped = proc.stop(engine.stop_grace_s)
        sampler.stop()
        writer.update_boot(rc.store, boot_id, status="done", stopped_at=writer.now(), exit_status=stopped.exit_status,
                           stopped_by=stopped.stopped_by, mem_available_floor=sampler.floor_bytes())
        writer.set_slot_status(rc.store, slot.id, "done")
        return "done", None
    except BaseException as exc:
        if at_ready is not None:
            # The cells this boot stored count after `lab run --resume`, so record whether they are cold.
            try:
                _recheck_cold(rc, slot, proc, spec, boot_id, at_ready, label, timeout_s=5.0)
            except Exception as recheck_error:
                log.warning("%s: could not recheck whether the boot built a cache: %s", label, recheck_error)
        stopped = proc.stop(engine.stop_grace_s) if proc.proc is not None else None
        sampler.stop()
        writer.update_boot(rc.store, boot_id, status="interrupted", reason=f"lab run stopped: {type(exc).__name__}",
                           stopped_at=writer.now(), exit_status=stopped and stopped.exit_status,
                           stopped_by=stopped and stopped.stopped_by, log_tail=proc.log_tail(),
                           mem_available_floor=sampler.floor_bytes())
        raise


def _engine(rc: RunContext, slot: SlotRecord) -> Recipe:
    """The engine this slot boots: its arm's own (an engine arm), else the ladder's."""
    return rc.plan.arm(slot.arm).recipe


def _check(rc: RunContext, slot: SlotRecord, proc: engine_boot.EngineProcess,
           spec: Launch) -> tuple[str | None, dict[str, Any] | None, bool]:
    """(refusal reason or None, engine stats, cold) for a boot that just answered its first completion."""
    booted = kind_of(_engine(rc, slot)).check_booted(lambda url: proc.get_json(url, spec.api_key), spec,
                                                    rc.engine_warmed or reader.any_ready_boot(rc.store, rc.run_id))
    return booted.refusal, booted.stats, booted.cold


def _probe(rc: RunContext, spec: Launch, boot_id: int, slot: SlotRecord) -> dict[str, Any]:
    """The capability probe's findings for this boot, with the ladder's largest prompt."""
    largest = MIN_PROBE_PROMPT
    for name, params in rc.ladder.instruments.sections():
        declare = getattr(rc.instruments[name], "prompt_tokens", None)
        if declare is not None:
            largest = max(largest, *declare(params).values())
    cap = rc.ladder.hygiene.probe_prompt_tokens
    capped_from = largest if cap is not None and largest > cap else None
    if capped_from is not None:
        largest = cap
    endpoint = capabilities.Endpoint(spec.base_url, spec.api_base, spec.model, spec.api_key,
                                     request_timeout_s=_engine(rc, slot).request_timeout_s)
    salt = hashlib.sha256(f"{rc.run_name}/{slot.idx}/probe/{boot_id}".encode()).hexdigest()[:12]
    try:
        def asks(what: str) -> bool:
            return any(getattr(rc.instruments[name], what, lambda _: False)(params)
                       for name, params in rc.ladder.instruments.sections())

        caps = asyncio.run(capabilities.probe(endpoint, largest, salt, asks("sends_ignore_eos"),
                                              getattr(_engine(rc, slot), "tokenizer", None),
                                              # The bundled engine is known to batch overlapping requests.
                                              ask_overlap=asks("sends_overlapping")
                                              and not kind_of(_engine(rc, slot)).is_the_labs))
    except Exception as exc:  # the engine went away or answered nonsense: the boot is not ready
        caps = {"answered": False, "largest_prompt": {"tokens": largest}, "error": f"{type(exc).__name__}: {exc}"}
    if capped_from is not None:
        caps.setdefault("largest_prompt", {"tokens": largest})["capped_from"] = capped_from
    log.info("capabilities: %s", capabilities.summary(caps))
    return caps


def _recheck_cold(rc: RunContext, slot: SlotRecord, proc: engine_boot.EngineProcess, spec: Launch, boot_id: int,
                  at_ready: dict[str, Any] | None, label: str, timeout_s: float = 30.0) -> None:
    """Read a bundled engine's /v1/stats once more before it stops: Triton compiles a kernel at the
    first use of a new specialization, so a boot may build a cache while it is measured, and its
    figures are then cold. Stores what was built by now in the engine stats
    (`caches_built_before_stop`) and, when anything was built after ready, the cold flag and why."""
    if not kind_of(_engine(rc, slot)).reports_caches or at_ready is None:
        return
    status, now = proc.get_json(f"{spec.base_url}/v1/stats", timeout_s=timeout_s)
    built = now.get("caches_built") if status == 200 and isinstance(now, dict) else None
    if not isinstance(built, list):
        log.warning("%s: /v1/stats answered %s before stop; the boot's cold flag is the one read at ready",
                    label, status or "nothing")
        return
    fields: dict[str, Any] = {"engine_stats": {**at_ready, "caches_built_before_stop": built}}
    by_ready = at_ready.get("caches_built") or []
    # A cache only a request with the same prefix gains from (a KV file tier) makes no boot cold.
    after = [entry for entry in _built_since(by_ready, built) if entry.get("cold", True)]
    if after:
        fields.update(cold=True, reason=_cold_reason(by_ready, after))
        log.info("%s built %s after ready: cold", label, _describe(after))
    writer.update_boot(rc.store, boot_id, **fields)


def _cold_reason(by_ready: list[dict[str, Any]] | None, after: list[dict[str, Any]] | None = None) -> str:
    """Why a boot is cold, for `lab ls`: the caches a bundled engine built by ready and after it
    (`caches_built` lists of /v1/stats); with neither, the first-boot rule of command engines."""
    parts = ([f"{_describe(by_ready)} by ready"] if by_ready else []) + \
        ([f"{_describe(after)} after ready"] if after else [])
    return "cold: built " + "; ".join(parts) if parts else "cold: first boot of the run (its JIT caches start empty)"


def _built_since(before: list[dict[str, Any]], now: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The part of `now` that `before` did not have yet (both /v1/stats `caches_built` lists)."""
    earlier = {entry["cache"]: entry for entry in before}
    since = []
    for entry in now:
        old = earlier.get(entry["cache"])
        if old is None:
            since.append(entry)
        elif entry.get("entries_added", 0) > old.get("entries_added", 0):
            since.append({**entry, "entries_added": entry["entries_added"] - old["entries_added"]})
    return since


def _describe(built: list[dict[str, Any]]) -> str:
    """E.g. `the weights cache, 14 entries of the triton cache`."""
    words = []
    for entry in built:
        added = entry.get("entries_added")
        what = f"the {entry['cache']} cache"
        words.append(what if added is None else f"{added} {'entry' if added == 1 else 'entries'} of {what}")
    return ", ".join(words)


def _measure(rc: RunContext, slot: SlotRecord, boot_id: int, attempt: int, spec: Launch,
             proc: engine_boot.EngineProcess, sampler: MemSampler, label: str,
             caps: dict[str, Any]) -> tuple[str, str] | None:
    """Run every instrument step not yet stored for this slot; (`died` or `hung`, why) if the engine
    died or stopped answering. An instrument that cannot measure this engine (capabilities.refusal)
    sends nothing: its steps are stored with the reason, and every cell it would have written is
    stored invalid with it."""
    done = reader.stored_steps(rc.store, slot.id)
    controls = reader.warm_control_boots(rc.store, rc.run_id, slot.window or "", slot.idx)
    shared_seed = prompt_seed(rc.ladder, rc.plan, slot.idx)
    seed = shared_seed or f"{slot.idx}/{attempt}/{boot_id}"
    salt = hashlib.sha256(f"{rc.run_name}/{seed}".encode()).hexdigest()[:12]
    engine = _engine(rc, slot)
    control = ProcessControl(rc.store, boot_id, proc, spec, engine.ready_timeout_s, engine.stop_grace_s,
                             kind_of(engine).offline_argv(rc.plan.arm(slot.arm)),
                             status=lambda text: rc.status(f"{label}: {text}"))
    for name, params in rc.ladder.instruments.sections():
        instrument = rc.instruments[name]
        ctx = BootContext(base_url=spec.base_url, api_base=spec.api_base, model=spec.model, api_key=spec.api_key,
                          run_id=rc.run_id, run_name=rc.run_name, slot_id=slot.id, boot_id=boot_id,
                          arm=slot.arm, window=slot.window, role=slot.role,  # type: ignore[arg-type]
                          position=slot.position, salt=salt,  # type: ignore[arg-type]
                          engine_kind=_engine(rc, slot).kind, params=params, stored=StoredRows(rc.store),
                          control_boot_ids=[b for b in controls if b != boot_id], mem=sampler,
                          log=logging.getLogger(f"lab.instruments.{name}"), capabilities=caps, engine=control,
                          request_timeout_s=engine.request_timeout_s,
                          prompts_of=controls[-1] if shared_seed and slot.role == "arm" and controls else None)
        refused = capabilities.refusal(name, caps)
        for n, step in enumerate(instrument.plan(params)):
            if (name, step.key) in done:
                continue
            if refused:
                why = f"refused at the capability probe: {refused}"
                writer.write_step(rc.store, slot_id=slot.id, boot_id=boot_id, instrument=name, step=step,
                                  result=_refused_cells(instrument, params, why) if n == 0 else None, error=why,
                                  started_at=writer.now())
                continue
            rc.status(f"{label}: {name} {step.key}")
            started = writer.now()
            try:
                result, error = asyncio.run(instrument.run_step(ctx, step)), None
            except Exception as exc:  # an instrument's failure is recorded on its step; the boot goes on
                result, error = None, f"{type(exc).__name__}: {exc}"
            # A failed request may be the engine going away: then give its exit a moment to show.
            failed = error is not None or (result is not None and any(_may_be_gone(r) for r in result.receipts))
            alive = proc.alive_after(DEATH_GRACE_S) if failed else proc.alive()
            ended = None if alive else ("died", f"engine {engine_boot.describe_exit(proc.exit_status())} during "
                                                f"{name} {step.key}")
            if failed and alive:
                # Requests that got no answer may be an engine that hangs: one that cannot answer a
                # 1-token completion either would make every later step wait out its timeouts too.
                silent = proc.silent(spec.api_base, spec.model, spec.api_key, engine.request_timeout_s)
                if silent:
                    ended = ("hung", f"engine stopped answering during {name} {step.key}: {silent}")
            if error and ended:
                return ended  # the step failed because the engine went away: not the instrument's result
            if error:
                log.warning("%s: %s %s failed: %s", label, name, step.key, error)
            writer.write_step(rc.store, slot_id=slot.id, boot_id=boot_id, instrument=name, step=step, result=result,
                              error=error, started_at=started)
            if ended:
                return ended
    return None


def _refused_cells(instrument: Instrument, params: Any, why: str) -> StepResult:
    """An invalid cell with the reason for every cell the instrument would have stored per boot,
    so a verdict or `lab ls` that looks for them finds why they have no value."""
    declare = getattr(instrument, "cell_params", None)
    by_metric = declare(params) if declare else {metric: [{}] for metric in instrument.metrics(params)}
    return StepResult(cells=[Cell(metric, None, "", cell_params, valid=False, note=why, requests=[])
                             for metric, many in by_metric.items() for cell_params in many])


def _may_be_gone(receipt: Receipt) -> bool:
    """Whether a failed request may mean the engine is going away. A 4xx is the engine answering a
    request it read and refused (a command engine's 404 on /v1/stats, a 400 for `ignore_eos`): it
    was there to answer, so it needs no grace to show an exit. No answer, a 5xx or a stream cut
    after its 200 all may."""
    return receipt.error is not None and not (receipt.status is not None and 400 <= receipt.status < 500)


def _fail(rc: RunContext, slot: SlotRecord, boot_id: int, status: str, reason: str | None,
          proc: engine_boot.EngineProcess | None, sampler: MemSampler | None = None) -> str:
    fields: dict[str, Any] = {}
    if proc is not None:
        stopped = proc.stop(_engine(rc, slot).stop_grace_s)
        fields = {"stopped_at": writer.now(), "exit_status": stopped.exit_status, "stopped_by": stopped.stopped_by,
                  "log_tail": proc.log_tail()}
    if sampler is not None:
        sampler.stop()
        fields["mem_available_floor"] = sampler.floor_bytes()
    writer.update_boot(rc.store, boot_id, status=status, reason=reason, **fields)
    writer.set_slot_status(rc.store, slot.id, "failed")
    log.warning("%s %s: %s", slot.arm, status, reason)
    return status
