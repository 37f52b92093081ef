"""The ladder file's shape, as pydantic models; `lab schema` publishes it as JSON Schema.

Structure only. Rules that need more than one field (one change per arm, known engine flags,
KEEP metrics some instrument produces) live in `lab.ladder.validate`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StringConstraints, create_model, model_validator

from lab.instruments import REGISTRY

# Names end up in file names (boot logs) and on the command line: keep them plain.
Name = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]
Scalar = Union[bool, int, float, str]
# Command engines take JSON for dict values (vLLM's --compilation-config) and lists as repeated values.
CommandValue = Union[Scalar, list[Scalar], dict[str, Any]]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class BundledEngine(Strict):
    """The engine in `lab/engine/`, started as `python -m lab.engine serve`."""

    kind: Literal["bundled"]
    model: str = Field("smollm2-135m",
                       description="smollm2-135m, a .gguf path, a Hugging Face directory, or dummy:<preset>")
    flags: dict[str, Scalar] = Field(default_factory=dict,
                                     description="engine knobs as flags: {max-num-batched-tokens: 2048}")
    env: dict[str, Scalar] = Field(default_factory=dict,
                                   description="environment: LAB_ENGINE_<KNOB> or any other variable")
    ready_timeout_s: float = Field(300.0, gt=0,
                                   description="seconds from start until a real completion must be answered")
    stop_grace_s: float = Field(10.0, ge=0,
                                description="seconds between SIGTERM and SIGKILL to the engine's process group")
    request_timeout_s: float = Field(600.0, gt=0,
                                     description="seconds the lab waits for the next bytes of an answer while it "
                                                 "measures; an engine silent this long, and to a 1-token completion "
                                                 "after it, is hung and its boot ends")


class CommandEngine(Strict):
    """Any OpenAI-compatible server started from a command template (no shell is involved)."""

    kind: Literal["command"]
    command: list[str] = Field(min_length=1,
                               description="argv with {port}, {model} and {executable} placeholders")
    executable: str | None = Field(None, description="substituted for {executable}: the engine's own program "
                                                     "(say its venv's python), named in one place")
    model: str = Field(description="substituted for {model}; the model name in requests unless served_model_name")
    served_model_name: str | None = Field(None, description="the `model` field requests carry, when not `model`")
    flags: dict[str, CommandValue] = Field(default_factory=dict,
                                           description="rendered after the command with flag_style")
    flag_style: str = Field("--{name} {value}",
                            description="how one flag renders; a space splits it into two arguments")
    bool_style: Literal["value", "switch", "negatable"] = Field(
        "value", description="value: --x true|false; switch: --x or nothing; negatable: --x or --no-x")
    env: dict[str, Scalar] = Field(default_factory=dict)
    base_url: str = Field("http://127.0.0.1:{port}/v1",
                          description="the OpenAI root once started; {port} is substituted")
    api_key: str | None = None
    tokenizer: str | None = Field(None, description="the model's tokenizer, for an engine with no tokenizer route "
                                                     "(no /tokenize): smollm2-135m, a .gguf file or a tokenizer.json; "
                                                     "prompts are then sized and tokens counted with it, once it "
                                                     "counts as the engine does")
    ready_timeout_s: float = Field(900.0, gt=0)
    stop_grace_s: float = Field(30.0, ge=0)
    request_timeout_s: float = Field(600.0, gt=0,
                                     description="seconds the lab waits for the next bytes of an answer while it "
                                                 "measures; an engine silent this long, and to a 1-token completion "
                                                 "after it, is hung and its boot ends")

    @model_validator(mode="after")
    def _executable_named(self) -> "CommandEngine":
        if self.executable is None and any("{executable}" in part for part in self.command):
            raise ValueError("command uses {executable} but the engine names no `executable`")
        return self


Engine = Annotated[Union[BundledEngine, CommandEngine], Field(discriminator="kind")]


class Arm(Strict):
    name: Name
    engine: Optional[Engine] = Field(None, description="another engine, booted in this arm's place: the arm's one "
                                                       "change is the engine (it then sets no flags or env of "
                                                       "the control's; its own are in its engine)")
    flags: dict[str, CommandValue] = Field(default_factory=dict)
    env: dict[str, Scalar] = Field(default_factory=dict)
    multi: bool = Field(False, description="allow this arm to change more than one thing")
    note: str = ""


class Window(Strict):
    name: Name
    control: Name | None = Field(None,
                                 description="name of the control boots that open and close it; default <window>ctl")
    arms: list[Arm] = Field(default_factory=list,
                            description="none: the control alone, measured `repeats` times and never judged")

    @property
    def control_name(self) -> str:
        return self.control or f"{self.name}ctl"


class MetricRef(Strict):
    metric: str = Field(description="<instrument>.<metric>")
    where: dict[str, Scalar] = Field(default_factory=dict, description="select cells by their params")


class Gate(MetricRef):
    min: float | None = None
    max: float | None = None
    arms: list[Name] = Field(default_factory=list,
                             description="the arms this gate judges (empty: every arm); a knob that changes "
                                         "numerics by design is not gated on agreement")

    @model_validator(mode="after")
    def _bounded(self) -> "Gate":
        if self.min is None and self.max is None:
            raise ValueError("a gate needs min or max")
        return self


class Keep(Strict):
    """Data for `lab.analysis.keep.KeepRule`: directions come from the instruments' declared metrics."""

    threshold_pct: float = Field(2.0, ge=0, allow_inf_nan=False)
    max_drift_pct: float | None = Field(None, ge=0, allow_inf_nan=False, description="with one arm boot, a key metric whose controls are further apart "
                                                                "is undecided (it blocks a keep); default threshold_pct")
    metrics: list[Union[str, MetricRef]] = Field(default_factory=list, description="key metrics, <instrument>.<metric>")
    gates: list[Gate] = Field(default_factory=list)
    # 3: two controls bracket the third, one A/A effect; 21: one window of at most 20 repeats + 1
    # (lab.runner.calibrate.MIN_BOOTS and MAX_BOOTS).
    calibrate: Optional[int] = Field(None, ge=3, le=21, description="`lab run` first boots the control this many "
                                                                     "times (after a warm-up boot), exactly as `lab "
                                                                     "calibrate --boots N`, and judges with that noise")

    def metric_refs(self) -> list[MetricRef]:
        return [MetricRef(metric=m) if isinstance(m, str) else m for m in self.metrics]


class Neighbour(Strict):
    """Another tenant's job: a process started before each measured boot's engine and stopped after it."""

    command: list[str] = Field(min_length=1, description="argv, no shell: [python3, -c, 'while True: pass']")
    cpus: Optional[list[Annotated[int, Field(ge=0)]]] = Field(
        None, min_length=1, description="the CPUs it is pinned to (CPU affinity); default: not pinned")

    @model_validator(mode="after")
    def _program_named(self) -> "Neighbour":
        if not self.command[0].strip():
            raise ValueError("command: the program (its first element) is empty")
        return self


class Hygiene(Strict):
    min_mem_available_gib: float = Field(1.0, ge=0, allow_inf_nan=False, description="host MemAvailable needed before each boot")
    mem_wait_s: float = Field(60.0, ge=0, allow_inf_nan=False, description="how long to wait for it before failing the boot")
    warmup_boot: Union[bool, list[Name]] = Field(
        False, description="true: boot the base once first, unmeasured, to warm caches; a list of arm or control "
                           "names: boot each of those once first, unmeasured (an arm whose change needs caches "
                           "of its own, such as kernels only it compiles, is otherwise cold on its only boot)")

    probe_prompt_tokens: Optional[int] = Field(
        None, ge=64, description="the most tokens the capability probe's large request holds at each boot (default: "
                                 "the ladder's largest request); where that prefill takes minutes (a 1M-token "
                                 "prompt) the probe would otherwise double every boot, warm-ups included")

    neighbour: Optional[Neighbour] = Field(
        None, description="a process beside every measured boot (not warm-ups), in its own process group, "
                          "its output in the boot's log folder: what the engine does beside another job")

    ports: Optional[tuple[Annotated[int, Field(ge=1024, le=65535)], Annotated[int, Field(ge=1024, le=65535)]]] = Field(
        None, description="[first, last]: the ports engines may listen on (a firewall, or two labs on one host); "
                          "default any free port")

    @model_validator(mode="after")
    def _ports_ordered(self) -> "Hygiene":
        if self.ports is not None and self.ports[0] > self.ports[1]:
            raise ValueError(f"ports: {self.ports[0]} is above {self.ports[1]}; give [first, last]")
        return self

    def warmup_names(self, first_control: str) -> list[str]:
        """The arms (or controls) booted once, unmeasured, before the first window."""
        if self.warmup_boot is True:
            return [first_control]
        return list(dict.fromkeys(self.warmup_boot)) if self.warmup_boot else []


class InstrumentsBase(Strict):
    """The registered instruments as optional sections; remembers the order they were written in."""

    _order: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="wrap")
    @classmethod
    def _keep_order(cls, data: Any, handler: Any) -> Any:
        if isinstance(data, dict):
            # `memory:` with nothing after it means "with default params".
            data = {k: ({} if v is None else v) for k, v in data.items()}
        model = handler(data)
        if isinstance(data, dict):
            model._order = [k for k in data if k in REGISTRY]
        return model

    def sections(self) -> list[tuple[str, BaseModel]]:
        """(name, params) of the instruments this ladder uses, in ladder order."""
        return [(name, getattr(self, name)) for name in self._order]


Instruments = create_model(  # type: ignore[call-overload]
    "Instruments",
    __base__=InstrumentsBase,
    **{name: (cls.Params | None, None) for name, cls in REGISTRY.items()},
)


class Ladder(Strict):
    name: Name
    description: str = ""
    engine: Engine
    windows: list[Window] = Field(min_length=1)
    repeats: int = Field(1, ge=1, le=20, description="boots of every arm per window, interleaved with controls "
                                                     "(C A B C A B C for 2); the boot is the unit of replication, "
                                                     "and 2 or more give each verdict a confidence interval; "
                                                     "a window with no arms boots its control this many times")
    instruments: Instruments = Field(default_factory=Instruments)  # type: ignore[valid-type]
    keep: Keep = Field(default_factory=Keep)
    hygiene: Hygiene = Field(default_factory=Hygiene)
    compare_only: bool = Field(False, description="measure and report every arm beside its control, store no "
                                                  "verdict: engines compared, not chosen between")
    borrowed: Optional[str] = Field(None, description="a YAML or CSV file of figures measured elsewhere (rows: "
                                                       "metric, params, value, source, date), relative to the "
                                                       "ladder: stored with the run, drawn beside its figures as "
                                                       "`borrowed: SOURCE (DATE)`, never judged")


def json_schema() -> dict[str, Any]:
    schema = Ladder.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "lab ladder"
    return schema
