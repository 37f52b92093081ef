"""The two kinds of engine a ladder boots, as objects: the bundled engine (`lab/engine`, whose
config the lab computes and hashes before the boot and checks at `/v1/stats` after it) and any
other OpenAI-compatible server started from a command (a recipe the lab renders and hashes, and
can only observe). Everything that treats the two differently asks the kind: what an arm's flags
may be, what its config and hash are, the argv that boots it, what counts as booted, whether the
boot can be measured offline. `kind_of(recipe)` picks it.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Union

from lab.engine import settings as engine_settings
from lab.instruments import local_tokenizer
from lab.instruments.engine_extras import RANDOM_WEIGHTS_SOURCE
from lab.ladder.errors import Problem
from lab.ladder.ladder import BundledEngine, CommandEngine
from lab.ladder.yaml_lines import Located, dotted

HOST = "127.0.0.1"
Recipe = Union[BundledEngine, CommandEngine]
GetJson = Callable[[str], "tuple[int, Any]"]  # url -> (HTTP status or 0, parsed JSON or None)


class PlannedArm(Protocol):
    """What launching needs of an arm of the plan (`render.ArmSpec`)."""

    flags: dict[str, Any]
    env: dict[str, str]
    config_hash: str


@dataclass(frozen=True)
class Launch:
    argv: list[str]
    env: dict[str, str]  # set on top of the lab's environment (minus inherited LAB_ENGINE_*)
    base_url: str  # server root: /health, /v1/stats, /metrics live here
    api_base: str  # OpenAI root
    model: str  # the model name requests carry
    api_key: str | None
    expected_config_hash: str | None  # bundled only: what /v1/stats must report


@dataclass(frozen=True)
class Booted:
    """What a boot that answered its first completion turned out to be."""

    refusal: str | None  # why it is not the arm's config (the boot is then refused)
    stats: dict[str, Any] | None  # what the engine says of itself, as stored with the boot
    cold: bool


class EngineKind(Protocol):
    name: str
    recipe: Recipe
    # Whether the engine reports the on-disk caches it built (`/v1/stats` `caches_built`), so a boot
    # that compiled while measured can be found cold after the fact.
    reports_caches: bool
    # Whether the engine's version is the lab's own (nothing to fingerprint apart).
    is_the_labs: bool

    def flag_problems(self, where: tuple[Any, ...], flags: dict[str, Any], env: dict[str, Any],
                      located: Located) -> list[Problem]: ...

    def recipe_problems(self, located: Located, where: tuple[Any, ...] = ("engine",)) -> list[Problem]: ...

    def label(self) -> str: ...

    def prompts_sized(self) -> bool: ...

    def unknown_knob(self, flag: str | None = None, env: str | None = None) -> str | None: ...

    def file_problems(self, located: Located, where: tuple[Any, ...] = ("engine",)) -> list[Problem]: ...

    def config(self, flags: dict[str, Any], env: dict[str, str]) -> tuple[dict[str, Any], str]: ...

    def process_env(self, env: dict[str, str]) -> dict[str, str]: ...

    def context(self, flags: dict[str, Any], env: dict[str, str]) -> int | None: ...

    def random_weights(self, flags: dict[str, Any]) -> str | None: ...

    def launch(self, arm: PlannedArm, port: int | str, host: str = HOST) -> Launch: ...

    def offline_argv(self, arm: PlannedArm) -> list[str] | None: ...

    def check_booted(self, get_json: GetJson, launch: Launch, earlier_boot_ready: bool) -> Booted: ...


class BundledKind:
    name = "bundled"
    reports_caches = True
    is_the_labs = True

    def __init__(self, recipe: BundledEngine) -> None:
        self.recipe = recipe

    def flag_problems(self, where: tuple[Any, ...], flags: dict[str, Any], env: dict[str, Any],
                      located: Located) -> list[Problem]:
        """Flags and LAB_ENGINE_* variables the bundled engine has, with values it accepts."""
        problems = []
        for name, value in flags.items():
            line = located.line(where + ("flags", name))
            unknown = self.unknown_knob(flag=name)
            if unknown:
                problems.append(Problem(line, unknown))
                continue
            problems += _coerce(engine_settings.knob_from_flag(name), value, line)
        for name, value in env.items():
            unknown = self.unknown_knob(env=name)
            line = located.line(where + ("env", name))
            if unknown:
                problems.append(Problem(line, unknown))
            elif name.startswith(engine_settings.ENV_PREFIX):
                problems += _coerce(engine_settings.knob_from_env(name), env_value(value), line, env_var=name)
        return problems

    def unknown_knob(self, flag: str | None = None, env: str | None = None) -> str | None:
        """Why the engine has no such flag, or reads no such LAB_ENGINE_* variable; None when it does
        (any other variable is the process's, not a knob)."""
        if flag is not None and engine_settings.knob_from_flag(flag) is None:
            return f"unknown flag {flag!r} for the bundled engine (`lab engine serve --help` lists them)"
        if env is not None and env.startswith(engine_settings.ENV_PREFIX) and engine_settings.knob_from_env(env) is None:
            return (f"unknown engine variable {env!r}: no knob "
                    f"{env[len(engine_settings.ENV_PREFIX):].lower()!r} in the bundled engine")
        return None

    def recipe_problems(self, located: Located, where: tuple[Any, ...] = ("engine",)) -> list[Problem]:
        problems = self.flag_problems(where, self.recipe.flags, self.recipe.env, located)
        if "model" in {engine_settings.knob_from_flag(k) for k in self.recipe.flags}:
            problems.append(Problem(located.line(where + ("flags", "model")), "set the model with engine.model"))
        return problems

    def label(self) -> str:
        """How `lab ls` and reports name an arm that boots this engine: `bundled:smollm2-135m`."""
        return f"bundled:{self.recipe.model}"

    def prompts_sized(self) -> bool:
        return True  # its /tokenize sizes prompts exactly

    def file_problems(self, located: Located, where: tuple[Any, ...] = ("engine",)) -> list[Problem]:
        return []  # its model is found, or refused, by its own boot

    def engine_config(self, flags: dict[str, Any], env: dict[str, str]) -> engine_settings.EngineConfig:
        """The config the bundled engine will compute from this argv and environment (raises ConfigError)."""
        return engine_settings.from_sources({**flags, "model": self.recipe.model}, env)

    def config(self, flags: dict[str, Any], env: dict[str, str]) -> tuple[dict[str, Any], str]:
        cfg = self.engine_config(flags, env)
        return cfg.to_dict(), cfg.hash

    def process_env(self, env: dict[str, str]) -> dict[str, str]:
        """The variables that change the process but not the config (LAB_ENGINE_* are in the config)."""
        return {k: v for k, v in env.items() if not k.startswith(engine_settings.ENV_PREFIX)}

    def context(self, flags: dict[str, Any], env: dict[str, str]) -> int | None:
        """The engine's context for these flags (its max-model-len, or its model's), when known without
        loading the model; None for a model file or directory, or a config validation refuses."""
        try:
            config = self.engine_config(flags, env)
        except engine_settings.ConfigError:
            return None
        if config.max_model_len:
            return config.max_model_len
        model = engine_settings.PRESETS.get(config.model.removeprefix(RANDOM_WEIGHTS_SOURCE))
        return model.max_position_embeddings if model is not None else None

    def random_weights(self, flags: dict[str, Any]) -> str | None:
        # The engine takes the last --model it is given, and an arm's model flag follows engine.model.
        models = [self.recipe.model] + [str(v) for k, v in flags.items()
                                        if engine_settings.knob_from_flag(k) == "model"]
        return models[-1] if models[-1].startswith(RANDOM_WEIGHTS_SOURCE) else None

    def launch(self, arm: PlannedArm, port: int | str, host: str = HOST) -> Launch:
        """`host` is the bind address (`lab serve` may serve beyond loopback); a `port` of "{port}"
        renders the template `--dry-run` prints."""
        argv = [sys.executable, "-m", "lab.engine", "serve", "--host", host, "--port", str(port), *self._flags(arm)]
        base = f"http://{host}:{port}"
        return Launch(argv, dict(arm.env), base, base + "/v1", self.recipe.model, None, arm.config_hash)

    def offline_argv(self, arm: PlannedArm) -> list[str] | None:
        """`lab engine bench` on exactly the arm's model and knobs (its environment is the launch's)."""
        return [sys.executable, "-m", "lab.engine", "bench", *self._flags(arm)]

    def check_booted(self, get_json: GetJson, launch: Launch, earlier_boot_ready: bool) -> Booted:
        """Refused unless `/v1/stats` reports the planned config hash; cold as the engine says."""
        status, stats = get_json(f"{launch.base_url}/v1/stats")
        if status != 200 or not isinstance(stats, dict):
            return Booted(f"cannot check what booted: /v1/stats answered {status or 'nothing'}", None,
                          not earlier_boot_ready)
        booted = stats.get("config_hash")
        if booted != launch.expected_config_hash:
            return Booted(f"booted config hash {booted} != expected {launch.expected_config_hash}", stats,
                          bool(stats.get("cold")))
        return Booted(None, stats, stats["cold"] if isinstance(stats.get("cold"), bool) else not earlier_boot_ready)

    def _flags(self, arm: PlannedArm) -> list[str]:
        argv = ["--model", self.recipe.model]
        for name, value in arm.flags.items():
            knob = engine_settings.knob_from_flag(name)
            text = ("true" if value else "false") if isinstance(value, bool) else str(value)
            argv += [engine_settings.flag_name(knob or name), text]
        return argv


class CommandKind:
    name = "command"
    reports_caches = False
    is_the_labs = False

    def __init__(self, recipe: CommandEngine) -> None:
        self.recipe = recipe

    def flag_problems(self, where: tuple[Any, ...], flags: dict[str, Any], env: dict[str, Any],
                      located: Located) -> list[Problem]:
        return []  # the lab does not know another engine's flags: its boot says what it refuses

    def unknown_knob(self, flag: str | None = None, env: str | None = None) -> str | None:
        return None

    def recipe_problems(self, located: Located, where: tuple[Any, ...] = ("engine",)) -> list[Problem]:
        problems = []
        if not any("{port}" in part for part in self.recipe.command):
            problems.append(Problem(located.line(where + ("command",)),
                                    "command has no {port} placeholder; the lab gives each boot a free port"))
        if "{port}" not in self.recipe.base_url:
            problems.append(Problem(located.line(where + ("base_url",)), "base_url has no {port} placeholder"))
        if "{name}" not in self.recipe.flag_style or "{value}" not in self.recipe.flag_style:
            problems.append(Problem(located.line(where + ("flag_style",)), "flag_style needs {name} and {value}"))
        return problems

    def label(self) -> str:
        """`command:` and the program it runs: the module after `-m` (`llama_cpp.server`), else the
        script it runs (`scripted_engine.py`), else the executable (`vllm`)."""
        argv = [self.recipe.executable or part if part == "{executable}" else part for part in self.recipe.command]
        if "-m" in argv[:-1]:
            program = argv[argv.index("-m") + 1]
        else:
            program = next((part for part in argv[1:] if part.endswith(".py")), argv[0])
        return f"command:{program.rsplit('/', 1)[-1]}"

    def prompts_sized(self) -> bool:
        """Whether the lab can size its prompts whatever it serves: only with a `tokenizer` named
        (whether it has a tokenizer route is known once it boots)."""
        return self.recipe.tokenizer is not None

    def file_problems(self, located: Located, where: tuple[Any, ...] = ("engine",)) -> list[Problem]:
        """Its `tokenizer` must be readable here: every probe would find it unusable. (Its
        `executable` is not checked: the shipped ladders name engines this host may lack, and a
        boot that cannot start costs nothing and says why.)"""
        if self.recipe.tokenizer is None:
            return []
        try:
            local_tokenizer.load(self.recipe.tokenizer)
        except local_tokenizer.TokenizerLoadError as exc:
            return [Problem(located.line(where + ("tokenizer",)), f"{dotted(where)}.{exc}")]
        return []

    def config(self, flags: dict[str, Any], env: dict[str, str]) -> tuple[dict[str, Any], str]:
        recipe = {"command": list(self.recipe.command), "model": self.recipe.model,
                  "served_model_name": self.recipe.served_model_name, "flags": self.render_flags(flags), "env": env}
        blob = json.dumps(recipe, sort_keys=True, separators=(",", ":"))
        return recipe, hashlib.sha256(blob.encode()).hexdigest()[:16]

    def process_env(self, env: dict[str, str]) -> dict[str, str]:
        return env

    def context(self, flags: dict[str, Any], env: dict[str, str]) -> int | None:
        return None  # not known before it boots

    def random_weights(self, flags: dict[str, Any]) -> str | None:
        return "--load-format dummy" if _loads_dummy_weights([*self.recipe.command, *self.render_flags(flags)]) \
            else None

    def launch(self, arm: PlannedArm, port: int | str, host: str = HOST) -> Launch:
        """The engine binds where its command template says; a `port` of "{port}" leaves it a template."""
        def fill(text: str) -> str:
            # Only our placeholders: arguments may hold literal JSON braces.
            values = {"port": str(port), "model": self.recipe.model, "executable": self.recipe.executable or ""}
            return re.sub(r"\{(port|model|executable)\}", lambda m: values[m.group(1)], text)

        argv = [fill(part) for part in self.recipe.command] + self.render_flags(arm.flags)
        api_base = fill(self.recipe.base_url).rstrip("/")
        base_url = api_base[: -len("/v1")] if api_base.endswith("/v1") else api_base
        return Launch(argv, dict(arm.env), base_url, api_base, self.recipe.served_model_name or self.recipe.model,
                      self.recipe.api_key, None)

    def offline_argv(self, arm: PlannedArm) -> list[str] | None:
        return None  # only the bundled engine has a bench

    def check_booted(self, get_json: GetJson, launch: Launch, earlier_boot_ready: bool) -> Booted:
        """No hash to compare: the stored argv and env are the receipt. Nothing says what the engine
        built, so its JIT caches are taken as cold on the first boot of a run, which reads several
        percent slow."""
        status, models = get_json(f"{launch.api_base}/models")
        return Booted(None, {"v1_models": models} if status == 200 else None, not earlier_boot_ready)

    def render_flags(self, flags: dict[str, Any]) -> list[str]:
        parts = self.recipe.flag_style.split()
        prefix = parts[0].split("{name}")[0] if parts else "--"
        argv: list[str] = []
        for name, value in flags.items():
            if isinstance(value, bool) and self.recipe.bool_style != "value":
                if value:
                    argv.append(prefix + name)
                elif self.recipe.bool_style == "negatable":
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


def kind_of(recipe: Recipe) -> EngineKind:
    return BundledKind(recipe) if isinstance(recipe, BundledEngine) else CommandKind(recipe)


def env_value(value: Any) -> str:
    """Environment values are strings; booleans become 1/0, the convention engines read."""
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def _coerce(knob: str, value: Any, line: int, env_var: str | None = None) -> list[Problem]:
    try:
        engine_settings.coerce(knob, value)
    except engine_settings.ConfigError as exc:
        reason = str(exc)
        if env_var:  # the engine's message names the flag; the ladder wrote the variable
            reason = f"{env_var}: {reason.split(': ', 1)[-1]}"
        return [Problem(line, reason)]
    return []


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def _loads_dummy_weights(argv: list[str]) -> bool:
    """vLLM's and SGLang's `--load-format dummy` or `--load-format=dummy` (vLLM also reads `--load_format`)."""
    for i, part in enumerate(argv):
        name, equals, value = part.partition("=")
        if name.replace("_", "-") != "--load-format":
            continue
        if (value if equals else argv[i + 1] if i + 1 < len(argv) else "") == "dummy":
            return True
    return False
