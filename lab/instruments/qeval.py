"""qeval: the shipped auto-scored task set at T=0, one row per task, paired against the window's
opening control.

Every selected task is sent once through the chat endpoint with its own messages and token
budget, `temperature: 0` and a fixed seed, and scored by its deterministic scorer
(`lab.instruments.scoring`). A request that fails counts as a failed task, with the error in the
row's detail and in the `errors` cell. Prompts are not salted: pairing needs the identical prompt
on every boot, and each boot is a fresh engine process, so no boot can be served from another's
prefix cache.

Before anything is sent, the scorer must pass its self-check on exactly the tasks selected (every
reference passes, every counterexample fails). A scorer that fails it raises, so the step is stored
as an error with the failing cases named and no score cell exists: a broken scorer can never
silently score a run.

Paired comparison (every boot but the opening control): per task, control passed vs this boot
passed. `broke` = passed on the control and failed here, `fixed` = the reverse, `mcnemar_p` = the
exact two-sided McNemar p of broke vs fixed. Tasks that ran on one side only are counted in
`unpaired_tasks` and named in the notes, never dropped silently.

Gate rule (`gate_pass`, 1 or 0): the boot fails when it broke more tasks than it fixed *and*
McNemar's exact p is below `alpha` (a net regression that chance does not explain), or when
`max_broke` is set and broke exceeds it. Use `{metric: qeval.gate_pass, min: 1}` in `keep.gates`.
On a few dozen tasks McNemar alone is lenient (6 broke, 0 fixed is the smallest significant
count at 0.05), so set `max_broke: 0` where numerics must not change at all.

On an engine that serves random weights (`/v1/stats` says so) no request is sent: every cell of the
step is invalid with a "not applicable: ..." note, since answers from random weights carry no
knowledge to score. A ladder cannot key its KEEP rule on them there (`lab.ladder.validate`).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any, Callable, ClassVar, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field, model_validator

from lab.instruments.base import Better, BootContext, random_weights_note
from lab.instruments.client import StreamingClient
from lab.instruments.engine_extras import EngineExtras
from lab.instruments.opening_control import is_opening_control, load_reference
from lab.instruments.paired import paired_counts
from lab.instruments.qeval_task import QevalTask, load_tasks, task_set_hash
from lab.instruments.scoring import Score, score, validate_tasks
from lab.store.records import Cell, QevalItem, Step, StepResult

# Tasks per category that the default `quick` preset runs (24 of the shipped set, 3 per category).
QUICK_PER_CATEGORY = 3


class QevalParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    preset: Literal["quick", "full"] = Field(
        "quick", description=f"quick: the first {QUICK_PER_CATEGORY} tasks of each category; full: every task")
    categories: list[str] | None = Field(None, description="only these categories")
    per_category: int | None = Field(None, ge=1, description="the first N tasks of each category (overrides preset)")
    tasks: list[str] | None = Field(None, description="exactly these task ids; excludes preset/categories/per_category")
    concurrency: int = Field(8, ge=1, le=256)
    seed: int = 0
    max_tokens_scale: float = Field(1.0, gt=0, le=16, description="multiply every task's max_tokens (reasoning models)")
    alpha: float = Field(0.05, gt=0, lt=1, description="gate: a net regression with McNemar p below this fails")
    max_broke: int | None = Field(None, ge=0, description="gate: fail when more tasks than this broke")
    request_timeout_s: float = Field(300.0, gt=0)

    @model_validator(mode="after")
    def _selects_shipped_tasks(self) -> QevalParams:
        shipped = load_tasks()
        if self.tasks is not None:
            clash = sorted({"preset", "categories", "per_category"} & self.model_fields_set)
            if clash:
                raise ValueError(f"tasks names the whole set; drop {', '.join(clash)}")
            unknown = sorted(set(self.tasks) - {t.id for t in shipped})
            if unknown:
                raise ValueError(f"unknown task ids: {', '.join(unknown)}")
            if len(set(self.tasks)) != len(self.tasks):
                raise ValueError("a task id is listed twice")
        if self.categories is not None:
            known = {t.category for t in shipped}
            unknown = sorted(set(self.categories) - known)
            if unknown:
                raise ValueError(f"unknown categories: {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        if not select_tasks(self, shipped):
            raise ValueError("selects no task")
        return self


def select_tasks(params: QevalParams, tasks: list[QevalTask]) -> list[QevalTask]:
    """The tasks these params select, in file order."""
    if params.tasks is not None:
        wanted = set(params.tasks)
        return [t for t in tasks if t.id in wanted]
    cap = params.per_category or (QUICK_PER_CATEGORY if params.preset == "quick" else None)
    seen: Counter[str] = Counter()
    chosen = []
    for task in tasks:
        if params.categories is not None and task.category not in params.categories:
            continue
        seen[task.category] += 1
        if cap is None or seen[task.category] <= cap:
            chosen.append(task)
    return chosen


class ScorerSelfCheckError(RuntimeError):
    """The scorer fails its own references or passes a counterexample: its scores cannot be trusted."""


class QevalInstrument:
    name: ClassVar[str] = "qeval"
    Params: ClassVar[type[BaseModel]] = QevalParams
    needs_real_weights: ClassVar[bool] = True

    def __init__(self, scorer: Callable[[QevalTask, str], Score] = score) -> None:
        self._score = scorer

    def metrics(self, params: BaseModel) -> dict[str, Better]:
        return {
            "score": "higher",
            "category_score": "higher",
            "passed": "higher",
            "n_tasks": "higher",
            "errors": "lower",
            "broke": "lower",
            "fixed": "higher",
            "mcnemar_p": "higher",
            "gate_pass": "higher",
            "unpaired_tasks": "lower",
        }

    def cell_params(self, params: BaseModel) -> dict[str, list[dict[str, Any]]]:
        """One cell per metric, and one category_score per category of the selected tasks: so a
        KEEP `where` naming a category the ladder does not ask for is refused before anything boots."""
        assert isinstance(params, QevalParams)
        categories = sorted({t.category for t in select_tasks(params, load_tasks())})
        cells: dict[str, list[dict[str, Any]]] = {metric: [{}] for metric in self.metrics(params)}
        cells["category_score"] = [{"category": category} for category in categories]
        return cells

    def plan(self, params: BaseModel) -> list[Step]:
        assert isinstance(params, QevalParams)
        tasks = select_tasks(params, load_tasks())
        return [Step("tasks", {"n_tasks": len(tasks), "task_set_hash": task_set_hash(tasks),
                               "task_ids": [t.id for t in tasks]})]

    async def run_step(self, ctx: BootContext, step: Step) -> StepResult:
        params = ctx.params
        assert isinstance(params, QevalParams)
        tasks = select_tasks(params, load_tasks())
        problems = validate_tasks(tasks, self._score)
        if problems:
            shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
            raise ScorerSelfCheckError(f"scorer fails its self-check on {len(problems)} case(s): {shown}")
        async with EngineExtras(ctx) as extras:
            try:
                random_weights = await extras.random_weights()
            except httpx.TransportError:
                random_weights = None  # an engine that is gone fails every request below: each a failed task
        if random_weights:
            return StepResult(cells=_not_applicable_cells(ctx, tasks, random_weights_note(ctx.model)))
        payloads = [{"model": ctx.model, "messages": list(t.messages),
                     "max_tokens": math.ceil(t.max_tokens * params.max_tokens_scale),
                     "temperature": 0, "seed": params.seed} for t in tasks]
        async with StreamingClient(ctx.api_base, api_key=ctx.api_key,
                                   timeout=min(params.request_timeout_s, ctx.request_timeout_s),
                                   max_connections=params.concurrency) as client:
            receipts = await client.run_all(payloads, params.concurrency)
        items = []
        for i, (task, receipt) in enumerate(zip(tasks, receipts)):
            base = {"finish_reason": receipt.finish_reason, "completion_tokens": receipt.completion_tokens}
            if receipt.error is not None:
                items.append(QevalItem(task.id, passed=False, score=None, category=task.category,
                                       scorer=task.scorer["type"], output=receipt.text, expected=task.reference,
                                       request=i, detail={**base, "error": receipt.error}))
                continue
            result = self._score(task, receipt.text)
            items.append(QevalItem(task.id, passed=result.passed, score=float(result.passed), category=task.category,
                                   scorer=task.scorer["type"], output=receipt.text, expected=task.reference,
                                   request=i, detail={**base, "scorer": result.detail}))
        cells = _score_cells(items, task_set_hash(tasks))
        if not is_opening_control(ctx):
            reference = load_reference(ctx, self.name)
            control = None if reference.problem else {row.task: row.passed for row in reference.items}
            cells += paired_cells(control, {it.task: it.passed for it in items}, params,
                                  reference.problem or f"against the opening control, boot {reference.boot_id}")
        passed = sum(it.passed for it in items)
        ctx.log.info("qeval %s: %d/%d passed", ctx.arm, passed, len(items))
        return StepResult(cells=cells, receipts=receipts, items=items)


def _not_applicable_cells(ctx: BootContext, tasks: list[QevalTask], note: str) -> list[Cell]:
    """Every cell the step would store, each invalid with `note` as the reason."""
    params = ctx.params
    assert isinstance(params, QevalParams)
    units = {"score": "fraction", "passed": "tasks", "n_tasks": "tasks", "errors": "requests"}
    cells = [Cell(metric, None, unit, valid=False, note=note, requests=[]) for metric, unit in units.items()]
    cells += [Cell("category_score", None, "fraction", params={"category": category}, valid=False, note=note,
                   requests=[]) for category in sorted({t.category for t in tasks})]
    if not is_opening_control(ctx):
        cells += paired_cells(None, {}, params, note)
    ctx.log.info("qeval %s: %s", ctx.arm, note)
    return cells


def _score_cells(items: list[QevalItem], digest: str) -> list[Cell]:
    n = len(items)
    passed = sum(it.passed for it in items)
    errors = [it.task for it in items if "error" in it.detail]
    note = f"{passed}/{n} passed; task set sha256 {digest}"
    cells = [
        Cell("score", passed / n, "fraction", note=note),
        Cell("passed", passed, "tasks", note=note),
        Cell("n_tasks", n, "tasks", note=note),
        Cell("errors", len(errors), "requests",
             note=("failed requests (counted as failed tasks): " + ", ".join(errors)) if errors else ""),
    ]
    for category in sorted({it.category for it in items}):
        rows = [i for i, it in enumerate(items) if it.category == category]
        hits = sum(items[i].passed for i in rows)
        cells.append(Cell("category_score", hits / len(rows), "fraction", params={"category": category},
                          note=f"{hits}/{len(rows)} passed", requests=rows))
    return cells


def paired_cells(control: dict[str, bool] | None, here: dict[str, bool], params: QevalParams,
                 against: str) -> list[Cell]:
    """broke / fixed / mcnemar_p / gate_pass / unpaired_tasks of this boot against the control's
    outcomes; all invalid, with `against` as the reason, when `control` is None."""
    names = ("broke", "fixed", "mcnemar_p", "gate_pass", "unpaired_tasks")
    units = ("tasks", "tasks", "p", "bool", "tasks")
    if control is None:
        return [Cell(name, None, unit, valid=False, note=against, requests=[]) for name, unit in zip(names, units)]
    counts = paired_counts(control, here)
    only_control = sorted(control.keys() - here.keys())
    only_here = sorted(here.keys() - control.keys())
    sides = []
    if only_control:
        sides.append(f"only on the control: {', '.join(only_control)}")
    if only_here:
        sides.append(f"only here: {', '.join(only_here)}")
    if counts.n == 0:
        why = f"{against}: no task ran on both sides" + (f" ({'; '.join(sides)})" if sides else "")
        return [Cell(name, None, unit, valid=False, note=why, requests=[]) for name, unit in zip(names, units)]
    p = counts.p_value
    regressed = counts.broke > counts.fixed and p < params.alpha
    over_cap = params.max_broke is not None and counts.broke > params.max_broke
    rule = f"fails when broke > fixed with p < {params.alpha:g}"
    if params.max_broke is not None:
        rule += f", or broke > {params.max_broke}"
    changed = sorted(t for t in control.keys() & here.keys() if control[t] != here[t])
    note = (f"{against}: {counts.summary()} over {counts.n} paired tasks"
            + (f"; changed: {', '.join(changed)}" if changed else "") + (f"; {'; '.join(sides)}" if sides else ""))
    return [
        Cell("broke", counts.broke, "tasks", note=note),
        Cell("fixed", counts.fixed, "tasks", note=note),
        Cell("mcnemar_p", p, "p", note=note),
        Cell("gate_pass", 0.0 if regressed or over_cap else 1.0, "bool", note=f"{rule}; {note}"),
        Cell("unpaired_tasks", len(only_control) + len(only_here), "tasks", note="; ".join(sides)),
    ]
