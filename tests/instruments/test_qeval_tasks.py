"""The shipped qeval task set, the task-file loader, and the set's guard over its scorers."""

from __future__ import annotations

import dataclasses
import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import lab.instruments
from lab.instruments.qeval_task import QevalTask, TaskFileError, default_task_path, load_tasks, task_set_hash
from lab.instruments.scoring import Score, extract_code, validate_tasks

CATEGORIES = {"arithmetic", "extraction", "json", "code", "reasoning", "format", "retrieval", "classification"}


@pytest.fixture(scope="module")
def tasks() -> list[QevalTask]:
    return load_tasks()


# ---- the shipped set ----------------------------------------------------------------------

def test_shipped_set_is_large_enough_and_covers_the_categories(tasks: list[QevalTask]):
    counts = Counter(t.category for t in tasks)
    assert len(tasks) >= 75
    assert CATEGORIES <= set(counts)
    assert min(counts.values()) >= 5
    assert len({t.id for t in tasks}) == len(tasks)


def test_shipped_file_is_package_data():
    assert default_task_path() == Path(lab.instruments.__file__).parent / "qeval_tasks.jsonl"


def test_every_reference_passes_and_every_counterexample_fails(tasks: list[QevalTask]):
    assert validate_tasks(tasks) == []


def test_ids_share_one_prefix_per_category(tasks: list[QevalTask]):
    prefixes: dict[str, set[str]] = {}
    for t in tasks:
        prefixes.setdefault(t.category, set()).add(t.id.rsplit("_", 1)[0])
    assert all(len(p) == 1 for p in prefixes.values()), prefixes


def test_token_budgets_are_small(tasks: list[QevalTask]):
    code = [t for t in tasks if t.category == "code"]
    other = [t for t in tasks if t.category != "code"]
    assert all(t.scorer["type"] == "code" for t in code)
    assert max(t.max_tokens for t in code) <= 160
    assert max(t.max_tokens for t in other) <= 64
    assert sum(t.max_tokens <= 48 for t in other) >= 0.9 * len(other)


def test_prompts_are_chats_ending_with_the_user(tasks: list[QevalTask]):
    for t in tasks:
        assert t.messages[-1]["role"] == "user" and t.messages[-1]["content"].strip()
        assert all(m["role"] == "system" for m in t.messages[:-1]), t.id
    assert any(len(t.messages) > 1 for t in tasks)


def test_scorers_are_varied(tasks: list[QevalTask]):
    assert {t.scorer["type"] for t in tasks} == {"exact", "number", "regex", "json", "choice", "contains_all", "code"}


def test_hash_is_stable_order_free_and_tracks_what_reaches_the_engine(tasks: list[QevalTask]):
    digest = task_set_hash(tasks)
    assert re.fullmatch(r"[0-9a-f]{64}", digest)
    assert task_set_hash(load_tasks()) == digest
    assert task_set_hash(list(reversed(tasks))) == digest
    first = tasks[0]
    renoted = dataclasses.replace(first, notes="edited", counterexamples=("other",))
    assert task_set_hash([renoted, *tasks[1:]]) == digest
    reprompted = dataclasses.replace(first, messages=({"role": "user", "content": "changed"},))
    assert task_set_hash([reprompted, *tasks[1:]]) != digest
    rebudgeted = dataclasses.replace(first, max_tokens=first.max_tokens + 1)
    assert task_set_hash([rebudgeted, *tasks[1:]]) != digest
    rescored = dataclasses.replace(first, scorer={**first.scorer, "value": -1})
    assert task_set_hash([rescored, *tasks[1:]]) != digest
    assert task_set_hash(tasks[1:]) != digest


# ---- deliberately broken scorers are caught -----------------------------------------------

def _broken(rule):
    return lambda task, answer: Score(rule(task, answer), "broken")


def _numbers(answer: str) -> list[float]:
    return [float(n.replace(",", "")) for n in re.findall(r"-?\d[\d,]*(?:\.\d+)?", answer)]


def _problems(tasks: list[QevalTask], rule, kind: str | None = None) -> set[str]:
    """What `validate_tasks` reports under the broken rule, over the tasks `kind` scores (default all)."""
    return set(validate_tasks([t for t in tasks if kind is None or t.scorer["type"] == kind], _broken(rule)))


def _slipped(task_id: str, counterexample: int) -> str:
    return f"{task_id}: counterexample {counterexample} passes (broken)"


def test_a_scorer_that_passes_everything_is_caught_on_every_task(tasks: list[QevalTask]):
    assert _problems(tasks, lambda task, answer: True) == {
        _slipped(t.id, n) for t in tasks for n in range(1, len(t.counterexamples) + 1)}


def test_a_scorer_that_fails_everything_is_caught_on_every_task(tasks: list[QevalTask]):
    assert _problems(tasks, lambda task, answer: False) == {f"{t.id}: reference fails (broken)" for t in tasks}


def test_a_number_scorer_that_ignores_the_final_number_rule_is_caught(tasks: list[QevalTask]):
    def any_number(task: QevalTask, answer: str) -> bool:
        return any(abs(n - task.scorer["value"]) <= task.scorer.get("abs_tol", 0) for n in _numbers(answer))

    def first_number(task: QevalTask, answer: str) -> bool:
        numbers = _numbers(answer)
        return bool(numbers) and abs(numbers[0] - task.scorer["value"]) <= task.scorer.get("abs_tol", 0)

    assert {_slipped("arith_02", 2), _slipped("extr_11", 2), _slipped("retr_01", 2)} <= _problems(
        tasks, any_number, "number")
    assert {_slipped("extr_11", 2), _slipped("retr_01", 2)} <= _problems(tasks, first_number, "number")


def test_a_number_scorer_that_drops_signs_or_separators_is_caught(tasks: list[QevalTask]):
    def unsigned(task: QevalTask, answer: str) -> bool:
        numbers = _numbers(answer.replace("-", "").replace("\u2212", ""))
        return bool(numbers) and abs(numbers[-1]) == abs(task.scorer["value"])

    def comma_blind(task: QevalTask, answer: str) -> bool:
        numbers = re.findall(r"\d+(?:\.\d+)?", answer)
        return bool(numbers) and float(numbers[-1]) == task.scorer["value"]

    assert _slipped("arith_05", 1) in _problems(tasks, unsigned, "number")
    assert {"arith_08: reference fails (broken)", "extr_11: reference fails (broken)"} <= _problems(
        tasks, comma_blind, "number")


def test_a_lax_json_scorer_is_caught(tasks: list[QevalTask]):
    def python_equality_no_key_check(task: QevalTask, answer: str) -> bool:
        match = re.search(r"\{.*\}", answer, re.DOTALL)
        try:
            value = json.loads(match.group(0)) if match else None
        except ValueError:
            return False
        return isinstance(value, dict) and all(value.get(k) == v for k, v in task.scorer.get("required", {}).items())

    assert {_slipped("json_01", 1), _slipped("json_04", 3)} <= _problems(tasks, python_equality_no_key_check, "json")


def test_a_choice_scorer_that_accepts_several_labels_is_caught(tasks: list[QevalTask]):
    def substring(task: QevalTask, answer: str) -> bool:
        return task.scorer["answer"].lower() in answer.lower()

    assert {_slipped("reas_05", 2), _slipped("clf_02", 2), _slipped("clf_04", 1), _slipped("retr_11", 2)} <= _problems(
        tasks, substring, "choice")


def test_a_code_scorer_that_trusts_the_exit_status_is_caught(tasks: list[QevalTask]):
    from lab.instruments.sandbox import run_python

    def exit_status_only(task: QevalTask, answer: str) -> bool:
        return run_python(f"{extract_code(answer)}\n\n{task.scorer['tests']}").returncode == 0

    assert _slipped("code_01", 3) in _problems(tasks, exit_status_only, "code")


def test_an_exact_scorer_that_ignores_case_sensitivity_is_caught(tasks: list[QevalTask]):
    def always_casefold(task: QevalTask, answer: str) -> bool:
        return answer.strip().rstrip(".").casefold() == task.scorer["answer"].casefold()

    assert _slipped("fmt_02", 1) in _problems(tasks, always_casefold, "exact")


# ---- bad task files -----------------------------------------------------------------------

GOOD: dict[str, Any] = {"id": "unit_01", "category": "unit", "messages": [{"role": "user", "content": "2+2?"}],
                        "max_tokens": 8, "scorer": {"type": "number", "value": 4}, "reference": "4",
                        "counterexamples": ["5"]}


def _write(tmp_path: Path, *records: Any) -> Path:
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return path


def _load_error(path: Path) -> str:
    with pytest.raises(TaskFileError) as caught:
        load_tasks(path)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_a_good_file_loads(tmp_path: Path):
    [task] = load_tasks(_write(tmp_path, {**GOOD, "notes": "n"}))
    assert task == QevalTask(id="unit_01", category="unit", messages=({"role": "user", "content": "2+2?"},),
                             max_tokens=8, scorer={"type": "number", "value": 4}, reference="4",
                             counterexamples=("5",), notes="n")


def test_blank_lines_are_skipped_but_count_for_line_numbers(tmp_path: Path):
    path = _write(tmp_path, GOOD, "", {**GOOD, "id": "unit_02"}, "", {**GOOD, "id": "unit_02"})
    assert _load_error(path) == "tasks.jsonl line 5: duplicate id 'unit_02' (first on line 3)"


@pytest.mark.parametrize("record, message", [
    ({**GOOD, "scorer": {"type": "fuzzy", "value": 4}},
     "line 2: unit_01: unknown scorer type 'fuzzy' (known: 'exact', 'number', 'regex', 'json', 'choice', "
     "'contains_all', 'code')"),
    ({k: v for k, v in GOOD.items() if k != "reference"}, "line 2: missing field 'reference'"),
    ({**GOOD, "refrence": "4"}, "line 2: unknown field 'refrence'"),
    ({**GOOD, "max_tokens": "8"}, "line 2: field 'max_tokens' must be a JSON integer"),
    ({**GOOD, "max_tokens": True}, "line 2: field 'max_tokens' must be a JSON integer"),
    ({**GOOD, "max_tokens": 0}, "line 2: unit_01: max_tokens must be between 1 and 1024"),
    ({**GOOD, "id": "Unit 1"}, "line 2: id 'Unit 1' must look like 'arith_07'"),
    ({**GOOD, "category": "Unit!"}, "line 2: unit_01: category 'Unit!' must be a lowercase word"),
    ({**GOOD, "messages": []}, "line 2: unit_01: messages must end with a user message"),
    ({**GOOD, "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
     "line 2: unit_01: messages must end with a user message"),
    ({**GOOD, "messages": [{"role": "robot", "content": "q"}]}, "line 2: unit_01: each message must be"),
    ({**GOOD, "counterexamples": []}, "line 2: unit_01: counterexamples must be a non-empty list of strings"),
    ({**GOOD, "counterexamples": [5]}, "line 2: unit_01: counterexamples must be a non-empty list of strings"),
    ({**GOOD, "scorer": {"type": "number"}}, "line 2: unit_01: number scorer: missing parameter 'value'"),
    ('{"id": "unit_01",', "line 2: not valid JSON ("),
    ("[1, 2]", "line 2: not a JSON object"),
])
def test_bad_records_give_one_line_errors_naming_the_line(tmp_path: Path, record: Any, message: str):
    assert _load_error(_write(tmp_path, {**GOOD, "id": "unit_00"}, record)).startswith("tasks.jsonl " + message)


def test_an_empty_file_is_an_error(tmp_path: Path):
    assert _load_error(_write(tmp_path, "")) == "tasks.jsonl: no tasks"
