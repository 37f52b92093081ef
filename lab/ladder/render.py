"""From a ladder to concrete arms (base + one change, with a config hash) and the ordered boot slots.

Each window boots its control, then its arms in order, then its control again, so every arm is
bracketed by warm reboots of the unchanged base. With `repeats: n` the arms are booted n times,
interleaved with controls (C A B C A B C): the boot is the unit of replication, and every arm boot
has a control on each side to interpolate the drift between. A window with no arms has nothing to
bracket: its control is booted `repeats` times (C, or C C C for 3), so a ladder of one control is one
measured boot. An optional warm-up boot comes first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from lab.ladder.engines import env_value, kind_of
from lab.ladder.ladder import Arm, Ladder

Role = Literal["warmup", "control", "arm"]
Position = Literal["warmup", "open", "arm", "between", "close"]


@dataclass(frozen=True)
class ArmSpec:
    name: str
    role: Literal["control", "arm"]
    window: str
    change: dict[str, dict[str, Any]]  # {"flags": {...}, "env": {...}}; empty for a control
    multi: bool
    flags: dict[str, Any]  # base flags updated by the change
    env: dict[str, str]  # base env updated by the change, rendered to strings
    config: dict[str, Any]  # what the hash covers: effective knobs (bundled) or command recipe
    config_hash: str


@dataclass(frozen=True)
class SlotSpec:
    idx: int
    arm: str
    role: Role
    position: Position
    window: str | None


@dataclass(frozen=True)
class Plan:
    arms: list[ArmSpec]
    slots: list[SlotSpec] = field(default_factory=list)

    def arm(self, name: str) -> ArmSpec:
        return next(a for a in self.arms if a.name == name)


def merged(ladder: Ladder, arm: Arm | None) -> tuple[dict[str, Any], dict[str, str]]:
    flags = dict(ladder.engine.flags)
    env = {k: env_value(v) for k, v in ladder.engine.env.items()}
    if arm is not None:
        flags.update(arm.flags)
        env.update({k: env_value(v) for k, v in arm.env.items()})
    return flags, env


def arm_spec(ladder: Ladder, window: str, arm: Arm | None, control_name: str) -> ArmSpec:
    flags, env = merged(ladder, arm)
    config, digest = kind_of(ladder.engine).config(flags, env)
    change = {"flags": dict(arm.flags), "env": {k: env_value(v) for k, v in arm.env.items()}} if arm else {}
    return ArmSpec(name=arm.name if arm else control_name, role="arm" if arm else "control", window=window,
                   change=change, multi=bool(arm and arm.multi), flags=flags, env=env, config=config,
                   config_hash=digest)


def plan(ladder: Ladder) -> Plan:
    """Arms and boot slots of a ladder that `lab.ladder.validate` accepted."""
    arms: list[ArmSpec] = []
    slots: list[SlotSpec] = []

    def slot(arm: str, role: Role, position: Position, window: str | None) -> None:
        slots.append(SlotSpec(len(slots), arm, role, position, window))

    for w_index, window in enumerate(ladder.windows):
        control = window.control_name
        arms.append(arm_spec(ladder, window.name, None, control))
        if w_index == 0:
            for name in ladder.hygiene.warmup_names(control):
                slot(name, "warmup", "warmup", None)
        slot(control, "control", "open", window.name)
        if not window.arms:
            for repeat in range(1, ladder.repeats):
                slot(control, "control", "close" if repeat == ladder.repeats - 1 else "between", window.name)
            continue
        for arm in window.arms:
            arms.append(arm_spec(ladder, window.name, arm, control))
        for repeat in range(ladder.repeats):
            if repeat:
                slot(control, "control", "between", window.name)
            for arm in window.arms:
                slot(arm.name, "arm", "arm", window.name)
        slot(control, "control", "close", window.name)
    return Plan(arms, slots)
