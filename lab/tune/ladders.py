"""The ladders a tune file renders into (a trial's, the warm-up's, the confirmation's), and the tune
file checked as those ladders will be, before anything boots.

Every boot of a study is a boot of an ordinary ladder: `ladder_text` writes it from the tune file's
engine, instruments and hygiene, with the tune's objectives as key metrics and its constraints as
gates. `problems` renders the base configuration that way and runs every check `lab run` makes of
a ladder (`lab.ladder.validate`, and `lab.ladder.runnable` on this host), then reports each problem
at the line of the tune file it comes from: the engine's flags and the instruments sit at the same
place in both, a key metric is an objective and a gate a constraint. So a typo in the base engine's
flags is refused once, as `tune.yaml:8: ...`, instead of being found by every trial in turn.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import yaml

from lab.ladder import runnable
from lab.ladder.errors import LadderError, Problem
from lab.ladder.validate import parse_ladder
from lab.ladder.yaml_lines import Located, load

if TYPE_CHECKING:  # spec checks a tune file with `problems`; these are only its types here
    from lab.tune.spec import Param, TuneFile

CONTROL = "C0base"


def changes(space: list[Param], params: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Optuna's params (`flag:NAME`, `env:NAME`) as ladder flags and env."""
    flags = {p.flag: params[p.name] for p in space if p.flag and p.name in params}
    env = {p.env: params[p.name] for p in space if p.env and p.name in params}
    return flags, env


def ladder_text(tune: TuneFile, data: dict[str, Any], control: str, flags: dict[str, Any], env: dict[str, Any],
                arms: list[dict[str, Any]] | None = None, repeats: int = 1, name: str | None = None,
                warmup: bool = False, gates: bool | None = None) -> str:
    """A ladder of the tune file's engine (its flags and env updated), instruments and rule; its
    constraints become gates where there are arms to judge (or `gates` says so)."""
    engine = dict(data["engine"])
    engine["flags"] = {**(engine.get("flags") or {}), **flags}
    engine["env"] = {**(engine.get("env") or {}), **env}
    keep = {"threshold_pct": tune.confirm.threshold_pct,
            "metrics": [{"metric": o.metric, "where": dict(o.where)} for o in tune.objectives],
            "gates": [g.model_dump(exclude_defaults=True) for g in tune.constraints]
            if (bool(arms) if gates is None else gates) else []}
    window: dict[str, Any] = {"name": "W", "control": control}
    if arms:
        window["arms"] = arms
    ladder = {"name": name or tune.name, "engine": engine, "windows": [window], "repeats": repeats,
              "instruments": data.get("instruments") or {}, "keep": keep,
              "hygiene": {**(data.get("hygiene") or {}), "warmup_boot": warmup}}
    return yaml.safe_dump(ladder, sort_keys=False)


def problems(tune: TuneFile, located: Located, host: runnable.Host | None) -> list[Problem]:
    """What `lab run` would refuse in the ladder of the tune's base configuration, at the tune file's
    lines; host checks (memory, files) only with a host."""
    text = ladder_text(tune, located.data, CONTROL, {}, {}, gates=True)
    rendered, _ = load(text)
    assert rendered is not None  # yaml.safe_dump wrote it
    try:
        ladder = parse_ladder(text, "base")
        found = runnable.problems(ladder, rendered, host)
    except LadderError as exc:
        found = exc.problems
    paths = _paths_by_line(rendered)
    moved = []
    for problem in found:
        path = paths.get(problem.line, ())
        if path[:1] == ("windows",):
            continue  # the window is the rendering's own (a control with no arms), not the tune file's
        tune_path, reason = _tune_path(path, problem.reason)
        moved.append(Problem(located.line(tune_path) if tune_path else 0, reason))
    return moved


def _paths_by_line(located: Located) -> dict[int, tuple[Any, ...]]:
    """The deepest path that starts on each line of a document."""
    found: dict[int, tuple[Any, ...]] = {}

    def note(line: int, path: tuple[Any, ...]) -> None:
        if len(path) >= len(found.get(line, ())):
            found[line] = path

    def walk(node: yaml.Node, path: tuple[Any, ...]) -> None:
        note(node.start_mark.line + 1, path)
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                note(key.start_mark.line + 1, path + (key.value,))
                walk(value, path + (key.value,))
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                walk(item, path + (i,))

    if located.root is not None:
        walk(located.root, ())
    return found


def _tune_path(path: tuple[Any, ...], reason: str) -> tuple[tuple[Any, ...], str]:
    """Where a rendered ladder's path comes from in the tune file, and the reason in its words."""
    if path[:2] == ("keep", "metrics") and len(path) > 2:
        i = path[2]
        return ("objectives", *path[2:]), reason.replace(f"keep.metrics[{i}]", f"objectives[{i}]") \
            .replace("KEEP metric", f"objectives[{i}]:")
    if path[:2] == ("keep", "gates") and len(path) > 2:
        i = path[2]
        return ("constraints", *path[2:]), reason.replace(f"keep.gates[{i}]", f"constraints[{i}]") \
            .replace("KEEP metric", f"constraints[{i}]:")
    if path[:1] in (("engine",), ("instruments",), ("hygiene",)):
        return path, reason
    return (), reason
