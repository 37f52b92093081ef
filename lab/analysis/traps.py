"""Ladder traps only a measurement shows, found in the first measured boot of a run (its first
window's opening control), so a ladder that would spend its boots on figures the KEEP rule cannot
use says so before the others boot. Each warning names the ladder line and the fix:

- a key `decode.agg_tok_s` that is mostly ramp: where a stream's first token comes a large share
  of the way through its life, the aggregate moves with queueing and prefill as much as with
  decode (`steady_agg_tok_s` leaves the ramp out);
- a `mixed` probe whose `delay_s` is longer than the long prefill on this engine: the short chat
  is sent after the prefill is over and nothing is measured behind it;
- a request longer than the context the engine reported at boot (a command engine's context is
  not known before it boots; the bundled engine's is refused at validation): its cells are invalid
  at every boot; where it is the ladder's largest, the capability probe fails every boot, and
  `too_long` says why, so the runner stops after that first boot;
- a key metric whose repeats within the boot already spread wider than the threshold: one boot
  of an arm cannot resolve the threshold on it.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Sequence
from typing import Any

from lab.analysis.stats import noise_band
from lab.analysis.verdicts import RunEvidence, Selector, SlotCells, StoredCell
from lab.instruments import REGISTRY
from lab.instruments.decode import NO_TOKEN_TIMING
from lab.ladder.ladder import Ladder
from lab.ladder.yaml_lines import Located, dotted

# A first token this far into a stream's life makes its level's aggregate follow prefill: a 20 %
# slower prefill then moves the aggregate by 2 %, the default threshold, with decode unchanged.
RAMP_SHARE = 0.10
_CONTEXT = re.compile(r"exceed the engine's context of (\d+)")


def first_boot(evidence: RunEvidence, slot: SlotCells, located: Located) -> list[str]:
    """Every trap the first measured boot (`slot`, finished) shows in the run's ladder."""
    return (_ramp(evidence, slot, located) + _mixed_delay(evidence, slot, located)
            + _context(evidence, slot, located) + _scatter(evidence, slot, located))


def too_long(ladder: Ladder, located: Located, capabilities: dict[str, Any] | None, label: str) -> str | None:
    """Why every boot will fail, when a boot's capability probe found the ladder's largest request
    longer than the context the engine reports: each such request with its ladder line and the fix.
    None when the probe was answered, capped by hygiene.probe_prompt_tokens, or no context is known."""
    caps = capabilities or {}
    context, largest = caps.get("context"), caps.get("largest_prompt", {})
    if caps.get("answered", True) or not isinstance(context, int) or largest.get("capped_from") \
            or not largest.get("tokens", 0) > context:
        return None
    over = [f"{_where(located, ('instruments', name, field))}: a request of {tokens:,} tokens"
            for name, params in ladder.instruments.sections()
            for field, tokens in _requests(name, params).items() if tokens > context]
    what = "; ".join(over) or "the ladder's largest request"
    return (f"{what} does not fit the context of {context:,} tokens "
            f"the engine reported in {label}, so every boot would fail its readiness probe; shorten it or boot "
            "the engine with a longer context, then start a new run")


def _requests(instrument: str, params: Any) -> dict[str, int]:
    """The longest request each field of an instrument's params makes it send."""
    declare = getattr(REGISTRY[instrument], "prompt_tokens", None)
    return declare(REGISTRY[instrument](), params) if declare else {}


def _where(located: Located, path: Sequence[Any]) -> str:
    """What a warning is about: "ladder line 12 (instruments.decode.max_tokens)"."""
    return f"ladder line {located.line(path)} ({dotted(path)})"


def _fix(located: Located, path: Sequence[Any]) -> str:
    """A line a fix changes: "instruments.decode.max_tokens (line 12)"."""
    return f"{dotted(path)} (line {located.line(path)})"


def _values(slot: SlotCells, instrument: str, metric: str, params: dict[str, Any]) -> list[float]:
    selector = Selector(instrument, metric, tuple(sorted(params.items())))
    return [c.value for c in slot.cells if selector.matches(c) and c.valid and c.value is not None]


def _ramp(evidence: RunEvidence, slot: SlotCells, located: Located) -> list[str]:
    decode = dict(evidence.ladder.instruments.sections()).get("decode")
    found = []
    for i, selector in enumerate(evidence.spec.metrics):
        if decode is None or (selector.instrument, selector.metric) != ("decode", "agg_tok_s"):
            continue
        where = dict(selector.where)
        ttft, rate = _values(slot, "decode", "ttft_s", where), _values(slot, "decode", "stream_tok_s", where)
        if not ttft or (rate and min(rate) <= 0):
            continue
        if not rate and not _untimed(slot, where):
            continue
        first = statistics.median(ttft)
        # With no rate, the streams' tokens came with their first chunk: their whole life was ramp.
        life = first + ((decode.max_tokens - 1) / statistics.median(rate) if rate else 0.0)
        if first / life <= RAMP_SHARE:
            continue
        streams = where.get("level")
        steady = "its stream decodes" if streams == 1 else f"all {streams} streams decode"
        found.append(f"{_where(located, ('keep', 'metrics', i))}: {selector.label} is {first / life:.0%} ramp: in "
                     f"{slot.label} a stream's first token came {first:.3g} s into its {life:.3g} s, so the figure "
                     "follows queueing and prefill as much as decode; key decode.steady_agg_tok_s (the rate while "
                     f"{steady}) or raise {_fix(located, ('instruments', 'decode', 'max_tokens'))}")
    return found


def _untimed(slot: SlotCells, where: dict[str, Any]) -> bool:
    """Whether the decode level's stream rate is missing because a stream's tokens all came in the
    chunk that carried its first (its requests succeeded with usage, so that is the only way left)."""
    selector = Selector("decode", "stream_tok_s", tuple(sorted(where.items())))
    return any(selector.matches(c) and not c.valid and c.note == NO_TOKEN_TIMING for c in slot.cells)


def _mixed_delay(evidence: RunEvidence, slot: SlotCells, located: Located) -> list[str]:
    mixed = dict(evidence.ladder.instruments.sections()).get("mixed")
    prefill = _values(slot, "mixed", "long_prefill_s", {}) if mixed is not None else []
    if not prefill or mixed.delay_s < min(prefill):
        return []
    took = min(prefill)
    return [f"{_where(located, ('instruments', 'mixed', 'delay_s'))}: the long prefill of {mixed.long_tokens:,} "
            f"tokens took {took:.3g} s on this engine in {slot.label}, over before the short chat was sent "
            f"{mixed.delay_s:g} s after it, so nothing is measured behind it; lower delay_s below {took:.3g} s "
            f"or raise {_fix(located, ('instruments', 'mixed', 'long_tokens'))}"]


def _context(evidence: RunEvidence, slot: SlotCells, located: Located) -> list[str]:
    params = dict(evidence.ladder.instruments.sections())
    contexts: dict[str, int] = {}
    for cell in slot.cells:
        hit = _CONTEXT.search(cell.note) if not cell.valid else None
        if hit and cell.instrument in params:
            contexts[cell.instrument] = int(hit.group(1))
    found = []
    for instrument, context in contexts.items():
        over = {field: tokens for field, tokens in _requests(instrument, params[instrument]).items()
                if tokens > context} or {"": 0}
        for field, tokens in over.items():
            path = ("instruments", instrument, field) if field else ("instruments", instrument)
            request = f"a request of {tokens:,} tokens" if field else "its requests"
            found.append(f"{_where(located, path)}: {request} exceeds the context of {context:,} tokens this engine "
                         f"reported in {slot.label}, so its cells are invalid at every boot; shorten it or boot the "
                         "engine with a longer context")
    return found


def _scatter(evidence: RunEvidence, slot: SlotCells, located: Located) -> list[str]:
    rule = evidence.spec.rule
    if rule is None:
        return []
    found = []
    for i, selector in enumerate(evidence.spec.metrics):
        cells: list[StoredCell] = [c for c in slot.cells if selector.matches(c) and c.valid and c.value is not None]
        values = [c.value for c in cells]
        if len(values) < 2 or min(values) <= 0:
            continue
        spread = noise_band(max(values), min(values)) * 100
        if spread <= rule.threshold_pct:
            continue
        found.append(f"{_where(located, ('keep', 'metrics', i))}: {selector.label}'s {len(values)} repeats in "
                     f"{slot.label} are {spread:.1f} % apart, more than the {rule.threshold_pct:g} % threshold: one "
                     "boot of an arm cannot resolve it; calibrate (`lab run --calibrate N`) and give the arms "
                     f"`repeats:`, key a steadier figure, or raise {_fix(located, ('keep', 'threshold_pct'))}")
    return found
