"""What the store is handed to write: an instrument's planned step and what running it produced, and
the shape of the run plan it records.

Instruments build these and the runner passes them to `lab.store.writer`; the store defines them so
it needs nothing from the packages that use it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

# Attribute names read from each receipt (lab.instruments.receipt.Receipt); absent ones are stored as NULL.
RECEIPT_FIELDS = ("endpoint", "status", "error", "t_queued_ns", "t_sent_ns", "t_first_ns", "t_last_ns", "t_done_ns",
                  "token_times_ns", "prompt_tokens", "completion_tokens", "cached_tokens", "text", "finish_reason",
                  "payload", "response", "request_id", "response_id", "chunk_tokens", "usage_present",
                  "cached_tokens_present", "reasoning_text", "logprobs", "opened_connection", "read_lag_max_ns",
                  "unvouched", "usage_counted_by")


@dataclass(frozen=True)
class Step:
    key: str  # unique within the instrument's plan, stable across calls: "len=2048/rep=2"
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class Cell:
    metric: str
    value: float | None
    unit: str
    params: dict[str, Any] = field(default_factory=dict)
    repeat: int = 0
    valid: bool = True
    note: str = ""
    requests: list[int] | None = None  # indexes into StepResult.receipts; None = all of the step's


@dataclass
class QevalItem:
    task: str
    passed: bool
    score: float | None = None
    category: str = ""
    scorer: str = ""
    output: str | None = None
    expected: str | None = None
    request: int | None = None  # index into StepResult.receipts
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass
class StepResult:
    cells: list[Cell] = field(default_factory=list)
    # Each a lab.instruments.receipt.Receipt; the writer reads only the attributes in RECEIPT_FIELDS.
    receipts: list[Any] = field(default_factory=list)
    items: list[QevalItem] = field(default_factory=list)


class PlannedArm(Protocol):
    """An arm as the run plan states it (lab.ladder.render.ArmSpec)."""

    name: str
    role: str
    window: str
    change: dict[str, dict[str, Any]]
    multi: bool
    flags: dict[str, Any]
    env: dict[str, str]
    config: dict[str, Any]
    config_hash: str


class PlannedSlot(Protocol):
    """A planned boot (lab.ladder.render.SlotSpec)."""

    idx: int
    arm: str
    role: str
    position: str
    window: str | None


class RunPlan(Protocol):
    """The plan a run is created with (lab.ladder.render.Plan)."""

    @property
    def arms(self) -> Sequence[PlannedArm]: ...

    @property
    def slots(self) -> Sequence[PlannedSlot]: ...
