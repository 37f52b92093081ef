"""qeval: every shipped task through `lab run` on the real engine, paired against the window's
opening control; the scorer self-check that stops a broken scorer; the gate's exact counts."""

from __future__ import annotations

import asyncio
import logging
import math
import socket
from collections import Counter
from collections.abc import Iterator

import pytest
from sqlalchemy import select

from lab.instruments.base import BootContext
from lab.instruments.qeval import QevalInstrument, QevalParams, ScorerSelfCheckError, paired_cells, select_tasks
from lab.instruments.qeval_task import QevalTask, load_tasks, task_set_hash
from lab.instruments.scoring import Score, final_number, score
from lab.store import models as m
from lab.store.db import Store
from lab.store.records import Step
from tests.instruments.ladder_run import run_ladder

# An eighth of each task's budget (a code task's 160 tokens become 20): every task is still sent,
# scored, stored and paired, and the test checks the scaled budget each request carried.
MAX_TOKENS_SCALE = 0.125
QEVAL_LADDER = """\
    name: qevaltwo
    engine:
      kind: bundled
      model: smollm2-135m
      flags: {device: cpu, dtype: float32, max-model-len: 1024, kv-cache-memory-bytes: 67108864}
    windows:
      - name: W1
        control: C0ctl
        arms:  # never booted: the run is the controls alone
          - {name: A1seqs8, flags: {max-num-seqs: 8}}
    instruments:
      qeval: {preset: full, concurrency: 32, max_tokens_scale: %g}
    """ % MAX_TOKENS_SCALE


@pytest.fixture(scope="module")
def qeval_two_control_boots(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    """The opening and the closing control of one window and no arm (`lab sweep --control-only`):
    the same config booted twice, each running all shipped tasks."""
    store = run_ladder(tmp_path_factory.mktemp("qeval"), QEVAL_LADDER, "two", timeout=480, controls_only=True)
    yield store
    store.close()


def boot_ids(store: Store) -> dict[str, int]:
    with store.session() as s:
        rows = s.execute(select(m.Slot.position, m.Boot.id).join(m.Boot, m.Boot.slot_id == m.Slot.id)
                         .where(m.Boot.status == "done")).all()
    return dict(rows)


def cells(store: Store, boot_id: int) -> dict[tuple[str, str], m.Cell]:
    with store.session() as s:
        rows = s.scalars(select(m.Cell).where(m.Cell.boot_id == boot_id, m.Cell.instrument == "qeval")).all()
    return {(c.metric, c.params_key): c for c in rows}


@pytest.mark.slow
def test_every_shipped_task_is_sent_scored_and_stored_once_per_boot(qeval_two_control_boots: Store) -> None:
    store = qeval_two_control_boots
    tasks = {t.id: t for t in load_tasks()}
    boots = boot_ids(store)
    assert set(boots) == {"open", "close"}
    for boot_id in boots.values():
        with store.session() as s:
            items = s.scalars(select(m.QevalItem).where(m.QevalItem.boot_id == boot_id)).all()
            requests = {r.id: r for r in s.scalars(select(m.Request).where(m.Request.boot_id == boot_id))}
            step = s.scalar(select(m.Step).where(m.Step.boot_id == boot_id, m.Step.instrument == "qeval"))
        assert sorted(it.task for it in items) == sorted(tasks)
        assert step.status == "ok" and step.params["task_set_hash"] == task_set_hash(tasks.values())
        for item in items:
            task, request = tasks[item.task], requests[item.request_id]
            assert request.error is None and request.endpoint == "/v1/chat/completions"
            assert request.payload["messages"] == list(task.messages)
            assert (request.payload["max_tokens"], request.payload["temperature"]) == (
                math.ceil(task.max_tokens * MAX_TOKENS_SCALE), 0)
            assert (item.category, item.scorer, item.expected) == (task.category, task.scorer["type"], task.reference)
            assert item.output == request.text
            # The stored verdict is the scorer's on the stored answer.
            assert item.passed == score(task, item.output).passed, item.task
        found = cells(store, boot_id)
        passed = sum(it.passed for it in items)
        assert found[("score", "{}")].value == pytest.approx(passed / len(tasks))
        assert found[("n_tasks", "{}")].value == len(tasks) and found[("errors", "{}")].value == 0
        per_category = {c.params["category"]: c.value for (metric, _), c in found.items() if metric == "category_score"}
        counts = Counter(t.category for t in tasks.values())
        hits = Counter(it.category for it in items if it.passed)
        assert per_category == {c: pytest.approx(hits[c] / n) for c, n in counts.items()}


@pytest.mark.slow
def test_two_boots_of_the_same_config_break_and_fix_nothing(qeval_two_control_boots: Store) -> None:
    store = qeval_two_control_boots
    boots = boot_ids(store)
    closing = cells(store, boots["close"])
    assert closing[("broke", "{}")].value == 0 and closing[("fixed", "{}")].value == 0
    assert closing[("mcnemar_p", "{}")].value == 1.0
    assert closing[("gate_pass", "{}")].value == 1.0 and closing[("unpaired_tasks", "{}")].value == 0
    assert f"opening control, boot {boots['open']}" in closing[("broke", "{}")].note
    with store.session() as s:
        outputs = {b: {it.task: it.output for it in s.scalars(select(m.QevalItem).where(m.QevalItem.boot_id == b))}
                   for b in boots.values()}
    assert outputs[boots["open"]] == outputs[boots["close"]]
    # The opening control is the reference: it is not compared with anything.
    assert not {metric for metric, _ in cells(store, boots["open"])} & {"broke", "fixed", "mcnemar_p", "gate_pass"}


def _ctx(params: QevalParams, api_base: str, role: str = "control") -> BootContext:
    return BootContext(base_url=api_base.removesuffix("/v1"), api_base=api_base, model="smollm2-135m", api_key=None,
                       run_id=1, run_name="t", slot_id=1, boot_id=1, arm="C0ctl", window="W1",
                       role=role, position="open", salt="s", engine_kind="bundled",  # type: ignore[arg-type]
                       params=params, stored=None, control_boot_ids=[], mem=None,  # type: ignore[arg-type]
                       log=logging.getLogger("test.qeval"))


def _passes_everything(task: QevalTask, answer: str) -> Score:
    return Score(True, "accepted")


def _drops_the_sign(task: QevalTask, answer: str) -> Score:
    """A plausible bug: numbers compared by magnitude."""
    if task.scorer["type"] == "number":
        got = final_number(answer)
        return Score(got is not None and abs(abs(got) - abs(task.scorer["value"])) <= 1e-9, "by magnitude")
    return score(task, answer)


@pytest.mark.parametrize("broken, caught", [(_passes_everything, "arith_01: counterexample 1 passes"),
                                            (_drops_the_sign, "arith_05: counterexample 1 passes")])
def test_a_broken_scorer_fails_the_step_before_any_request(broken, caught: str) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        params = QevalParams(preset="full")
        ctx = _ctx(params, f"http://127.0.0.1:{listener.getsockname()[1]}/v1")
        with pytest.raises(ScorerSelfCheckError, match=caught):
            asyncio.run(QevalInstrument(scorer=broken).run_step(ctx, Step("tasks")))
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected: no answer was scored by the broken scorer


def test_failed_requests_are_failed_tasks_with_the_error_in_view() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    params = QevalParams(tasks=["arith_01", "clf_02", "code_07"])
    result = asyncio.run(QevalInstrument().run_step(_ctx(params, f"http://127.0.0.1:{port}/v1"), Step("tasks")))
    assert [it.task for it in result.items] == ["arith_01", "code_07", "clf_02"]  # file order
    assert all(not it.passed and it.score is None and "Connect" in it.detail["error"] for it in result.items)
    by_metric = {c.metric: c for c in result.cells if not c.params}
    assert by_metric["score"].value == 0 and by_metric["errors"].value == 3
    assert by_metric["errors"].note.endswith("arith_01, code_07, clf_02")


def _outcomes(passes: str) -> dict[str, bool]:
    return {f"t{i}": flag == "1" for i, flag in enumerate(passes)}


def _by_metric(found: list) -> dict[str, object]:
    return {c.metric: c for c in found}


def test_paired_counts_give_the_exact_mcnemar_p_and_the_gate() -> None:
    # t0-t4 broke, t5 fixed, t6-t7 passed on both, t8 failed on both; plus one task on each side only.
    control = {**_outcomes("111110110"), "only_control": True}
    here = {**_outcomes("000001110"), "only_here": False}
    found = _by_metric(paired_cells(control, here, QevalParams(), "against boot 7"))
    assert (found["broke"].value, found["fixed"].value) == (5, 1)
    assert found["mcnemar_p"].value == 14 / 64  # 2 * (C(6,0) + C(6,1)) / 2^6
    assert found["gate_pass"].value == 1.0  # a net regression, but not one chance fails to explain at 0.05
    assert found["unpaired_tasks"].value == 2
    assert "only on the control: only_control" in found["unpaired_tasks"].note
    assert "only here: only_here" in found["broke"].note and "changed: t0, t1, t2, t3, t4, t5" in found["broke"].note

    six_broke = _by_metric(paired_cells(_outcomes("111111"), _outcomes("000000"), QevalParams(), "x"))
    assert six_broke["mcnemar_p"].value == 2 / 64 and six_broke["gate_pass"].value == 0.0

    capped = _by_metric(paired_cells(_outcomes("1000"), _outcomes("0111"), QevalParams(max_broke=0), "x"))
    assert (capped["broke"].value, capped["fixed"].value, capped["gate_pass"].value) == (1, 3, 0.0)


def test_without_a_reference_every_paired_cell_is_invalid_with_the_reason() -> None:
    found = paired_cells(None, _outcomes("10"), QevalParams(), "no warm control of window W1")
    assert {c.metric for c in found} == {"broke", "fixed", "mcnemar_p", "gate_pass", "unpaired_tasks"}
    assert all(not c.valid and c.value is None and c.note == "no warm control of window W1" for c in found)


def test_selection_is_deterministic_and_checked_against_the_shipped_set() -> None:
    shipped = load_tasks()
    quick = select_tasks(QevalParams(), shipped)
    assert len(quick) == 24 and set(Counter(t.category for t in quick).values()) == {3}
    first_three = [t for t in shipped if sum(u.category == t.category for u in shipped[:shipped.index(t) + 1]) <= 3]
    assert quick == first_three
    assert select_tasks(QevalParams(preset="full"), shipped) == shipped
    code = select_tasks(QevalParams(categories=["code"], per_category=5), shipped)
    assert [t.id for t in code] == [t.id for t in shipped if t.category == "code"][:5]
    assert [t.id for t in select_tasks(QevalParams(tasks=["json_02", "arith_01"]), shipped)] == ["arith_01", "json_02"]
    plan = QevalInstrument().plan(QevalParams())
    assert plan == QevalInstrument().plan(QevalParams()) and plan[0].params["n_tasks"] == 24
    for bad in ({"tasks": ["arith_99"]}, {"categories": ["poetry"]}, {"tasks": ["arith_01"], "preset": "full"},
                {"concurrency": 0}, {"typo": 1}):
        with pytest.raises(ValueError):
            QevalParams(**bad)
