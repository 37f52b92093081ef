"""Read a ladder and refuse it, with file and line, unless it can be run as written.

Rules beyond the schema: one change per arm (unless `multi: true`; an engine arm's one change is
its engine, and it sets no flags or env of the control's), no arm identical to its control, in a
window with an engine arm every engine able to size prompts (a command engine names `tokenizer:`),
names unique across the ladder, bundled-engine flags and LAB_ENGINE_* variables that exist with
values the engine accepts, environment values that reach the engine intact, command templates
with a `{port}` to fill, and KEEP metrics and gates that some listed instrument produces and
that mean something on the weights the ladder boots: an instrument that scores answers (qeval,
needle) stores only "not applicable" cells on random weights (the bundled engine's `dummy:<preset>`,
vLLM's and SGLang's `--load-format dummy`), so no KEEP rule may key on it there. Borrowed
figures (`borrowed:`) are never judged: no KEEP rule may name one.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Sequence

from pydantic import ValidationError

from lab.engine import settings as engine_settings
from lab.instruments import REGISTRY
from lab.ladder import borrowed, render
from lab.ladder import runnable
from lab.ladder.errors import LadderError, Problem
from lab.ladder.engines import env_value, kind_of
from lab.ladder.ladder import Ladder
from lab.ladder.yaml_lines import MAX_BYTES, Located, dotted, load

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def load_ladder(path: str | Path, host: runnable.Host | None = None) -> tuple[Ladder, str]:
    """The validated ladder and its exact text, checked as a ladder about to run on `host` (this
    one when not given: its memory); raises LadderError."""
    path = Path(path)
    label = str(path)
    try:
        size = path.stat().st_size
        if size > MAX_BYTES:  # refused before it is read: a ladder is never this large
            raise LadderError(label, [Problem(0, f"the file is {size:,} bytes; a ladder may be at most {MAX_BYTES:,}")])
        raw = path.read_bytes()
    except OSError as exc:
        raise LadderError(label, [Problem(0, f"cannot read it: {exc.strerror}")]) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise LadderError(label, [Problem(line, f"not UTF-8 text (byte 0x{raw[exc.start]:02x}); save the file as "
                                                "UTF-8")]) from None
    ladder, located = _parse(text, label)
    problems = runnable.problems(ladder, located, host or runnable.Host.this()) + _borrowed(ladder, located, path)
    if problems:
        raise LadderError(label, problems)
    return ladder, text


def _borrowed(ladder: Ladder, located: Located, path: Path) -> list[Problem]:
    """The borrowed file must be readable, and each of its figures one this ladder's instruments
    produce (else it would stand beside nothing)."""
    if ladder.borrowed is None:
        return []
    line = located.line(("borrowed",))
    try:
        rows = borrowed.load(borrowed.path_of(ladder.borrowed, path))
    except borrowed.BorrowedError as exc:
        return [Problem(line, str(exc))]
    produced = {f"{name}.{metric}" for name, params in ladder.instruments.sections()
                for metric in REGISTRY[name]().metrics(params)}
    return [Problem(line, f"borrowed: {Path(ladder.borrowed).name} row {n}: {row['metric']} is not a figure this "
                          "ladder's instruments produce; nothing of the run would stand beside it")
            for n, row in enumerate(rows, start=1) if row["metric"] not in produced]


def parse_ladder(text: str, label: str) -> Ladder:
    """The ladder in `text`, well formed and consistent; `load_ladder` also checks it can run here."""
    return _parse(text, label)[0]


def _parse(text: str, label: str) -> tuple[Ladder, Located]:
    located, problems = load(text)
    if located is None:
        raise LadderError(label, problems)
    if not isinstance(located.data, dict):
        raise LadderError(label, problems + [Problem(located.line([]) or 1,
                                                     "a ladder is a mapping with name, engine and windows")])
    try:
        ladder = Ladder.model_validate(located.data)
    except ValidationError as exc:
        raise LadderError(label, problems + _schema_problems(exc, located)) from None
    problems += _rules(ladder, located)
    if problems:
        raise LadderError(label, problems)
    return ladder, located


def _schema_problems(exc: ValidationError, located: Located) -> list[Problem]:
    """One problem per offending value; a union's per-member complaints are folded into one."""
    grouped: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for error in exc.errors():
        grouped.setdefault(_data_path(located.data, error["loc"]), []).append(error)
    problems = []
    for path, errors in grouped.items():
        first = errors[0]
        where = dotted(path)
        if first["type"] in ("union_tag_invalid", "union_tag_not_found"):
            tag = str(first["ctx"].get("discriminator", "")).strip("'")
            expected = str(first["ctx"].get("expected_tags", "")).replace("'", "")
            problems.append(Problem(located.line(path + (tag,)), f"{dotted(path + (tag,))} must be one of {expected}"))
            continue
        if first["type"] == "missing":
            field = first["loc"][-1]
            reason = f"{where + ': ' if where else ''}missing required field {field!r}"
            problems.append(Problem(located.line(path), reason))
            continue
        if first["type"] == "extra_forbidden":
            if path[:1] == ("instruments",) and len(path) == 2:
                reason = f"unknown instrument {path[1]!r} (registered: {', '.join(sorted(REGISTRY))})"
            else:
                reason = f"unknown key {path[-1]!r} in {dotted(path[:-1]) or 'the ladder'}"
            problems.append(Problem(located.line(path), reason))
            continue
        messages = list(dict.fromkeys(e["msg"] for e in errors))
        reason = messages[0] if len(messages) == 1 else f"no allowed type fits ({' / '.join(messages)})"
        problems.append(Problem(located.line(path), f"{where}: {reason}" if where else reason))
    return problems


def _data_path(data: Any, loc: Sequence[Any]) -> tuple[Any, ...]:
    """The part of a pydantic location that exists in the document.

    Union member names ("bundled", "str") are dropped; a missing key is kept when it is the last
    element, so the problem can name it.
    """
    path: list[Any] = []
    node = data
    for i, part in enumerate(loc):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        elif isinstance(node, dict) and i == len(loc) - 1:
            path.append(part)
            break
        else:
            continue
        path.append(part)
    return tuple(path)


def _rules(ladder: Ladder, located: Located) -> list[Problem]:
    problems = _names(ladder, located)
    kind = kind_of(ladder.engine)
    base_problems = _env(("engine", "env"), ladder.engine.env, located) + kind.recipe_problems(located)
    problems += base_problems
    # Every arm contains the base, so a broken base would be reported again for each arm.
    base = None if base_problems else _arm_config(ladder, None, ("engine",), located, problems)
    base_env = kind.process_env(render.merged(ladder, None)[1])
    for w, window in enumerate(ladder.windows):
        problems += _shared_prompts(ladder, w, located)
        for a, arm in enumerate(window.arms):
            where = ("windows", w, "arms", a)
            if arm.engine is not None:
                problems += _engine_arm(ladder, arm, where, located)
                continue
            problems += _one_change(arm, where, located)
            arm_problems = _env(where + ("env",), arm.env, located) + kind.flag_problems(where, arm.flags, arm.env,
                                                                                          located)
            problems += arm_problems
            if base is None or arm_problems:
                continue
            cfg = _arm_config(ladder, arm, where, located, problems)
            # Variables outside the engine's knobs (PYTORCH_CUDA_ALLOC_CONF) change the process, not its
            # config; a LAB_ENGINE_* variable is in the config already, so it counts only there.
            same_env = kind.process_env(render.merged(ladder, arm)[1]) == base_env
            if cfg == base and same_env and (arm.flags or arm.env):
                hint = " (flags override LAB_ENGINE_* variables)" if arm.env and kind.is_the_labs else ""
                problems.append(Problem(located.line(where), f"arm {arm.name} boots the same config as its control; "
                                                             f"it changes nothing{hint}"))
    problems += _keep(ladder, located)
    problems += _warmup(ladder, located)
    return problems




def _engine_arm(ladder: Ladder, arm: Any, where: tuple[Any, ...], located: Located) -> list[Problem]:
    """An arm that boots its own engine: that engine is its one change, so it sets nothing of the
    control's engine, and its engine is checked as the ladder's is."""
    problems = []
    for part in ("flags", "env"):
        if getattr(arm, part):
            problems.append(Problem(located.line(where + (part,)),
                                    f"arm {arm.name} boots its own engine: its {part} would be the control's "
                                    f"engine's; put them in its engine ({dotted(where + ('engine', part))})"))
    kind = kind_of(arm.engine)
    recipe_problems = _env(where + ("engine", "env"), arm.engine.env, located) + kind.recipe_problems(
        located, where + ("engine",))
    problems += recipe_problems
    if arm.engine == ladder.engine:
        problems.append(Problem(located.line(where + ("engine",)),
                                f"arm {arm.name} boots the control's own engine; it changes nothing"))
    elif not recipe_problems and not problems:
        _arm_config(ladder, arm, where, located, problems)
    return problems


def _shared_prompts(ladder: Ladder, w: int, located: Located) -> list[Problem]:
    """A window that compares engines sends each the same prompts, sized by each engine's count:
    every engine must be one whose prompts the lab can size (the bundled engine, or a command
    engine that names its `tokenizer`; whether it has a tokenizer route is known only once it has
    booted, and without one its prompts would be estimated from characters)."""
    window = ladder.windows[w]
    if not any(arm.engine is not None for arm in window.arms):
        return []
    engines = [(("engine",), ladder.engine, f"the control's engine ({window.control_name})")]
    engines += [(("windows", w, "arms", a, "engine"), arm.engine, f"arm {arm.name}'s engine")
                for a, arm in enumerate(window.arms) if arm.engine is not None]
    return [Problem(located.line(path), f"window {window.name} compares engines on the same prompts, and {who} "
                                        f"names no tokenizer to size them with; give it {dotted(path)}.tokenizer "
                                        "(smollm2-135m, a .gguf file or a tokenizer.json)")
            for path, recipe, who in engines if not kind_of(recipe).prompts_sized()]


def _names(ladder: Ladder, located: Located) -> list[Problem]:
    problems = []
    windows: dict[str, int] = {}
    boots: dict[str, int] = {}
    for w, window in enumerate(ladder.windows):
        line = located.line(("windows", w, "name"))
        if window.name in windows:
            problems.append(Problem(line, f"duplicate window name {window.name!r} "
                                          f"(also at line {windows[window.name]})"))
        windows.setdefault(window.name, line)
        control_line = located.line(("windows", w, "control")) if window.control else line
        named = [(window.control_name, control_line)]
        named += [(arm.name, located.line(("windows", w, "arms", a, "name"))) for a, arm in enumerate(window.arms)]
        for name, at in named:
            if name in boots:
                problems.append(Problem(at, f"duplicate arm name {name!r} (also at line {boots[name]}); "
                                            "arm and control names are unique across the ladder"))
            boots.setdefault(name, at)
    return problems


def _one_change(arm: Any, where: tuple[Any, ...], located: Located) -> list[Problem]:
    """An arm changes one thing: one flag or variable (its engine, for an engine arm: `_engine_arm`)."""
    changes = [f"flag {k}" for k in arm.flags] + [f"env {k}" for k in arm.env]
    if not changes:
        return [Problem(located.line(where), f"arm {arm.name} changes nothing; give it one flag or env change")]
    if len(changes) > 1 and not arm.multi:
        return [Problem(located.line(where), f"arm {arm.name} changes {len(changes)} things ({', '.join(changes)}); "
                                             "split it into one arm per change or mark it multi: true")]
    return []


def _env(where: tuple[Any, ...], env: dict[str, Any], located: Located) -> list[Problem]:
    problems = []
    for name, value in env.items():
        line = located.line(where + (name,))
        if not ENV_NAME.match(name):
            problems.append(Problem(line, f"env {name!r} is not a valid variable name"))
        text = env_value(value)
        if any(c in text for c in "\n\r\0"):
            problems.append(Problem(line, f"env {name}: the value holds a line break or NUL and would not reach "
                                          "the engine as written"))
    return problems




def _arm_config(ladder: Ladder, arm: Any, where: tuple[Any, ...], located: Located,
                problems: list[Problem]) -> dict[str, Any] | None:
    """The arm's full config, or None with the reason appended to problems (at the key it names)."""
    flags, env = render.merged(ladder, arm)
    try:
        return kind_of(render.recipe_of(ladder, arm)).config(flags, env)[0]
    except engine_settings.ConfigError as exc:
        if arm is not None and arm.engine is not None:
            sources = [(where + ("engine",), arm.engine)]
        else:
            sources = ([(where, arm)] if arm else []) + [(("engine",), ladder.engine)]
        line = _line_of_knob(str(exc), sources, located) or located.line(where)
        problems.append(Problem(line, f"{arm.name if arm else 'the base engine'}: {exc}"))
        return None



def _line_of_knob(message: str, sources: list[tuple[tuple[Any, ...], Any]], located: Located) -> int | None:
    """Line of the flag or variable that set the knob a config error names, the arm's first."""
    match = re.match(r"--([a-z0-9-]+)", message)
    knob = engine_settings.knob_from_flag(match.group(1)) if match else None
    for path, source in sources if knob else []:
        for key in source.flags:
            if engine_settings.knob_from_flag(key) == knob:
                return located.line(path + ("flags", key))
        for key in source.env:
            if engine_settings.knob_from_env(key) == knob:
                return located.line(path + ("env", key))
    return None



def _warmup(ladder: Ladder, located: Located) -> list[Problem]:
    warmup = ladder.hygiene.warmup_boot
    if isinstance(warmup, bool):
        return []
    names = {arm.name for window in ladder.windows for arm in window.arms}
    names |= {window.control_name for window in ladder.windows}
    return [Problem(located.line(("hygiene", "warmup_boot", i)),
                    f"warmup_boot: {name!r} is neither an arm nor a control of this ladder")
            for i, name in enumerate(warmup) if name not in names]


def _keep(ladder: Ladder, located: Located) -> list[Problem]:
    produced = {name: set(REGISTRY[name]().metrics(params)) for name, params in ladder.instruments.sections()}
    refs = [(("keep", "metrics", i), ref.metric) for i, ref in enumerate(ladder.keep.metric_refs())]
    refs += [(("keep", "gates", i, "metric"), gate.metric) for i, gate in enumerate(ladder.keep.gates)]
    random_weights = _random_weights(ladder)
    problems = []
    for where, metric in refs:
        line = located.line(where)
        instrument, _, name = metric.partition(".")
        if instrument == borrowed.SERIES or metric.startswith(borrowed.SERIES + ":"):
            problems.append(Problem(line, f"KEEP metric {metric!r}: borrowed figures are shown, never judged; key "
                                          "on a figure this ladder measures"))
        elif not name:
            problems.append(Problem(line, f"KEEP metric {metric!r}: write it as <instrument>.<metric>"))
        elif instrument not in produced:
            listed = "not in this ladder's instruments" if instrument in REGISTRY else "not a registered instrument"
            problems.append(Problem(line, f"KEEP metric {metric!r}: no instrument produces it "
                                          f"({instrument!r} is {listed})"))
        elif name not in produced[instrument]:
            problems.append(Problem(line, f"KEEP metric {metric!r}: no instrument produces it ({instrument} "
                                          f"produces {', '.join(sorted(produced[instrument]))})"))
        elif random_weights and _needs_real_weights(instrument):
            *others, last = sorted(n for n in REGISTRY if not _needs_real_weights(n))
            problems.append(Problem(line, f"{dotted(where[:3])}: {metric} means nothing on random weights "
                                          f"({random_weights}): their answers carry no knowledge to score; "
                                          f"key on {', '.join(others)} or {last} instead"))
    arms = {arm.name for window in ladder.windows for arm in window.arms}
    for i, gate in enumerate(ladder.keep.gates):
        for j, name in enumerate(gate.arms):
            if name not in arms:
                problems.append(Problem(located.line(("keep", "gates", i, "arms", j)),
                                        f"gate {gate.metric}: {name!r} is not an arm of this ladder"))
    return problems


def _needs_real_weights(instrument: str) -> bool:
    """Whether the instrument scores answers, which random weights cannot give."""
    return bool(getattr(REGISTRY[instrument], "needs_real_weights", False))


def _random_weights(ladder: Ladder) -> str | None:
    """What makes a boot of this ladder load random weights ("dummy:llama3-8b", "arm A1: --load-format
    dummy"), or None when every boot loads real ones."""
    for arm in [None] + [arm for window in ladder.windows for arm in window.arms]:
        found = kind_of(render.recipe_of(ladder, arm)).random_weights(render.merged(ladder, arm)[0])
        if found:
            return found if arm is None else f"arm {arm.name}: {found}"
    return None


