"""Instrument params with named presets: `preset: gpu` fills every field the ladder leaves out
from that preset, and a field written in the ladder wins over it. The field defaults are the
`cpu` preset, small enough for the quickstart on two cores."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class PresetParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # Field values of each preset other than "cpu", whose values are the defaults themselves.
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {}

    preset: Literal["cpu", "gpu"] = Field("cpu", description="named sizes: cpu (the defaults) or gpu; "
                                                             "fields written here win over the preset")

    @model_validator(mode="before")
    @classmethod
    def _fill_from_preset(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("preset"), str):
            return {**cls.PRESETS.get(data["preset"], {}), **data}
        return data
