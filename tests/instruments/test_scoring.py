"""Each scorer's rules and edge cases, spec validation, and validate_tasks."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lab.instruments.qeval_task import QevalTask
from lab.instruments.scoring import (
    Score, ScorerSpecError, extract_code, final_number, parse_scorer, score, validate_tasks,
)


def _task(scorer: dict[str, Any], reference: str = "", counterexamples: tuple[str, ...] = ("",)) -> QevalTask:
    return QevalTask(id="unit_01", category="unit", messages=({"role": "user", "content": "?"},), max_tokens=16,
                     scorer=scorer, reference=reference, counterexamples=counterexamples)


def _passes(scorer: dict[str, Any], answer: str) -> bool:
    return score(_task(scorer), answer).passed


# ---- number -------------------------------------------------------------------------------

@pytest.mark.parametrize("text, value", [
    ("42", 42), ("The answer is 42.", 42), ("**42**", 42), ("$\\boxed{42}$", 42),
    ("47 + 38 = 85", 85), ("-27", -27), ("\u221227", -27), ("The result is -27.", -27), ("+5", 5),
    ("15,000", 15000), ("1,234,567.5", 1234567.5), ("3.25", 3.25), ("1.5e3", 1500), ("2E-2", 0.02),
    ("\uff14\uff12", 42), ("50%", 50), ("$1,200", 1200), ("5kg", 5), ("(−3)", -3),
])
def test_final_number_reads_common_formats(text: str, value: float):
    assert final_number(text) == value


@pytest.mark.parametrize("text, value", [
    ("10-3", 3),            # a hyphen after a digit is not a sign
    ("x-3", 3),             # nor after a letter
    ("3,14", 14),           # a comma joins digits only in groups of three
    ("1,2345", 2345),
    ("H2O is 18", 18),
    ("v2", None),           # digits inside a word are not a number
    ("7/8", 8),             # fractions are not evaluated
    ("forty-two", None), ("NaN", None), ("inf", None), ("Infinity", None), ("", None), ("   ", None),
    ("1.2.3", 1.2),
])
def test_final_number_edge_cases(text: str, value: float | None):
    assert final_number(text) == value


def test_final_number_overflows_to_infinity_which_never_matches():
    assert final_number("1e999") == math.inf
    assert score(_task({"type": "number", "value": 42}), "1e999") == Score(False, "expected 42, got inf")


def test_number_scorer_uses_the_final_number():
    task = _task({"type": "number", "value": 85})
    assert score(task, "47 + 38 = 85") == Score(True, "got 85")
    assert score(task, "85? No wait, it is 86.") == Score(False, "expected 85, got 86")
    assert score(task, "eighty-five") == Score(False, "no number in answer")
    assert score(task, "") == Score(False, "no number in answer")


def test_number_tolerances():
    assert _passes({"type": "number", "value": 14.7}, "14.7")
    assert not _passes({"type": "number", "value": 14.7}, "14.70001")
    assert _passes({"type": "number", "value": 14.7, "abs_tol": 0.001}, "14.70001")
    assert _passes({"type": "number", "value": 1000, "rel_tol": 0.01}, "1,009")
    assert not _passes({"type": "number", "value": 1000, "rel_tol": 0.01}, "1,011")
    assert _passes({"type": "number", "value": 0}, "-0")


@given(st.integers(min_value=-10**12, max_value=10**12))
def test_any_integer_in_a_sentence_with_separators_is_read_back(n: int):
    assert final_number(f"Total: {n:,} units.") == n


@given(st.floats(allow_nan=False, allow_infinity=False))
def test_any_finite_float_repr_is_read_back(x: float):
    assert final_number(f"x = {x!r}") == x


# ---- exact --------------------------------------------------------------------------------

@pytest.mark.parametrize("answer", ["Paris", "paris", "  Paris.  ", "**Paris**.", '"Paris"', "`Paris`", "PARIS!",
                                    "\uff30aris"])
def test_exact_normalises_case_wrappers_and_trailing_punctuation(answer: str):
    assert _passes({"type": "exact", "answer": "Paris"}, answer)


@pytest.mark.parametrize("answer", ["Paris, France", "The capital is Paris.", "Pari", "", "Paris Paris"])
def test_exact_rejects_anything_more_or_less(answer: str):
    assert not _passes({"type": "exact", "answer": "Paris"}, answer)


def test_exact_details_case_sensitivity_and_alternatives():
    assert score(_task({"type": "exact", "answer": "Raj"}), "Tom") == Score(False, "expected 'Raj', got 'tom'")
    assert not _passes({"type": "exact", "answer": "BANANA", "case_sensitive": True}, "Banana")
    assert _passes({"type": "exact", "answer": "BANANA", "case_sensitive": True}, "BANANA.")
    spec = {"type": "exact", "answer": "Tomás Ferreira", "accept": ["Tomas Ferreira"]}
    assert _passes(spec, "tomas   ferreira") and _passes(spec, "TOMÁS FERREIRA")
    assert _passes({"type": "exact", "answer": "don't"}, "don\u2019t")
    assert _passes({"type": "exact", "answer": "a b"}, "a\n\tb")


# ---- regex --------------------------------------------------------------------------------

def test_regex_must_match_and_must_not_match():
    spec = {"type": "regex", "must_match": [r"\bjupiter\b"], "must_not_match": [r"[A-Z]"]}
    assert score(_task(spec), "  jupiter\n") == Score(True, "patterns hold")
    assert score(_task(spec), "Jupiter") == Score(False, r"no match for /\bjupiter\b/")
    assert score(_task(spec), "jupiter, not Saturn") == Score(False, "matched forbidden /[A-Z]/")


def test_regex_flags_and_anchors_apply_to_the_stripped_answer():
    assert _passes({"type": "regex", "must_match": ["^milk$"], "flags": "i"}, "\n  MILK \n")
    assert not _passes({"type": "regex", "must_match": ["^milk$"]}, "MILK")
    assert _passes({"type": "regex", "must_match": ["^b$"], "flags": "m"}, "a\nb\nc")
    assert not _passes({"type": "regex", "must_match": ["^b$"]}, "a\nb\nc")


# ---- json ---------------------------------------------------------------------------------

ONE_KEY = {"type": "json", "required": {"name": "Alice"}, "only_keys": True}


@pytest.mark.parametrize("answer", [
    '{"name": "Alice"}',
    '```json\n{\n  "name": "Alice"\n}\n```',
    'Sure! Here is the object:\n```\n{"name": "Alice"}\n```\nLet me know if you need more.',
    'Use {curly braces}: {"name": "Alice"}',
    '[1] {"name": "Alice"}',
])
def test_json_finds_the_first_object_through_fences_and_prose(answer: str):
    assert _passes(ONE_KEY, answer)


@pytest.mark.parametrize("answer, detail", [
    ('{"name": "Alice", "age": 3}', "extra key 'age'"),
    ('{"Name": "Alice"}', "missing key 'name'"),
    ('{"name": "alice"}', "key 'name': expected \"Alice\", got \"alice\""),
    ('{"name": "Alice", "name": "Alice"}', "no JSON object in answer"),
    ('{"name": "Alice",}', "no JSON object in answer"),
    ("{'name': 'Alice'}", "no JSON object in answer"),
    ('```json\n{"name": "Ali', "no JSON object in answer"),
    ("", "no JSON object in answer"),
    ('{"name": "Bob"} {"name": "Alice"}', "key 'name': expected \"Alice\", got \"Bob\""),
])
def test_json_failures_say_why(answer: str, detail: str):
    assert score(_task(ONE_KEY), answer) == Score(False, detail)


def test_json_rejects_nan_and_infinity():
    spec = {"type": "json", "keys": ["x"]}
    assert _passes(spec, '{"x": 1.5}')
    assert not _passes(spec, '{"x": NaN}')
    assert not _passes(spec, '{"x": Infinity}')
    assert not _passes(spec, '{"x": -Infinity}')


def test_json_values_compare_by_json_type():
    assert not _passes({"type": "json", "required": {"ok": True}}, '{"ok": 1}')
    assert not _passes({"type": "json", "required": {"n": 1}}, '{"n": true}')
    assert not _passes({"type": "json", "required": {"n": 31}}, '{"n": "31"}')
    assert _passes({"type": "json", "required": {"n": 31}}, '{"n": 31.0}')
    assert not _passes({"type": "json", "required": {"v": None}}, '{"v": ""}')
    assert _passes({"type": "json", "required": {"v": None}}, '{"v": null}')
    assert _passes({"type": "json", "required": {"city": "Kraków"}}, '{"city": "Krak\\u00f3w"}')


def test_json_types():
    spec = {"type": "json", "types": {"i": "integer", "n": "number", "b": "boolean", "s": "string",
                                      "a": "array", "o": "object", "z": "null"}}
    good = '{"i": 1, "n": 2.5, "b": false, "s": "", "a": [], "o": {}, "z": null}'
    assert _passes(spec, good)
    assert not _passes(spec, good.replace('"i": 1', '"i": 1.5'))
    assert not _passes(spec, good.replace('"i": 1', '"i": true'))
    assert not _passes(spec, good.replace('"n": 2.5', '"n": true'))
    assert not _passes(spec, good.replace('"b": false', '"b": 0'))


def test_json_equals_and_root():
    array = {"type": "json", "root": "array", "equals": [1, 2, 3]}
    assert _passes(array, "Sorted: [1, 2, 3].")
    assert _passes(array, '{"numbers": [1, 2, 3]}')  # the first array, wherever it is
    assert not _passes(array, "[1, 2, 3, 4]")
    assert not _passes(array, "[3, 2, 1]")
    assert not _passes({"type": "json", "root": "array", "equals": [True]}, "[1]")
    obj = {"type": "json", "equals": {"a": [1, {"b": None}]}}
    assert _passes(obj, '{"a": [1, {"b": null}]}')
    assert not _passes(obj, '{"a": [1, {"b": null, "c": 0}]}')


# ---- choice and contains_all --------------------------------------------------------------

SENTIMENT = {"type": "choice", "labels": ["positive", "negative", "neutral"], "answer": "negative"}


@pytest.mark.parametrize("answer", ["negative", "Negative.", "**NEGATIVE**", "Sentiment: negative",
                                    "negative, clearly negative"])
def test_choice_accepts_exactly_one_label(answer: str):
    assert _passes(SENTIMENT, answer)


@pytest.mark.parametrize("answer, detail", [
    ("positive", "expected 'negative', found 'positive'"),
    ("negative or neutral", "expected 'negative', found 'negative' and 'neutral'"),
    ("bad", "expected 'negative', found no label"),
    ("", "expected 'negative', found no label"),
    ("negatively", "expected 'negative', found no label"),
])
def test_choice_rejects_other_missing_or_several_labels(answer: str, detail: str):
    assert score(_task(SENTIMENT), answer) == Score(False, detail)


def test_choice_matches_longest_labels_and_whole_words():
    spam = {"type": "choice", "labels": ["spam", "not spam"], "answer": "spam"}
    assert _passes(spam, "Spam")
    assert not _passes(spam, "Not spam.")
    assert _passes({**spam, "answer": "not spam"}, "not  spam")
    grammar = {"type": "choice", "labels": ["correct", "incorrect"], "answer": "incorrect"}
    assert _passes(grammar, "Incorrect.")
    assert not _passes({**grammar, "answer": "correct"}, "incorrect")


def test_contains_all():
    spec = {"type": "contains_all", "phrases": ["red", "blue"], "forbidden": ["green"]}
    assert score(_task(spec), "Blue and RED") == Score(True, "all phrases present")
    assert score(_task(spec), "red and bluish") == Score(False, "missing 'blue'")
    assert score(_task(spec), "red, blue, green") == Score(False, "contains forbidden 'green'")


# ---- code ---------------------------------------------------------------------------------

ADD = {"type": "code", "tests": "assert add(2, 3) == 5\nassert add(-1, 1) == 0"}


@pytest.mark.parametrize("answer", [
    "def add(a, b):\n    return a + b",
    "```python\ndef add(a, b):\n    return a + b\n```",
    "Here you go:\n\n```py\ndef add(a, b):\n    return a + b\n```\n\nThis adds the numbers.",
    "```bash\npip install nothing\n```\n```python\ndef add(a, b):\n    return a + b\n```",
    "```python\ndef add(a, b):\n    return a + b\n",                               # cut off by max_tokens
    "```python\ndef add(a, b):\n    return a + b\n\nprint(add(1, 2))\n```",
])
def test_code_extracts_the_program_and_runs_the_tests(answer: str):
    assert score(_task(ADD), answer) == Score(True, "tests passed")


def test_extract_code_rules():
    assert extract_code("```\nx = 1\n```") == "x = 1\n"
    assert extract_code("```text\nnot code\n```\n```python3\nx = 2\n```") == "x = 2\n"
    assert extract_code("```js\nlet x\n```") == "let x\n"
    assert extract_code("\nx = 3\n") == "x = 3"


@pytest.mark.parametrize("answer, detail", [
    ("def add(a, b):\n    return a - b", "AssertionError"),
    ("Sure! def add(a, b): return a + b", "SyntaxError: "),
    ("", "NameError: name 'add' is not defined"),
    ("import sys\nsys.exit(0)", "exited before the tests finished"),
    ("import os\nos._exit(0)", "exited before the tests finished"),
    ('def add(a, b):\n    return a + b\n"""', "SyntaxError: unterminated triple-quoted string"),
])
def test_code_failures_say_why(answer: str, detail: str):
    result = score(_task(ADD), answer)
    assert not result.passed and result.detail.startswith(detail)


def test_code_timeout_is_a_failure():
    spec = {**ADD, "timeout_s": 1.0}
    assert score(_task(spec), "while True:\n    pass") == Score(False, "timed out after 1s")


# ---- scorer specs -------------------------------------------------------------------------

@pytest.mark.parametrize("spec, message", [
    ({"type": "fuzzy"}, "unknown scorer type 'fuzzy'"),
    ({"value": 3}, "scorer must be an object with a 'type'"),
    ({"type": "number"}, "number scorer: missing parameter 'value'"),
    ({"type": "number", "value": 3, "tolerance": 1}, "number scorer: unknown parameter 'tolerance'"),
    ({"type": "number", "value": "3"}, "number scorer: value: Input should be a valid number"),
    ({"type": "number", "value": math.nan}, "number scorer: value must be finite"),
    ({"type": "number", "value": 1, "abs_tol": -1}, "number scorer: abs_tol:"),
    ({"type": "regex"}, "regex scorer: needs must_match or must_not_match"),
    ({"type": "regex", "must_match": ["("]}, "regex scorer: bad pattern '('"),
    ({"type": "regex", "must_match": ["a"], "flags": "g"}, "regex scorer: flags:"),
    ({"type": "json"}, "json scorer: needs equals, keys, required, types or only_keys"),
    ({"type": "json", "equals": [1], "keys": ["a"]}, "json scorer: equals already fixes the keys"),
    ({"type": "json", "root": "array", "keys": ["a"]}, "json scorer: key checks need root 'object'"),
    ({"type": "json", "types": {"a": "float"}}, "json scorer: types.a:"),
    ({"type": "choice", "labels": ["a", "b"], "answer": "c"}, "choice scorer: answer 'c' is not one of the labels"),
    ({"type": "choice", "labels": ["Yes", "yes"], "answer": "yes"}, "choice scorer: labels must differ"),
    ({"type": "choice", "labels": ["a"], "answer": "a"}, "choice scorer: labels:"),
    ({"type": "contains_all", "phrases": []}, "contains_all scorer: phrases:"),
    ({"type": "code", "tests": "assert True", "timeout_s": 0}, "code scorer: timeout_s:"),
    ({"type": "exact", "answer": 4}, "exact scorer: answer: Input should be a valid string"),
])
def test_bad_scorer_specs_give_one_line_errors(spec: dict[str, Any], message: str):
    with pytest.raises(ScorerSpecError) as caught:
        parse_scorer(spec)
    assert str(caught.value).startswith(message)
    assert "\n" not in str(caught.value)


# ---- validate_tasks -----------------------------------------------------------------------

def test_validate_tasks_reports_failing_references_and_passing_counterexamples():
    tasks = [
        _task({"type": "number", "value": 4}, reference="4", counterexamples=("5",)),
        QevalTask(id="unit_02", category="unit", messages=({"role": "user", "content": "?"},), max_tokens=8,
                  scorer={"type": "exact", "answer": "yes"}, reference="no", counterexamples=("Yes.", "nope")),
    ]
    assert validate_tasks(tasks) == [
        "unit_02: reference fails (expected 'yes', got 'no')",
        "unit_02: counterexample 1 passes (matched 'yes')",
    ]
