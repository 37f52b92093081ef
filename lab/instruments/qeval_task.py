"""A qeval task (one prompt with its deterministic scorer and self-check answers) and the loader
of task files: JSON Lines, one task object per line, validated field by field."""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from lab.instruments.scoring import ScorerSpecError, parse_scorer

_ID = re.compile(r"^[a-z][a-z0-9]*(?:_[a-z0-9]+)+$")
_CATEGORY = re.compile(r"^[a-z][a-z_]*$")
_ROLES = ("system", "user", "assistant")
_MAX_TOKENS_CAP = 1024
_FIELDS: dict[str, type] = {"id": str, "category": str, "messages": list, "max_tokens": int, "scorer": dict,
                            "reference": str, "counterexamples": list, "notes": str}
_OPTIONAL = {"notes"}
_JSON_NAMES = {str: "string", list: "array", int: "integer", dict: "object"}


class TaskFileError(ValueError):
    """A task file that cannot be used; the message names the file and line."""


@dataclass(frozen=True)
class QevalTask:
    id: str
    """Stable across edits (`arith_07`), so runs months apart pair up task by task."""
    category: str
    messages: tuple[dict[str, str], ...]
    """Chat messages as sent, each {"role", "content"}; the last is the user's."""
    max_tokens: int
    scorer: dict[str, Any]
    """`type` plus that scorer's parameters; see lab.instruments.scoring."""
    reference: str
    """A gold answer the scorer must pass."""
    counterexamples: tuple[str, ...]
    """Plausible wrong answers the scorer must fail."""
    notes: str = ""


def default_task_path() -> Path:
    return Path(str(importlib.resources.files("lab.instruments") / "qeval_tasks.jsonl"))


def load_tasks(path: Path | None = None) -> list[QevalTask]:
    """Every task in `path` (default: the shipped set); TaskFileError naming the line otherwise."""
    path = path or default_task_path()
    tasks: list[QevalTask] = []
    first_line: dict[str, int] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            task = _parse(line)
        except ValueError as exc:
            raise TaskFileError(f"{path.name} line {number}: {exc}") from None
        if task.id in first_line:
            raise TaskFileError(f"{path.name} line {number}: duplicate id {task.id!r} "
                                f"(first on line {first_line[task.id]})")
        first_line[task.id] = number
        tasks.append(task)
    if not tasks:
        raise TaskFileError(f"{path.name}: no tasks")
    return tasks


def _parse(line: str) -> QevalTask:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    for name in _FIELDS:
        if name not in record and name not in _OPTIONAL:
            raise ValueError(f"missing field {name!r}")
    for name, value in record.items():
        if name not in _FIELDS:
            raise ValueError(f"unknown field {name!r}")
        wanted = _FIELDS[name]
        if not isinstance(value, wanted) or (wanted is int and isinstance(value, bool)):
            raise ValueError(f"field {name!r} must be a JSON {_JSON_NAMES[wanted]}")
    task_id = record["id"]
    if not _ID.match(task_id):
        raise ValueError(f"id {task_id!r} must look like 'arith_07' (lowercase words and digits joined by _)")
    if not _CATEGORY.match(record["category"]):
        raise ValueError(f"{task_id}: category {record['category']!r} must be a lowercase word")
    messages = tuple(_message(task_id, m) for m in record["messages"])
    if not messages or messages[-1]["role"] != "user":
        raise ValueError(f"{task_id}: messages must end with a user message")
    if not 1 <= record["max_tokens"] <= _MAX_TOKENS_CAP:
        raise ValueError(f"{task_id}: max_tokens must be between 1 and {_MAX_TOKENS_CAP}")
    try:
        parse_scorer(record["scorer"])
    except ScorerSpecError as exc:
        raise ValueError(f"{task_id}: {exc}") from None
    counterexamples = record["counterexamples"]
    if not counterexamples or not all(isinstance(c, str) for c in counterexamples):
        raise ValueError(f"{task_id}: counterexamples must be a non-empty list of strings")
    return QevalTask(id=task_id, category=record["category"], messages=messages,
                     max_tokens=record["max_tokens"], scorer=record["scorer"], reference=record["reference"],
                     counterexamples=tuple(counterexamples), notes=record.get("notes", ""))



def _message(task_id: str, message: Any) -> dict[str, str]:
    if (not isinstance(message, dict) or set(message) != {"role", "content"}
            or message["role"] not in _ROLES or not isinstance(message["content"], str)):
        raise ValueError(f"{task_id}: each message must be {{\"role\": one of {'/'.join(_ROLES)}, "
                         f"\"content\": string}}")
    return {"role": message["role"], "content": message["content"]}


def task_set_hash(tasks: Iterable[QevalTask]) -> str:
    """sha256 over what decides a task's row: id, category, messages, max_tokens and scorer.

    Order-independent (sorted by id). The reference, counterexamples and notes are left out:
    they check the scorers and never reach the engine or change a score.
    """
    canonical = [{"id": t.id, "category": t.category, "messages": list(t.messages),
                  "max_tokens": t.max_tokens, "scorer": t.scorer}
                 for t in sorted(tasks, key=lambda t: t.id)]
    return hashlib.sha256(json.dumps(canonical, sort_keys=True, ensure_ascii=False,
                                     separators=(",", ":")).encode("utf-8")).hexdigest()
