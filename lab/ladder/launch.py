"""The exact argv, environment and URLs one boot of an arm uses on a given port."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass

from lab.engine import settings as engine_settings
from lab.ladder.ladder import BundledEngine, Ladder
from lab.ladder.render import ArmSpec, render_command_flags

HOST = "127.0.0.1"


@dataclass(frozen=True)
class Launch:
    argv: list[str]
    env: dict[str, str]  # set on top of the lab's environment (minus inherited LAB_ENGINE_*)
    base_url: str  # server root: /health, /v1/stats, /metrics live here
    api_base: str  # OpenAI root
    model: str  # the model name requests carry
    api_key: str | None
    expected_config_hash: str | None  # bundled only: what /v1/stats must report


def launch(ladder: Ladder, arm: ArmSpec, port: int, host: str = HOST) -> Launch:
    """`host` is the bundled engine's bind address (`lab serve` may serve beyond loopback); a command
    engine binds where its command template says."""
    engine = ladder.engine
    if isinstance(engine, BundledEngine):
        argv = [sys.executable, "-m", "lab.engine", "serve", "--host", host, "--port", str(port),
                *_bundled_flags(engine, arm)]
        base = f"http://{host}:{port}"
        return Launch(argv, dict(arm.env), base, base + "/v1", engine.model, None, arm.config_hash)

    def fill(text: str) -> str:
        # Only our placeholders: arguments may hold literal JSON braces.
        values = {"port": str(port), "model": engine.model, "executable": engine.executable or ""}
        return re.sub(r"\{(port|model|executable)\}", lambda m: values[m.group(1)], text)

    argv = [fill(part) for part in engine.command] + render_command_flags(engine, arm.flags)
    api_base = fill(engine.base_url).rstrip("/")
    base_url = api_base[: -len("/v1")] if api_base.endswith("/v1") else api_base
    return Launch(argv, dict(arm.env), base_url, api_base, engine.served_model_name or engine.model,
                  engine.api_key, None)


def offline_argv(ladder: Ladder, arm: ArmSpec) -> list[str] | None:
    """`lab engine bench` on exactly the arm's model and knobs (its environment is the launch's);
    None for an engine the lab cannot run offline: only the bundled one has a bench."""
    engine = ladder.engine
    if not isinstance(engine, BundledEngine):
        return None
    return [sys.executable, "-m", "lab.engine", "bench", *_bundled_flags(engine, arm)]


def _bundled_flags(engine: BundledEngine, arm: ArmSpec) -> list[str]:
    argv = ["--model", engine.model]
    for name, value in arm.flags.items():
        knob = engine_settings.knob_from_flag(name)
        text = ("true" if value else "false") if isinstance(value, bool) else str(value)
        argv += [engine_settings.flag_name(knob or name), text]
    return argv
