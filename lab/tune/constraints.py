"""A tune's constraints as Optuna reads them and as a person reads them: each trial stores, per
constraint, how far it is violated (`Trial.set_constraint`: <= 0 satisfied; user attribute
`constraints`) and the figure it measured (user attribute `constraint_values`), so the study's
report can say why an infeasible trial is infeasible."""

from __future__ import annotations

from collections.abc import Sequence

from lab.ladder.ladder import Gate

VIOLATIONS = "constraints"  # trial user attribute: each constraint's violation (<= 0: satisfied)
FIGURES = "constraint_values"  # trial user attribute: each constraint's measured figure (None: no value)


def key(gate: Gate) -> str:
    """The constraint's name: its metric, with its `where` when it has one."""
    where = ",".join(f"{k}={v}" for k, v in sorted(gate.where.items()))
    return gate.metric + (f"[{where}]" if where else "")


def bounds(gate: Gate) -> str:
    """`>= 1, <= 2`, as the constraint states them."""
    return ", ".join(([f">= {gate.min:g}"] if gate.min is not None else [])
                     + ([f"<= {gate.max:g}"] if gate.max is not None else []))


def violation(gate: Gate, value: float) -> float:
    """How far `value` is outside the gate's bounds (<= 0: inside), as Optuna's constraints read it."""
    return max(gate.min - value if gate.min is not None else float("-inf"),
               value - gate.max if gate.max is not None else float("-inf"))


def broken(gates: Sequence[Gate], figures: Sequence[float | None]) -> str:
    """Each constraint the figures break, as `metric = value > max 2`; empty when all hold."""
    found = []
    for gate, value in zip(gates, figures):
        if value is None:
            found.append(f"{key(gate)}: no value")
        elif gate.max is not None and value > gate.max:
            found.append(f"{key(gate)} = {value:.4g} > max {gate.max:g}")
        elif gate.min is not None and value < gate.min:
            found.append(f"{key(gate)} = {value:.4g} < min {gate.min:g}")
    return "; ".join(found)
