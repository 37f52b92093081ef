"""Prompt lookup's cost model: whether a draft pays, from decode step times measured on this device
when the engine loads (`core/draft_probe.py`).

At batch size B, a plain decode step takes `overlapped` seconds when the host queues it behind
the step still running (overlapped decode), `plain` seconds when it cannot (the host must read the
last tokens first, as on every step that drafts), and `verify[d]` seconds when every sequence
verifies a d-token draft (measured for d = 1 and k, linear in between). Costs are counted in
tokens of plain decode: at B / overlapped tokens per second. A step in which some sequences draft
costs the batch F = B (plain / overlapped - 1) tokens for giving up the overlap, plus, per drafting
sequence, M(d) = (verify[d] - plain) / overlapped tokens for verifying its d tokens; it gains the
draft tokens accepted. So the step drafts when the sum, over the sequences whose expected gain
beats their own M(d), of (expected accepted - M(d)) beats F; each sequence drafts the d that gains
it most. Once a step cannot overlap anyway (F is spent, or on the CPU where nothing overlaps and
F = 0), each sequence whose expected gain beats its own M(d) drafts.

With every sequence alike, a d-token draft pays above verify[d] / overlapped - 1 tokens accepted
per look: the break-even the engine reports. Between the measured batch sizes the step times are
interpolated linearly; beyond the largest, its figures hold."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from typing import Any

from lab.engine.spec.acceptance import HitRates


@dataclass(frozen=True)
class StepTimes:
    """Seconds per decode step at one batch size."""
    batch: int
    overlapped: float  # equal to `plain` where steps do not overlap (the CPU, --overlap-decode off)
    plain: float
    verify: dict[int, float]  # draft length -> a step in which every sequence verifies that many


@dataclass(frozen=True)
class Price:
    """What drafting costs at one batch size, in tokens of plain decode."""
    sync: float  # F: the batch's cost of a step that cannot overlap
    first: float  # M(1): one sequence's cost of verifying a one-token draft
    extra: float  # M(d + 1) - M(d): each further draft token

    def best(self, rates: HitRates, room: int) -> tuple[int, float]:
        """The draft length (at most `room`) that gains a sequence with these hit rates the most,
        and that gain net of M(d); (0, 0.0) when no draft gains more than it costs."""
        best, best_net, gain = 0, 0.0, 0.0
        step = rates.first  # the expected gain of the d-th draft token
        for d in range(1, room + 1):
            gain += step
            net = gain - self.first - (d - 1) * self.extra
            if net > best_net:
                best, best_net = d, net
            step *= rates.after_hit
            if step <= self.extra:  # each further token gains less than it costs
                break
        return best, best_net


def _interpolate(x: int, xs: list[int], ys: list[float]) -> float:
    i = bisect_left(xs, x)
    if i == 0:
        return ys[0]
    if i == len(xs):
        return ys[-1]
    return ys[i - 1] + (ys[i] - ys[i - 1]) * (x - xs[i - 1]) / (xs[i] - xs[i - 1])


class DraftCosts:
    def __init__(self, measured: list[StepTimes]) -> None:
        self.measured = sorted(measured, key=lambda t: t.batch)
        self.lengths = sorted(self.measured[0].verify)  # 1 and k
        self._prices: dict[int, Price] = {}

    def times(self, batch: int) -> StepTimes:
        xs = [t.batch for t in self.measured]

        def at(ys: list[float]) -> float:
            return _interpolate(batch, xs, ys)

        return StepTimes(batch, at([t.overlapped for t in self.measured]), at([t.plain for t in self.measured]),
                         {d: at([t.verify[d] for t in self.measured]) for d in self.lengths})

    def price(self, batch: int) -> Price:
        price = self._prices.get(batch)
        if price is None:
            t = self.times(batch)
            lo, hi = self.lengths[0], self.lengths[-1]
            extra = (t.verify[hi] - t.verify[lo]) / (hi - lo) / t.overlapped if hi > lo else 0.0
            price = self._prices[batch] = Price(sync=batch * max(0.0, t.plain / t.overlapped - 1),
                                                first=max(0.0, (t.verify[lo] - t.plain) / t.overlapped),
                                                extra=max(0.0, extra))
        return price

    def break_even(self, batch: int, d: int) -> float:
        """Tokens accepted per look above which a step where every sequence drafts d tokens pays."""
        price = self.price(batch)
        return price.sync / batch + price.first + (d - 1) * price.extra

    def to_dict(self) -> list[dict[str, Any]]:
        k = self.lengths[-1]
        return [{"batch": t.batch, "overlapped_step_ms": 1e3 * t.overlapped, "plain_step_ms": 1e3 * t.plain,
                 "verify_step_ms": {str(d): 1e3 * s for d, s in t.verify.items()},
                 "break_even_tokens_per_look": self.break_even(t.batch, k),
                 "break_even_acceptance": self.break_even(t.batch, k) / k} for t in self.measured]

    def summary(self) -> str:
        """One line for the startup log."""
        k = self.lengths[-1]
        per = [f"batch {t.batch}: overlapped {1e3 * t.overlapped:.2f} ms, plain {1e3 * t.plain:.2f} ms, "
               f"verify k={k} {1e3 * t.verify[k]:.2f} ms, pays above {self.break_even(t.batch, k):.2f} tokens "
               f"per look ({100 * self.break_even(t.batch, k) / k:.0f}% acceptance)" for t in self.measured]
        return "; ".join(per)
