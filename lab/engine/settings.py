"""The contract between the bundled engine and the lab: the one engine module the lab imports.

The lab plans, validates and launches bundled-engine boots from a ladder without loading the
engine, so everything it needs of the engine's settings is here, and this module imports no torch:

- `EngineConfig`: every knob, frozen, with the stable `hash` the lab compares with what booted;
- `from_sources(flags, environ)`: the config a boot gets from its flags and `LAB_ENGINE_*`
  variables (flags win), raising `ConfigError` with a one-line message for a bad name or value;
- `coerce(knob, value)`: one flag, variable or YAML value as the knob's type, or `ConfigError`;
- `knob_from_flag` / `knob_from_env`: the knob a flag (`--max-num-seqs`, `max-num-seqs`) or an
  environment variable (`LAB_ENGINE_MAX_NUM_SEQS`) sets, or None; `flag_name` gives a knob's
  flag; `ENV_PREFIX` starts every engine variable;
- `PRESETS`: the model shapes the engine knows by name (`smollm2-135m`, and `dummy:<name>` for
  random weights), for the lab to read a model's context length without loading it.

Everything else under lab/engine is internal and may move; the lab starts the engine as
`python -m lab.engine serve` and speaks HTTP to it. tests/test_boundaries.py holds the lab to
this module (`lab engine ...` alone runs the engine's own entry point in-process).
"""

from __future__ import annotations

from lab.engine.core.config import (ENV_PREFIX, ConfigError, EngineConfig, coerce, flag_name, from_sources,
                                    knob_from_env, knob_from_flag)
from lab.engine.model_config import PRESETS

__all__ = ["ENV_PREFIX", "PRESETS", "ConfigError", "EngineConfig", "coerce", "flag_name", "from_sources",
           "knob_from_env", "knob_from_flag"]
