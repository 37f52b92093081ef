"""What an instrument is to the runner: a deterministic plan of steps, and a way to run one step.

The runner stores each step's cells, receipts and qeval items in one transaction keyed by
(boot slot, instrument, step key). A resumed run asks the instrument for the same plan and runs only
the steps not yet stored for that slot, so `plan` must return the same keys for the same params.
Instruments speak HTTP to the engine; they never import it and never write to the store themselves:
what they read of it comes through `BootContext.stored`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol

from pydantic import BaseModel

from lab.store.records import Step, StepResult
from lab.store.stored_rows import StoredRows

Better = Literal["higher", "lower"]

# The note of a cell whose measurement means nothing on this engine (quality on random weights)
# starts with this: such a cell is invalid, with no value, and is neither a failure nor a gap.
NOT_APPLICABLE = "not applicable: "


class EngineControl(Protocol):
    """What the runner lends an instrument that must act on the engine's process, not only speak
    HTTP to it: restart it with the same argv and environment inside the same boot, or stop it for
    an offline measurement of the same config. Both return once the engine answers again."""

    async def restart(self) -> float:
        """Stop the engine and start it again; the seconds from the stop to its first completion."""

    async def offline(self, args: list[str]) -> dict[str, Any]:
        """Stop the engine, run `lab engine bench` on the same config with `args`, start the
        engine again; the bench's JSON. Raises NotImplementedError for engines the lab cannot
        measure offline (any but the bundled one)."""


class MemFloor(Protocol):
    """The host's MemAvailable since the engine started, as the runner samples it."""

    def floor_bytes(self) -> int | None: ...

    def samples(self) -> int: ...


def random_weights_note(model: str) -> str:
    """Why an answer-scoring cell is not applicable on an engine that serves random weights."""
    return f"{NOT_APPLICABLE}the engine serves random weights ({model}), so answers carry no knowledge"


@dataclass
class BootContext:
    """Everything an instrument may know about the boot it measures."""

    base_url: str  # http://127.0.0.1:PORT
    api_base: str  # the OpenAI root, usually base_url + "/v1"
    model: str  # the served model name to put in requests
    api_key: str | None
    run_id: int
    run_name: str
    slot_id: int
    boot_id: int
    arm: str
    window: str | None
    role: Literal["control", "arm"]
    position: Literal["open", "arm", "between", "close"]
    salt: str  # unique per run and boot: prefix prompts with it so no boot is served from another's cache
    engine_kind: Literal["bundled", "command"]
    params: BaseModel  # this instrument's validated ladder section
    stored: StoredRows  # read-only: this slot's and the opening control's stored rows
    control_boot_ids: list[int]  # warm control boots of this window measured before this one
    mem: MemFloor  # host MemAvailable sampled since the engine started
    log: logging.Logger
    # What the capability probe found at this boot (lab/instruments/capabilities.py); None when
    # the instrument runs outside `lab run`, against an engine taken to have every capability.
    capabilities: dict[str, Any] | None = None
    # The runner's hold on the engine's process (restart, offline figures); None outside `lab run`.
    engine: EngineControl | None = None
    # The ladder's `engine.request_timeout_s`: how long to wait for the next bytes of any answer.
    request_timeout_s: float = 600.0
    # In a window with an engine arm: the control boot whose prompt texts this arm boot is sent as
    # they were (`lab.instruments.shared_prompts`), so every engine gets the same requests; None
    # where each boot sizes its own.
    prompts_of: int | None = None
    # That control's prompts by instrument, as `shared_prompts` reads them: once a boot, not once a request.
    control_prompts: dict[str, list[tuple[str, int | None]]] = field(default_factory=dict, repr=False)


class Instrument(Protocol):
    name: ClassVar[str]
    Params: ClassVar[type[BaseModel]]  # its ladder section; extra keys are refused

    def metrics(self, params: BaseModel) -> dict[str, Better]:
        """Every metric name it can produce for these params, with the direction that is better."""

    def plan(self, params: BaseModel) -> list[Step]:
        """The steps to run on every measured boot, in order; same params give the same keys."""

    async def run_step(self, ctx: BootContext, step: Step) -> StepResult:
        """Run one step against the engine. Raising marks the step as errored; the boot goes on."""

    # Optional, read by the ladder validator without running anything (an instrument without them
    # is not checked on these points):
    #   cell_params(params) -> {metric: [params of each cell it stores per boot, repeats aside]}
    #   prompt_tokens(params) -> {ladder field: the most tokens (prompt + output) one request holds}
    #   sends_overlapping(params) -> whether it sends requests that overlap: the capability probe then
    #     asks whether the engine keeps a stream running when another request arrives
    #   sends_ignore_eos(params) -> whether its requests must run to max_tokens (`ignore_eos`): the
    #     capability probe then asks what the engine does with it, and whether an EOS ban works
