"""From a ladder to concrete arms (base + one change, with a config hash) and the ordered boot slots.

Each window boots its control, then its arms in order, then its control again, so every arm is
bracketed by warm reboots of the unchanged base. With `repeats: n` the arms are booted n times,
interleaved with controls (C A B C A B C): the boot is the unit of replication, and every arm boot
has a control on each side to interpolate the drift between. An optional warm-up boot comes first.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Literal

from lab.engine import settings as engine_settings
from lab.ladder.ladder import Arm, BundledEngine, CommandEngine, Ladder

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


def env_value(value: Any) -> str:
    """Environment values are strings; booleans become 1/0, the convention engines read."""
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def merged(ladder: Ladder, arm: Arm | None) -> tuple[dict[str, Any], dict[str, str]]:
    flags = dict(ladder.engine.flags)
    env = {k: env_value(v) for k, v in ladder.engine.env.items()}
    if arm is not None:
        flags.update(arm.flags)
        env.update({k: env_value(v) for k, v in arm.env.items()})
    return flags, env


def bundled_config(engine: BundledEngine, flags: dict[str, Any], env: dict[str, str]) -> engine_settings.EngineConfig:
    """The config the bundled engine will compute from this argv and environment (raises ConfigError)."""
    return engine_settings.from_sources({**flags, "model": engine.model}, env)


def command_recipe(engine: CommandEngine, flags: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    return {"command": list(engine.command), "model": engine.model, "served_model_name": engine.served_model_name,
            "flags": render_command_flags(engine, flags), "env": env}


def recipe_hash(recipe: dict[str, Any]) -> str:
    blob = json.dumps(recipe, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def render_command_flags(engine: CommandEngine, flags: dict[str, Any]) -> list[str]:
    parts = engine.flag_style.split()
    prefix = parts[0].split("{name}")[0] if parts else "--"
    argv: list[str] = []
    for name, value in flags.items():
        if isinstance(value, bool) and engine.bool_style != "value":
            if value:
                argv.append(prefix + name)
            elif engine.bool_style == "negatable":
                argv.append(prefix + "no-" + name)
            continue
        for part in parts:
            if "{value}" not in part:
                argv.append(part.replace("{name}", name))
            elif isinstance(value, list) and part == "{value}":
                argv += [_scalar(v) for v in value]  # a separate value argument: nargs-style list
            else:
                text = ",".join(_scalar(v) for v in value) if isinstance(value, list) else _scalar(value)
                argv.append(part.replace("{name}", name).replace("{value}", text))
    return argv


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def arm_spec(ladder: Ladder, window: str, arm: Arm | None, control_name: str) -> ArmSpec:
    flags, env = merged(ladder, arm)
    engine = ladder.engine
    if isinstance(engine, BundledEngine):
        cfg = bundled_config(engine, flags, env)
        config, digest = cfg.to_dict(), cfg.hash
    else:
        config = command_recipe(engine, flags, env)
        digest = recipe_hash(config)
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
        for arm in window.arms:
            arms.append(arm_spec(ladder, window.name, arm, control))
        for repeat in range(ladder.repeats):
            if repeat:
                slot(control, "control", "between", window.name)
            for arm in window.arms:
                slot(arm.name, "arm", "arm", window.name)
        slot(control, "control", "close", window.name)
    return Plan(arms, slots)
