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

from lab.ladder.engines import Recipe, env_value, kind_of
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
    recipe: Recipe  # the engine it boots: the ladder's, or an engine arm's own


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


def recipe_of(ladder: Ladder, arm: Arm | None) -> Recipe:
    """The engine an arm boots: its own where it names one, else the ladder's."""
    return arm.engine if arm is not None and arm.engine is not None else ladder.engine


def merged(ladder: Ladder, arm: Arm | None) -> tuple[dict[str, Any], dict[str, str]]:
    """The flags and env an arm boots with: the ladder engine's with the arm's change, or an engine
    arm's own engine's."""
    recipe = recipe_of(ladder, arm)
    flags = dict(recipe.flags)
    env = {k: env_value(v) for k, v in recipe.env.items()}
    if arm is not None and arm.engine is None:
        flags.update(arm.flags)
        env.update({k: env_value(v) for k, v in arm.env.items()})
    return flags, env


def arm_spec(ladder: Ladder, window: str, arm: Arm | None, control_name: str) -> ArmSpec:
    flags, env = merged(ladder, arm)
    recipe = recipe_of(ladder, arm)
    kind = kind_of(recipe)
    config, digest = kind.config(flags, env)
    if arm is not None and arm.engine is not None:
        change: dict[str, dict[str, Any]] = {"engine": {"engine": kind.label()}}
    else:
        change = {"flags": dict(arm.flags), "env": {k: env_value(v) for k, v in arm.env.items()}} if arm else {}
    return ArmSpec(name=arm.name if arm else control_name, role="arm" if arm else "control", window=window,
                   change=change, multi=bool(arm and arm.multi), flags=flags, env=env, config=config,
                   config_hash=digest, recipe=recipe)


def engine_windows(ladder: Ladder) -> set[str]:
    """The windows with an engine arm: their engines are sent the same prompts (`prompt_seed`)."""
    return {window.name for window in ladder.windows if any(arm.engine is not None for arm in window.arms)}


def prompt_seed(ladder: Ladder, plan: Plan, slot_idx: int) -> str | None:
    """What seeds the prompts of a boot in a window with an engine arm, or None where each boot
    seeds its own (every other boot). Every arm boot of repeat r shares it with the control boot
    that opens repeat r, so every engine of the window is sent the same prompt texts (the arm repeats
    that control's, `lab.instruments.shared_prompts`); the closing control keeps its own
    seed, so no control boot is sent another control boot's prompts (a persistent prefix cache
    would serve it)."""
    if slot_idx >= len(plan.slots):  # a slot added after planning: a cold tune trial booted again
        return None
    slot = plan.slots[slot_idx]
    if slot.window not in engine_windows(ladder) or slot.position == "close":
        return None
    repeat = sum(1 for s in plan.slots[:slot_idx + 1]
                 if s.window == slot.window and s.role == "control" and s.position in ("open", "between")) - 1
    return f"{slot.window}/{repeat}"


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
