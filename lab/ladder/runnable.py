"""Checks that a ladder can be run here, made before anything boots.

`lab.ladder.validate` accepts a ladder that is well formed; these checks refuse one that would spend
its boots and then fail, or hurt the host: a KEEP metric whose `where` does not pick exactly one
cell per boot (checked against the cells each instrument declares, without running it), a request
longer than the engine's context or than the host can build in memory, a memory floor above what
the host has, a command engine's `tokenizer` that is not there or cannot be read, a neighbour whose
program is not there or whose CPUs this host does not have. They apply to a ladder about to run
(`lab run`, `--dry-run`), not to a stored ladder read back for a report: a store written on another
host must stay readable here.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psutil

from lab.instruments import REGISTRY
from lab.ladder import render
from lab.ladder.errors import Problem
from lab.ladder.engines import kind_of
from lab.ladder.ladder import Ladder
from lab.ladder.yaml_lines import Located, dotted

GIB = 1024**3
# What the lab holds per prompt token while it builds and sends a prompt: the filler words as
# Python strings, the joined text, the JSON body and the tokenizer's answer (measured ~60-90).
CLIENT_BYTES_PER_TOKEN = 100


@dataclass(frozen=True)
class Host:
    mem_total_bytes: int
    cpus: frozenset[int] | None = None  # the CPUs the lab may run on (its affinity); None: not checked

    @classmethod
    def this(cls) -> Host:
        return cls(int(psutil.virtual_memory().total), frozenset(psutil.Process().cpu_affinity() or ()))


def problems(ladder: Ladder, located: Located, host: Host | None) -> list[Problem]:
    """Everything that stops this ladder from running as written; host checks only with a host."""
    found = _where(ladder, located) + _contexts(ladder, located)
    if host is not None:
        found += _host_memory(ladder, located, host) + kind_of(ladder.engine).file_problems(located)
        found += [problem for w, window in enumerate(ladder.windows) for a, arm in enumerate(window.arms)
                  if arm.engine is not None
                  for problem in kind_of(arm.engine).file_problems(located, ("windows", w, "arms", a, "engine"))]
        found += _neighbour(ladder, located, host)
    return found



def _where(ladder: Ladder, located: Located) -> list[Problem]:
    """Each key metric and gate must select exactly one declared cell per boot."""
    params = dict(ladder.instruments.sections())
    refs: list[tuple[tuple[Any, ...], str, dict[str, Any]]] = [
        (("keep", "metrics", i), ref.metric, ref.where) for i, ref in enumerate(ladder.keep.metric_refs())]
    refs += [(("keep", "gates", i), gate.metric, gate.where) for i, gate in enumerate(ladder.keep.gates)]
    found = []
    for where_path, metric, where in refs:
        instrument, _, name = metric.partition(".")
        declare = getattr(REGISTRY.get(instrument), "cell_params", None)
        if instrument not in params or declare is None:
            continue  # an unknown metric is validate's to refuse; an undeclaring instrument is not checked
        cells = declare(REGISTRY[instrument](), params[instrument]).get(name)
        if cells is None:
            continue
        label = f"{dotted(where_path)}: {metric}"
        keys = sorted({key for cell in cells for key in cell})
        unknown = [key for key in where if key not in keys]
        if unknown:
            has = f"its cells have {', '.join(keys)}" if keys else "its cells have no params"
            found.append(Problem(located.line(where_path + ("where", unknown[0])),
                                 f"{label}: unknown where key {unknown[0]!r} ({has})"))
            continue
        matching = [cell for cell in cells if all(key in cell and cell[key] == value for key, value in where.items())]
        if len(matching) == 1:
            continue
        line = located.line(where_path + ("where",)) if where else located.line(where_path)
        if not matching:
            found.append(Problem(line, f"{label}: where {_shown(where)} matches no cell ({_choices(cells)})"))
        else:
            found.append(Problem(line, f"{label}: {'where ' + _shown(where) if where else 'no where'} matches "
                                       f"{len(matching)} cells per boot; pick one with where "
                                       f"({_choices(matching)})"))
    return found


def _shown(where: dict[str, Any]) -> str:
    return "{" + ", ".join(f"{key}: {value!r}" for key, value in where.items()) + "}"


def _choices(cells: Sequence[dict[str, Any]]) -> str:
    keys = sorted({key for cell in cells for key in cell})
    parts = []
    for key in keys:
        values = sorted({cell[key] for cell in cells if key in cell}, key=lambda v: (str(type(v)), v))
        parts.append(f"{key}: {', '.join(repr(v) if isinstance(v, str) else f'{v:g}' for v in values)}")
    return "; ".join(parts) if parts else "one cell, no params"


def _requests(ladder: Ladder) -> list[tuple[tuple[Any, ...], str, int]]:
    """(ladder path, field, tokens) of the longest request each instrument sends."""
    found = []
    for name, params in ladder.instruments.sections():
        declare = getattr(REGISTRY[name], "prompt_tokens", None)
        if declare is None:
            continue
        for field, tokens in declare(REGISTRY[name](), params).items():
            found.append((("instruments", name, field), f"instruments.{name}.{field}", tokens))
    return found


def _contexts(ladder: Ladder, located: Located) -> list[Problem]:
    """Requests longer than the context of a boot whose context is known before it boots (the
    bundled engine's): every such cell would be spent invalid."""
    boots = [(None, "the base engine")] + [(arm, f"arm {arm.name}") for window in ladder.windows
                                           for arm in window.arms]
    found: list[Problem] = []
    for path, field, tokens in _requests(ladder):
        for arm, who in boots:
            context = kind_of(render.recipe_of(ladder, arm)).context(*render.merged(ladder, arm))
            if context is not None and tokens > context:
                found.append(Problem(located.line(path), f"{field}: a request of {tokens:,} tokens does not fit "
                                                         f"the context of {context:,} that {who} boots with"))
                break
    return found




def _host_memory(ladder: Ladder, located: Located, host: Host) -> list[Problem]:
    found = []
    floor = ladder.hygiene.min_mem_available_gib
    if floor * GIB > host.mem_total_bytes:
        found.append(Problem(located.line(("hygiene", "min_mem_available_gib")),
                             f"hygiene.min_mem_available_gib: {floor:g} GiB is more than this host has "
                             f"({host.mem_total_bytes / GIB:.1f} GiB in all); no boot could start"))
    for path, field, tokens in _requests(ladder):
        need = tokens * CLIENT_BYTES_PER_TOKEN
        if need > host.mem_total_bytes / 2:
            found.append(Problem(located.line(path), f"{field}: a request of {tokens:,} tokens needs about "
                                                     f"{need / GIB:,.0f} GiB in the lab to build, more than half "
                                                     f"this host's {host.mem_total_bytes / GIB:.1f} GiB"))
    return found


def _neighbour(ladder: Ladder, located: Located, host: Host) -> list[Problem]:
    """A neighbour this host cannot start: its program is not there, or a CPU it is pinned to is not
    one the lab may run on (every measured boot would fail to start it)."""
    neighbour = ladder.hygiene.neighbour
    if neighbour is None:
        return []
    found = []
    program = neighbour.command[0]
    if shutil.which(program) is None:
        found.append(Problem(located.line(("hygiene", "neighbour", "command", 0)),
                             f"hygiene.neighbour.command: {program!r} is not a program on this host's PATH"))
    for i, cpu in enumerate(neighbour.cpus or []):
        if host.cpus is not None and cpu not in host.cpus:
            found.append(Problem(located.line(("hygiene", "neighbour", "cpus", i)),
                                 f"hygiene.neighbour.cpus: this host has no CPU {cpu} the lab may use "
                                 f"(it may use {_cpu_list(host.cpus)})"))
    return found


def _cpu_list(cpus: frozenset[int]) -> str:
    return ", ".join(str(cpu) for cpu in sorted(cpus)) or "none"
