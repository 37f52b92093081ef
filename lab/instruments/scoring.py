"""Deterministic scorers for qeval answers, and the self-check that guards them.

A task's `scorer` is a dict whose `type` picks one of the rules below; the other keys are that
rule's parameters (unknown keys are errors, so a typo cannot silently weaken a task).

Text normalisation (`exact`, `choice`, `contains_all`): Unicode NFKC, curly quotes made
straight, runs of whitespace made one space, and case folded unless `case_sensitive`; `exact`
also peels, repeatedly, quotes / backticks / `*` / `_` that wrap the whole answer and trailing
`. , ; : ! ?`, so `**Paris**.` equals `Paris`.

- exact: the normalised answer equals the normalised `answer` or one of `accept`.
- number: the answer's value is its *final* number: `The answer is 42.` gives 42 and
  `47 + 38 = 114` gives 114. A number is ASCII digits (fullwidth digits count) with an optional
  sign written right before it (`-`, `+`, `−`) unless the sign follows a letter or digit, so
  `10-3` is 10 then 3; commas join digits only in groups of three (`1,234,567`; `3,14` is 3 then
  14); an optional `.digits` fraction and `e±digits` exponent. Digits inside a word (`H2O`,
  `v2`) are not numbers; units, `%` and currency symbols are ignored; words (`forty`, `NaN`,
  `inf`) are not numbers. Passes when |got − value| ≤ max(abs_tol, rel_tol·|value|).
- regex: on the answer stripped of outer whitespace, every `must_match` pattern is found
  (re.search, `flags` from "imsx") and no `must_not_match` pattern is.
- json: the first JSON value in the answer that parses (scanning from each `{`, or only `{` /
  `[` when `root` says object / array, so fences and surrounding prose do not matter). Strict
  JSON: no NaN/Infinity, no duplicate keys. Checks: `equals` (the whole value), `keys` present,
  `required` key values, `types` of key values, and `only_keys` (no keys beyond those named).
  Values compare by JSON type: true is not 1, "31" is not 31, 31.0 is 31.
- choice: the labels found in the normalised answer as whole words (longest label first, so
  "not spam" is not also "spam"); passes when exactly one distinct label is found and it is
  `answer`. Negation is not understood: prompts ask for the label alone.
- contains_all: every `phrases` entry occurs as whole words, no `forbidden` entry does.
- code: the first fenced block (a `python`/`py` block preferred; an unclosed fence runs to the
  end) or else the whole answer, followed by the task's `tests` and a random marker print, runs
  in the sandbox; passes when it exits 0 in time and the marker is the last line printed, so an
  answer that exits early does not pass.
"""

from __future__ import annotations

import json
import math
import re
import secrets
import unicodedata
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Callable, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from lab.instruments.sandbox import run_python

if TYPE_CHECKING:
    from lab.instruments.qeval_task import QevalTask


@dataclass(frozen=True)
class Score:
    passed: bool
    detail: str
    """Why, in a few words: "expected 42, got 41"."""


class ScorerSpecError(ValueError):
    """A scorer dict that cannot be used; the message is one line."""


_QUOTES = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"'})
_WRAPPERS = "\"'`*_"
_TRAILING = ".,;:!?"


def normalize(text: str, case_sensitive: bool = False) -> str:
    text = " ".join(unicodedata.normalize("NFKC", text).translate(_QUOTES).split())
    return text if case_sensitive else text.casefold()


def _peel(text: str) -> str:
    while True:
        before = text
        text = text.strip().rstrip(_TRAILING).strip()
        if len(text) >= 2 and text[0] == text[-1] and text[0] in _WRAPPERS:
            text = text[1:-1]
        if text == before:
            return text


def _whole_words(phrases: list[str]) -> re.Pattern[str]:
    alternatives = "|".join(re.escape(p) for p in sorted(phrases, key=len, reverse=True))
    return re.compile(rf"(?<!\w)(?:{alternatives})(?!\w)")


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class ExactSpec(_Spec):
    type: Literal["exact"]
    answer: str
    accept: list[str] = []
    case_sensitive: bool = False

    def score(self, answer: str) -> Score:
        got = _peel(normalize(answer, self.case_sensitive))
        wanted = [_peel(normalize(a, self.case_sensitive)) for a in [self.answer, *self.accept]]
        if got in wanted:
            return Score(True, f"matched {got!r}")
        return Score(False, f"expected {self.answer!r}, got {_short(got)!r}")


_MINUS = str.maketrans({"\u2212": "-", "\uff0d": "-", "\uff0b": "+"} |
                       {chr(0xFF10 + d): str(d) for d in range(10)})
_NUMBER = re.compile(r"""
    (?<![\w.])                                # not inside a word, not after a decimal point
    ([-+]?)                                   # a sign only when written right before the digits
    ([0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)         # digits, commas only between groups of three
    (\.[0-9]+)?                               # fraction
    ([eE][-+]?[0-9]+)?                        # exponent
    (?![0-9])
""", re.VERBOSE)


def final_number(text: str) -> float | None:
    """The last number in `text` under the rule above, or None when there is none."""
    matches = list(_NUMBER.finditer(text.translate(_MINUS)))
    if not matches:
        return None
    sign, digits, fraction, exponent = matches[-1].groups()
    return float(sign + digits.replace(",", "") + (fraction or "") + (exponent or ""))


class NumberSpec(_Spec):
    type: Literal["number"]
    value: float
    abs_tol: float = Field(default=0.0, ge=0)
    rel_tol: float = Field(default=0.0, ge=0)

    @model_validator(mode="after")
    def _finite(self) -> NumberSpec:
        if not math.isfinite(self.value):
            raise ValueError("value must be finite")
        return self

    def score(self, answer: str) -> Score:
        got = final_number(answer)
        if got is None:
            return Score(False, "no number in answer")
        if abs(got - self.value) <= max(self.abs_tol, self.rel_tol * abs(self.value)):
            return Score(True, f"got {_num(got)}")
        return Score(False, f"expected {_num(self.value)}, got {_num(got)}")


class RegexSpec(_Spec):
    type: Literal["regex"]
    must_match: list[str] = []
    must_not_match: list[str] = []
    flags: str = Field(default="", pattern=r"^[imsx]*$")

    @model_validator(mode="after")
    def _compiles(self) -> RegexSpec:
        if not self.must_match and not self.must_not_match:
            raise ValueError("needs must_match or must_not_match")
        for pattern in [*self.must_match, *self.must_not_match]:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"bad pattern {pattern!r}: {exc}") from None
        return self

    def score(self, answer: str) -> Score:
        text = answer.strip()
        flags = 0
        for letter in self.flags:
            flags |= getattr(re, letter.upper())
        for pattern in self.must_match:
            if not re.search(pattern, text, flags):
                return Score(False, f"no match for /{pattern}/")
        for pattern in self.must_not_match:
            if re.search(pattern, text, flags):
                return Score(False, f"matched forbidden /{pattern}/")
        return Score(True, "patterns hold")


_JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
               "array": (list,), "object": (dict,), "null": (type(None),)}
_NO_VALUE = object()


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError("duplicate key")
    return dict(pairs)


_DECODER = json.JSONDecoder(parse_constant=_reject_constant, object_pairs_hook=_no_duplicates)


def _first_json(text: str, root: str | None) -> Any:
    """The first JSON value that parses at a `{` (or `[`) in `text`; `_NO_VALUE` when none does."""
    starts = {"object": "{", "array": "["}.get(root or "", "{[")
    for i, char in enumerate(text):
        if char in starts:
            try:
                return _DECODER.raw_decode(text, i)[0]
            except ValueError:
                continue
    return _NO_VALUE


def _same_json(a: Any, b: Any) -> bool:
    """Equality by JSON type: booleans are not numbers, ints equal floats of the same value."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same_json(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_json(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _json_type_is(value: Any, name: str) -> bool:
    if name in ("integer", "number") and isinstance(value, bool):
        return False
    return isinstance(value, _JSON_TYPES[name])


class JsonSpec(_Spec):
    type: Literal["json"]
    root: Literal["object", "array"] | None = None
    equals: Any = None
    keys: list[str] = []
    required: dict[str, Any] = {}
    types: dict[str, Literal["string", "integer", "number", "boolean", "array", "object", "null"]] = {}
    only_keys: bool = False

    @model_validator(mode="after")
    def _consistent(self) -> JsonSpec:
        checks_keys = bool(self.keys or self.required or self.types or self.only_keys)
        if self.equals is None and not checks_keys:
            raise ValueError("needs equals, keys, required, types or only_keys")
        if self.equals is not None and checks_keys:
            raise ValueError("equals already fixes the keys; drop keys/required/types/only_keys")
        if checks_keys and self.root == "array":
            raise ValueError("key checks need root 'object'")
        return self

    def score(self, answer: str) -> Score:
        root = self.root or ("object" if self.equals is None else None)
        value = _first_json(answer, root)
        if value is _NO_VALUE:
            return Score(False, f"no JSON {root or 'value'} in answer")
        if self.equals is not None:
            if _same_json(value, self.equals):
                return Score(True, "value matches")
            return Score(False, f"expected {_short(json.dumps(self.equals))}, got {_short(json.dumps(value))}")
        for key in [*self.keys, *self.required, *self.types]:
            if key not in value:
                return Score(False, f"missing key {key!r}")
        for key, wanted in self.required.items():
            if not _same_json(value[key], wanted):
                return Score(False, f"key {key!r}: expected {_short(json.dumps(wanted))}, "
                                    f"got {_short(json.dumps(value[key]))}")
        for key, name in self.types.items():
            if not _json_type_is(value[key], name):
                return Score(False, f"key {key!r}: expected {name}, got {_short(json.dumps(value[key]))}")
        if self.only_keys:
            extra = sorted(set(value) - {*self.keys, *self.required, *self.types})
            if extra:
                return Score(False, f"extra key {extra[0]!r}")
        return Score(True, "object matches")


class ChoiceSpec(_Spec):
    type: Literal["choice"]
    labels: list[str] = Field(min_length=2)
    answer: str
    case_sensitive: bool = False

    @model_validator(mode="after")
    def _answer_is_label(self) -> ChoiceSpec:
        normalised = [normalize(label, self.case_sensitive) for label in self.labels]
        if len(set(normalised)) != len(normalised):
            raise ValueError("labels must differ after normalisation")
        if self.answer not in self.labels:
            raise ValueError(f"answer {self.answer!r} is not one of the labels")
        return self

    def score(self, answer: str) -> Score:
        by_form = {normalize(label, self.case_sensitive): label for label in self.labels}
        found = sorted({by_form[m] for m in _whole_words(list(by_form)).findall(
            normalize(answer, self.case_sensitive))})
        if found == [self.answer]:
            return Score(True, f"label {self.answer!r}")
        if not found:
            return Score(False, f"expected {self.answer!r}, found no label")
        return Score(False, f"expected {self.answer!r}, found {' and '.join(map(repr, found))}")


class ContainsAllSpec(_Spec):
    type: Literal["contains_all"]
    phrases: list[str] = Field(min_length=1)
    forbidden: list[str] = []
    case_sensitive: bool = False

    def score(self, answer: str) -> Score:
        text = normalize(answer, self.case_sensitive)
        for phrase in self.phrases:
            if not _whole_words([normalize(phrase, self.case_sensitive)]).search(text):
                return Score(False, f"missing {phrase!r}")
        for phrase in self.forbidden:
            if _whole_words([normalize(phrase, self.case_sensitive)]).search(text):
                return Score(False, f"contains forbidden {phrase!r}")
        return Score(True, "all phrases present")


_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)


def extract_code(answer: str) -> str:
    """The code an answer gives: a python (or else the first) fenced block, or the whole answer."""
    blocks = _FENCE.findall(answer)
    if not blocks:
        return answer.strip("\n")
    for language, body in blocks:
        if language.lower() in ("python", "py", "python3"):
            return body
    return blocks[0][1]


class CodeSpec(_Spec):
    type: Literal["code"]
    tests: str = Field(min_length=1)
    timeout_s: float = Field(default=5.0, gt=0, le=30)
    memory_mb: int = Field(default=256, ge=64, le=2048)

    def score(self, answer: str) -> Score:
        marker = f"qeval-tests-passed-{secrets.token_hex(8)}"
        program = f"{extract_code(answer)}\n\n{self.tests}\n\nprint({marker!r})\n"
        result = run_python(program, timeout_s=self.timeout_s, memory_mb=self.memory_mb)
        if result.timed_out:
            return Score(False, f"timed out after {self.timeout_s:g}s")
        lines = result.stdout.splitlines()
        if result.ok and lines and lines[-1] == marker:
            return Score(True, "tests passed")
        if result.returncode == 0:
            return Score(False, "exited before the tests finished")
        errors = [line for line in result.stderr.splitlines() if line.strip()]
        return Score(False, _short(errors[-1]) if errors else f"exit status {result.returncode}")


ScorerSpec = Annotated[Union[ExactSpec, NumberSpec, RegexSpec, JsonSpec, ChoiceSpec, ContainsAllSpec,
                             CodeSpec], Field(discriminator="type")]
_SPEC = TypeAdapter(ScorerSpec)


def parse_scorer(spec: dict[str, Any]) -> ScorerSpec:
    """The typed scorer for a task's `scorer` dict; ScorerSpecError (one line) when unusable."""
    try:
        return _SPEC.validate_python(spec)
    except ValidationError as exc:
        raise ScorerSpecError(_one_line(exc)) from None


def _one_line(exc: ValidationError) -> str:
    error = exc.errors()[0]
    kind, loc = error["type"], error["loc"]
    if kind == "union_tag_invalid":
        return f"unknown scorer type {error['ctx']['tag']!r} (known: {error['ctx']['expected_tags']})"
    if kind in ("union_tag_not_found", "model_attributes_type"):
        return "scorer must be an object with a 'type'"
    where = f"{loc[0]} scorer"
    field = ".".join(str(part) for part in loc[1:])
    if kind == "missing":
        return f"{where}: missing parameter {field!r}"
    if kind == "extra_forbidden":
        return f"{where}: unknown parameter {field!r}"
    message = error["msg"].removeprefix("Value error, ")
    return f"{where}: {field}: {message}" if field else f"{where}: {message}"


def score(task: QevalTask, answer: str) -> Score:
    return parse_scorer(task.scorer).score(answer)


def validate_tasks(tasks: list[QevalTask], scorer: Callable[[QevalTask, str], Score] = score) -> list[str]:
    """Problems with a task set under `scorer`: references that fail, counterexamples that pass."""
    problems = []
    for task in tasks:
        result = scorer(task, task.reference)
        if not result.passed:
            problems.append(f"{task.id}: reference fails ({result.detail})")
        for number, counterexample in enumerate(task.counterexamples, start=1):
            result = scorer(task, counterexample)
            if result.passed:
                problems.append(f"{task.id}: counterexample {number} passes ({result.detail})")
    return problems


def _num(x: float) -> str:
    return str(int(x)) if x.is_integer() and abs(x) < 1e15 else repr(x)


def _short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"
