"""The window's opening control and what it stored: the reference that paired instruments
(`qeval`, `agreement`) compare every later boot of the window against.

The reference is the earliest warm control boot measured before this one
(`BootContext.control_boot_ids[0]`). Arms and the closing control are all compared with that one
boot, so every arm of a window is judged against the same rows and the closing control measures
how far the unchanged config moved against itself. Rows are read by the control's slot, not its
boot, because a resumed slot keeps the steps an earlier attempt of it stored.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lab.instruments.base import BootContext
from lab.store.rows import QevalItemRecord, RequestRecord


@dataclass(frozen=True)
class Reference:
    """One instrument's rows on the opening control, or why there are none to compare with."""

    boot_id: int | None
    items: list[QevalItemRecord] = field(default_factory=list)
    requests: list[RequestRecord] = field(default_factory=list)
    problem: str | None = None  # set when this cannot serve as a reference


def is_opening_control(ctx: BootContext) -> bool:
    """Whether this boot is the reference itself. A closing control whose opening control failed
    is not: it is reported as having nothing to compare with."""
    return ctx.role == "control" and ctx.position == "open"


def load_reference(ctx: BootContext, instrument: str) -> Reference:
    """The opening control's stored rows of `instrument` (its steps that completed, in order)."""
    if not ctx.control_boot_ids:
        return Reference(None, problem=f"no warm control of window {ctx.window} was measured before this boot")
    boot_id = ctx.control_boot_ids[0]
    rows = ctx.stored.boot_slot_steps(boot_id, instrument)
    if not any(step.status == "ok" for step in rows.steps):
        failed = "; ".join(f"{step.key}: {step.error}" for step in rows.steps)
        why = f"its {instrument} step failed ({failed})" if rows.steps else f"it stored no {instrument} step"
        return Reference(boot_id, problem=f"the opening control (boot {boot_id}) has no reference: {why}")
    return Reference(boot_id, items=rows.items, requests=rows.requests)
