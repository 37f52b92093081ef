"""The instrument registry: the one place that names which instruments a ladder may use.

A ladder's `instruments:` section, its JSON Schema and the runner all read this mapping; adding an
instrument is one import and one entry here.
"""

from __future__ import annotations

from lab.instruments.agreement import AgreementInstrument
from lab.instruments.base import Instrument
from lab.instruments.decode import DecodeInstrument
from lab.instruments.memory import MemoryInstrument
from lab.instruments.mixed import MixedInstrument
from lab.instruments.needle import NeedleInstrument
from lab.instruments.offline import OfflineInstrument
from lab.instruments.prefill import PrefillInstrument
from lab.instruments.qeval import QevalInstrument
from lab.instruments.restart import RestartInstrument
from lab.instruments.soak import SoakInstrument

REGISTRY: dict[str, type[Instrument]] = {
    QevalInstrument.name: QevalInstrument,
    AgreementInstrument.name: AgreementInstrument,
    PrefillInstrument.name: PrefillInstrument,
    NeedleInstrument.name: NeedleInstrument,
    DecodeInstrument.name: DecodeInstrument,
    MixedInstrument.name: MixedInstrument,
    MemoryInstrument.name: MemoryInstrument,
    SoakInstrument.name: SoakInstrument,
    RestartInstrument.name: RestartInstrument,
    OfflineInstrument.name: OfflineInstrument,
}
