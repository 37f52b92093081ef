"""Per-task pass/fail of an arm against its control, and the exact McNemar test of what broke
against what was fixed: the qeval instrument's per-boot gate, and the same figures in `lab compare`
and the reports. Pure functions over plain values, here beside the instrument that needs them so
that measuring never imports the analysis above it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p for discordant pairs: b broke (control pass, arm fail), c fixed.

    Under the null each discordant pair is a fair coin, so this is scipy's exact binomial test of
    min(b, c) successes in b + c trials at 1/2; testing the smaller count makes p(b, c) == p(c, b)
    exactly. b = c = 0 gives 1.0.
    """
    if b < 0 or c < 0:
        raise ValueError(f"McNemar counts must be non-negative, got broke={b}, fixed={c}")
    if b + c == 0:
        return 1.0  # scipy refuses zero trials; no discordant pair is no evidence
    # scipy.stats costs half a second to import: commands that only list runs never need it.
    from scipy import stats

    return float(stats.binomtest(min(b, c), b + c, 0.5).pvalue)


@dataclass(frozen=True)
class PairedCounts:
    """Per-task pass/fail of an arm against its control, over the tasks both of them ran."""

    both_pass: int
    both_fail: int
    broke: int  # passed on the control, failed on the arm
    fixed: int  # failed on the control, passed on the arm
    n: int  # tasks present on both sides (the four cells above add up to it)
    missing: tuple[str, ...]  # task ids present on only one side, sorted

    @property
    def p_value(self) -> float:
        """Exact McNemar p of broke vs fixed."""
        return mcnemar_exact(self.broke, self.fixed)

    def summary(self) -> str:
        """One line for a gate's detail, e.g. '3 broke, 0 fixed, p=0.25'."""
        text = f"{self.broke} broke, {self.fixed} fixed, p={self.p_value:.3g}"
        if self.missing:
            text += f", {len(self.missing)} task(s) on one side only"
        return text


def paired_counts(control: Mapping[str, bool], arm: Mapping[str, bool]) -> PairedCounts:
    """Cross-tabulate task outcomes; tasks run on only one side are listed in `missing`."""
    shared = control.keys() & arm.keys()
    cells = {"both_pass": 0, "both_fail": 0, "broke": 0, "fixed": 0}
    for task in shared:
        on_control, on_arm = bool(control[task]), bool(arm[task])
        if on_control and on_arm:
            cells["both_pass"] += 1
        elif not on_control and not on_arm:
            cells["both_fail"] += 1
        elif on_control:
            cells["broke"] += 1
        else:
            cells["fixed"] += 1
    missing = tuple(sorted(control.keys() ^ arm.keys()))
    return PairedCounts(n=len(shared), missing=missing, **cells)
