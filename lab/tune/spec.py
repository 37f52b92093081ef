"""The tune file's shape (pydantic; `lab tune --schema` publishes it) and its validation with file:line.

A tune file is a ladder without windows: the engine, instruments and hygiene are a ladder's, and
instead of arms it has a search space, objectives (key metrics, with `where`), constraints (gates)
and budgets. Every trial and the confirmation are rendered into ordinary ladders, which
`lab.ladder.validate` checks again. `parse_tune` refuses what can be told from the file alone (a
stored one, read back on any host); `load_tune`, for a tune about to run, also checks its base
configuration as `lab run` checks a ladder (`lab.tune.ladders.problems`), at the file's lines.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import Field, ValidationError, model_validator

from lab.instruments import REGISTRY
from lab.ladder import runnable
from lab.ladder.engines import kind_of
from lab.ladder.errors import LadderError, Problem
from lab.ladder.ladder import Engine, Gate, Hygiene, Instruments, MetricRef, Name, Scalar, Strict
from lab.ladder.yaml_lines import MAX_BYTES, Located, dotted, load
from lab.tune import ladders


class IntRange(Strict):
    low: int
    high: int
    step: int = Field(1, ge=1)
    log: bool = False


class FloatRange(Strict):
    low: float = Field(allow_inf_nan=False)
    high: float = Field(allow_inf_nan=False)
    log: bool = False


class Param(Strict):
    """One knob: a flag or an environment variable, over an int or float range or a list of choices."""

    flag: str | None = None
    env: str | None = None
    int: IntRange | None = None
    float: FloatRange | None = None
    choices: list[Scalar] | None = Field(None, min_length=2)

    @model_validator(mode="after")
    def _one_each(self) -> "Param":
        if (self.flag is None) == (self.env is None):
            raise ValueError("a parameter names exactly one of flag or env")
        kinds = [k for k in ("int", "float", "choices") if getattr(self, k) is not None]
        if len(kinds) != 1:
            raise ValueError("a parameter has exactly one of int, float or choices")
        rng = self.int or self.float
        if rng is not None and (rng.low >= rng.high or (rng.log and rng.low <= 0)):
            raise ValueError("a range needs low < high (and low > 0 with log: true)")
        return self

    @property
    def name(self) -> str:
        return f"flag:{self.flag}" if self.flag else f"env:{self.env}"


class Objective(MetricRef):
    direction: Literal["maximize", "minimize"] | None = Field(
        None, description="default: from the instrument (higher is better: maximize)")


class Budget(Strict):
    trials: int = Field(20, ge=1, le=10_000, description="trials (boots) the study runs, over all its invocations")
    time_s: float | None = Field(None, gt=0, allow_inf_nan=False,
                                 description="no new trial once the trials so far took this long in all")


class Confirm(Strict):
    top: int = Field(3, ge=1, le=20, description="best trials (or Pareto-front trials) re-measured as arms")
    repeats: int = Field(1, ge=1, le=20, description="the confirmation ladder's repeats:")
    threshold_pct: float = Field(2.0, ge=0, allow_inf_nan=False, description="its KEEP threshold")


class TuneHygiene(Hygiene):
    warmup_boot: Optional[bool] = Field(  # type: ignore[assignment]
        None, description="boot the base configuration once, unmeasured, before a `lab tune`'s first trial (and "
                          "before the confirmation's first control), so the first trial does not pay for the "
                          "host's cold caches; default: on when the engine runs on CUDA")


class TuneFile(Strict):
    name: Name
    description: str = ""
    engine: Engine
    space: list[Param] = Field(min_length=1)
    objectives: list[Objective] = Field(min_length=1)
    constraints: list[Gate] = Field(default_factory=list, description="each trial must satisfy these (min/max)")
    instruments: Instruments = Field(default_factory=Instruments)  # type: ignore[valid-type]
    hygiene: TuneHygiene = Field(default_factory=TuneHygiene)
    budget: Budget = Field(default_factory=Budget)
    seed: int = 0
    confirm: Confirm = Field(default_factory=Confirm)


def json_schema() -> dict[str, Any]:
    schema = TuneFile.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "lab tune file"
    return schema


def load_tune(path: str | Path) -> tuple[TuneFile, str]:
    """The validated tune file and its text, its base configuration checked as `lab run` checks a
    ladder about to run on this host; raises LadderError (file:line: reason)."""
    label = str(path)
    try:
        raw = Path(path).read_bytes()[:MAX_BYTES + 1]
        text = raw.decode("utf-8")
    except OSError as exc:
        raise LadderError(label, [Problem(0, f"cannot read it: {exc.strerror}")]) from None
    except UnicodeDecodeError:
        raise LadderError(label, [Problem(0, "not UTF-8 text; save the file as UTF-8")]) from None
    tune, located = _parse(text, label)
    problems = ladders.problems(tune, located, runnable.Host.this())
    if problems:
        raise LadderError(label, problems)
    return tune, text


def same_study(stored: TuneFile, given: TuneFile) -> bool:
    """Whether `given` continues the study `stored` started: the same file but for its budget (which
    a study may be given more of) and its description."""
    def identity(tune: TuneFile) -> dict[str, Any]:
        return tune.model_dump(exclude={"budget", "description"})

    return identity(stored) == identity(given)


def parse_tune(text: str, label: str) -> TuneFile:
    """The tune file in `text`, well formed and consistent (no host checks: a stored one may come
    from another host)."""
    return _parse(text, label)[0]


def _parse(text: str, label: str) -> tuple[TuneFile, Located]:
    located, problems = load(text)
    if located is None or not isinstance(located.data, dict):
        raise LadderError(label, problems or [Problem(1, "a tune file is a mapping with name, engine, space and "
                                                         "objectives")])
    try:
        tune = TuneFile.model_validate(located.data)
    except ValidationError as exc:
        raise LadderError(label, problems + [_problem(e, located) for e in exc.errors()]) from None
    problems += _rules(tune, located)
    if problems:
        raise LadderError(label, problems)
    return tune, located


def _problem(error: Any, located: Located) -> Problem:
    path = tuple(p for p in error["loc"] if not isinstance(p, str) or p not in ("bundled", "command"))
    if error["type"] == "extra_forbidden":
        return Problem(located.line(path), f"unknown key {path[-1]!r} in {dotted(path[:-1]) or 'the tune file'}")
    if error["type"] == "missing":
        return Problem(located.line(path[:-1]), f"{dotted(path[:-1]) or 'the tune file'}: missing required field "
                                                f"{path[-1]!r}")
    where = dotted(path)
    return Problem(located.line(path), f"{where}: {error['msg']}" if where else error["msg"])


def _rules(tune: TuneFile, located: Located) -> list[Problem]:
    """Knobs the bundled engine has, metrics some listed instrument produces, names used once."""
    problems = []
    kind = kind_of(tune.engine)
    seen: set[str] = set()
    for i, param in enumerate(tune.space):
        if param.name in seen:
            problems.append(Problem(located.line(("space", i)), f"space[{i}]: {param.name} is searched twice"))
        seen.add(param.name)
        for field, knob in (("flag", param.flag), ("env", param.env)):
            unknown = kind.unknown_knob(**{field: knob}) if knob else None
            if unknown:
                problems.append(Problem(located.line(("space", i, field)), f"space[{i}].{field}: {unknown}"))
    produced = {name: REGISTRY[name]().metrics(params) for name, params in tune.instruments.sections()}
    for section, refs in (("objectives", tune.objectives), ("constraints", tune.constraints)):
        for i, ref in enumerate(refs):
            instrument, _, metric = ref.metric.partition(".")
            if metric not in produced.get(instrument, {}):
                problems.append(Problem(located.line((section, i, "metric")),
                                        f"{section}[{i}].metric: no listed instrument produces {ref.metric} "
                                        f"(listed: {', '.join(produced) or 'none'})"))
    return problems
