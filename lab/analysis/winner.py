"""Which arm of a run is *the winner*: one rule, shared by `lab tune` (the winner its confirmation
names) and `lab serve --best` (the arm it serves), so the two never disagree.

Only an arm the KEEP rule kept can win. One kept arm wins. Several kept arms (each was kept alone
against its window's warm controls, so each was measured as it would be served) are ranked by their
improvement over those controls on the first key metric, then on the next where they tie; the
first wins, and the pick says by how much it led. Arms that no key metric tells apart have no
winner: nothing measured chose between them. No kept arm, no winner, with each arm's verdict and
first reason.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from lab.analysis.keep import Decision, Verdict


@dataclass(frozen=True)
class Winner:
    arm: str | None  # None: no winner, and `why` says why
    why: str  # why this arm, or why none ("kept no arm (A1: reject (...))")


def pick(verdicts: Mapping[str, Verdict]) -> Winner:
    """The winner among a run's judged arms (name -> verdict), or why there is none."""
    kept = {name: v for name, v in verdicts.items() if v.decision == Decision.KEEP}
    if not kept:
        why = "; ".join(f"{name}: {v.decision} ({v.reasons[0] if v.reasons else 'no reason given'})"
                        for name, v in verdicts.items()) or "no arm has a verdict"
        return Winner(None, f"kept no arm ({why})")
    if len(kept) == 1:
        return Winner(next(iter(kept)), "the only arm kept")
    ranked = sorted(kept, key=lambda name: _gains(kept[name]), reverse=True)
    best, runner_up = ranked[0], ranked[1]
    if _gains(kept[best]) == _gains(kept[runner_up]):
        tied = [name for name in ranked if _gains(kept[name]) == _gains(kept[best])]
        return Winner(None, f"kept {len(kept)} arms, and no key metric tells {', '.join(tied)} apart "
                            f"({_shown(kept[best])})")
    # The metric that decided: the first on which the best leads the runner-up.
    decided = next(i for i, (a, b) in enumerate(zip(_gains(kept[best]), _gains(kept[runner_up]))) if a != b)
    others = ", ".join(f"{name}: {_gain(kept[name], decided)}" for name in ranked[1:])
    return Winner(best, f"best of {len(kept)} kept arms on {kept[best].metrics[decided].name}: "
                        f"{_gain(kept[best], decided)} ({others})")


def _gains(verdict: Verdict) -> tuple[float, ...]:
    """Each key metric's improvement over the controls, in % in its good direction."""
    return tuple(-math.inf if row.delta_pct is None else row.delta_pct for row in verdict.metrics)


def _gain(verdict: Verdict, i: int) -> str:
    value = verdict.metrics[i].delta_pct
    return "no value" if value is None else f"{value:+.1f} %"


def _shown(verdict: Verdict) -> str:
    return ", ".join(f"{_gain(verdict, i)} on {row.name}" for i, row in enumerate(verdict.metrics)) or "no key metric"
