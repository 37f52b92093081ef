"""Re-judge stored runs under the KEEP rule before and after per-metric drift, and count its errors.

Each store is a lab store (`.db`, or `.db.xz` as it is) with what its arms truly are: `noop` (an arm
that changes nothing: keeping it is a false keep, rejecting it for a regression a false reject),
`inject` (a true slowdown: anything but a rejection for a regression is a miss) or `real` (the
truth is unknown: only decision rates count). A calibration run in any store is A/A: its inner
control boots are no-op arms.

Two designs judge the same boots:
- `stored`: every arm as `lab report` judges it today, with its repeats and the newest calibration
  of its ladder on its host;
- `first`: what a first run would have decided: no calibration, and each arm boot alone between
  the two controls that bracket it (each inner control of a calibration between its neighbours).

Two rules: `new`, the rule of `lab.analysis.keep` (with one arm boot and no calibration, a key
metric whose controls drift beyond max_drift_pct, or that has one warm control, is undecided on its
own), and `old`, the rule before it (such a drift voided the whole window: inconclusive unless a
gate failed; one warm control was judged by the point figure). `--inject-pct P` adds, for every
no-op window of the `first` design whose threshold is below P, one verdict per key metric with the
arm boot's figure of that metric made P % worse (throughput x (1 - P/100), latency / (1 - P/100)):
a synthetic true slowdown on real noise, each of which should be rejected.

    python benchmarks/verdict_corpus.py results/cpu-c480be3-bundled-noop.db.xz:noop \\
        results/h200-57d1fcf-h200-inject3.db.xz:inject --inject-pct 3
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from lab.analysis import keep, verdicts
from lab.analysis.keep import Decision, MetricStatus
from lab.store import reader
from lab.store.db import open_store

TRUTHS = ("noop", "inject", "real")
RULES = ("old", "new")
DESIGNS = ("stored", "first")
OUTCOMES = ("keep", "regressed", "no effect", "gate", "inconclusive")


@dataclass(frozen=True)
class Case:
    """One verdict to count: where it came from, what the arm truly is, and its verdict under the new rule."""

    store: str
    run: str
    arm: str
    design: str
    truth: str  # noop | inject | real | synthetic (a no-op boot made P % worse on one key metric)
    verdict: keep.Verdict


def outcome(verdict: keep.Verdict, rule: str) -> str:
    """keep | regressed | no effect | gate | inconclusive, under `rule`."""
    gate_failed = any(g is not None and not g.passed for g in verdict.gates.values())
    if gate_failed:
        return "gate"
    decision = verdict.decision if rule == "new" else _old_decision(verdict)
    if decision is Decision.KEEP:
        return "keep"
    if decision is Decision.INCONCLUSIVE:
        return "inconclusive"
    if rule == "old":
        regressed = any(_old_kind(row, verdict.threshold_pct) == "regressed" for row in verdict.metrics)
    else:
        regressed = any(row.status is MetricStatus.REGRESSED for row in verdict.metrics)
    return "regressed" if regressed else "no effect"


def _old_kind(row: keep.MetricRow, threshold: float) -> str:
    """A metric's finding under the rule before: a metric with no noise model (no interval) was judged
    by its point figure against one warm control too, and its controls' drift voided the window."""
    if row.interval is not None or row.status in (MetricStatus.MISSING, MetricStatus.INVALID):
        return {MetricStatus.IMPROVED: "improved", MetricStatus.REGRESSED: "regressed",
                MetricStatus.WITHIN: "within", MetricStatus.UNDECIDED: (
                    "possible" if row.interval is not None and row.interval.low_pct >= -threshold else "undecided"),
                }.get(row.status, "undecided")
    if row.status is MetricStatus.DRIFT:
        return "void"
    if row.delta_pct is None:
        return "undecided"
    return ("improved" if row.delta_pct > threshold else "regressed" if row.delta_pct < -threshold
            else "within")


def _old_decision(verdict: keep.Verdict) -> Decision:
    """The decision the rule before would have made from the same figures (no failed gate)."""
    if verdict.decision is Decision.INCONCLUSIVE and not any(row.arm_value is not None for row in verdict.metrics):
        return Decision.INCONCLUSIVE  # no warm control or no warm arm boot: nothing was judged
    kinds = {_old_kind(row, verdict.threshold_pct) for row in verdict.metrics}
    if "void" in kinds:
        return Decision.INCONCLUSIVE
    if "regressed" in kinds:
        return Decision.REJECT
    if "undecided" in kinds or any(g is None for g in verdict.gates.values()):
        return Decision.INCONCLUSIVE
    if "improved" in kinds:
        return Decision.KEEP
    return Decision.INCONCLUSIVE if "possible" in kinds else Decision.REJECT


def error(truth: str, result: str) -> str | None:
    """"false keep", "false reject", "miss" or None."""
    if truth == "noop" and result == "keep":
        return "false keep"
    if truth == "noop" and result == "regressed":
        return "false reject"
    if truth in ("inject", "synthetic") and result != "regressed":
        return "miss"
    return None


def _single_windows(evidence: verdicts.RunEvidence) -> Iterator[tuple[str, verdicts.RunEvidence]]:
    """(arm, evidence) for every arm boot alone between the controls that bracket it, uncalibrated; in a
    calibration run (no arms), every inner control between its neighbours, as a no-op arm."""
    arms = evidence.arms("arm")
    for window in dict.fromkeys(w for _, w in evidence.arm_roles.values()):
        # Boots that did not finish (a failure, an interrupted run) are no figure of any design.
        in_window = sorted((s for s in evidence.slots if s.window == window and s.role != "warmup" and s.measured),
                           key=lambda s: s.idx)
        controls = [s for s in in_window if s.role == "control"]
        control = evidence.control_of(window)
        if arms:
            inner = [s for s in in_window if s.role == "arm"]
        else:
            inner = [replace(s, arm=f"AA{s.idx:02d}", role="arm", position="arm") for s in controls[1:-1]]
        for slot in inner:
            before = [c for c in controls if c.idx < slot.idx]
            after = [c for c in controls if c.idx > slot.idx]
            if not before or not after:
                continue
            slots = [replace(before[-1], position="open"), replace(slot, position="arm"),
                     replace(after[0], position="close")]
            yield slot.arm, replace(evidence, slots=slots, noise={},
                                    arm_roles={control: ("control", window), slot.arm: ("arm", window)})


def _worse(evidence: verdicts.RunEvidence, arm: str, metric: verdicts.Selector, pct: float) -> verdicts.RunEvidence:
    """The evidence with the arm's cells of `metric` made `pct` % worse."""
    factor = 1 - pct / 100
    if not evidence.higher_is_better(metric):
        factor = 1 / factor
    slots = [replace(s, cells=tuple(replace(c, value=c.value * factor) if metric.matches(c) and c.value is not None
                                    else c for c in s.cells)) if s.arm == arm and s.role == "arm" else s
             for s in evidence.slots]
    return replace(evidence, slots=slots)


def cases(path: str, truth: str, designs: tuple[str, ...], inject_pct: float | None) -> Iterator[Case]:
    store = open_store(path, read_only=True)
    name = Path(path).name.removesuffix(".xz").removesuffix(".db")
    try:
        for run in reader.list_runs(store):
            evidence = verdicts.load(store, run.id)
            rule = evidence.spec.rule
            if rule is None:
                continue
            calibration = not evidence.arms("arm")
            run_truth = "noop" if calibration else truth
            if "stored" in designs and not calibration:
                for arm, verdict in verdicts.judge(evidence).items():
                    yield Case(name, run.name, arm, "stored", run_truth, verdict)
            if "first" not in designs:
                continue
            for arm, single in _single_windows(evidence):
                yield Case(name, run.name, arm, "first", run_truth, verdicts.judge_arm(single, rule, arm))
                # A slowdown within the threshold is rightly "no effect": only larger ones are asked for.
                if inject_pct is None or run_truth != "noop" or inject_pct <= rule.threshold_pct:
                    continue
                for metric in evidence.spec.metrics:
                    worse = _worse(single, arm, metric, inject_pct)
                    yield Case(name, run.name, f"{arm} -{inject_pct:g} % on {metric.label}", "first", "synthetic",
                               verdicts.judge_arm(worse, rule, arm))
    finally:
        store.close()


def table(found: list[Case], rules: tuple[str, ...]) -> list[str]:
    """A Markdown table: one row per (store, design, truth, rule), then totals per (design, truth, rule)."""
    header = ["store", "design", "truth", "rule", "verdicts", *OUTCOMES, "decided %", "false keep", "false reject",
              "miss"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * 4 + "---:|" * (len(header) - 4)]

    def row(label: str, design: str, truth: str, rule: str, members: list[Case]) -> str:
        results = [outcome(c.verdict, rule) for c in members]
        counts = Counter(results)
        errors = Counter(error(truth, r) for r in results)
        decided = 100 * (len(results) - counts["inconclusive"]) / len(results)
        cells = [label, design, truth, rule, str(len(results)), *(str(counts[o]) for o in OUTCOMES),
                 f"{decided:.0f}", *(str(errors[e]) for e in ("false keep", "false reject", "miss"))]
        return "| " + " | ".join(cells) + " |"

    def groups(key: Callable[[Case], tuple[str, ...]]) -> Iterator[tuple[tuple[str, ...], list[Case]]]:
        for value in dict.fromkeys(key(c) for c in found):
            yield value, [c for c in found if key(c) == value]

    for (store, design, truth), members in groups(lambda c: (c.store, c.design, c.truth)):
        lines += [row(store, design, truth, rule, members) for rule in rules]
    for (design, truth), members in groups(lambda c: (c.design, c.truth)):
        lines += [row("**all**", design, truth, rule, members) for rule in rules]
    return lines


def _store_arg(text: str) -> tuple[str, str]:
    path, _, truth = text.rpartition(":")
    if not path or truth not in TRUTHS:
        raise argparse.ArgumentTypeError(f"{text!r}: write STORE:TRUTH with TRUTH one of {', '.join(TRUTHS)}")
    if not Path(path).is_file():
        raise argparse.ArgumentTypeError(f"{path}: no such store")
    return path, truth


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stores", nargs="+", type=_store_arg, metavar="STORE:TRUTH",
                        help=f"a lab store (.db or .db.xz) and what its arms are: {', '.join(TRUTHS)}")
    parser.add_argument("--rule", choices=[*RULES, "both"], default="both", help="the rule(s) to judge by")
    parser.add_argument("--design", choices=[*DESIGNS, "both"], default="both", help="the design(s) to judge")
    parser.add_argument("--inject-pct", type=float, metavar="P",
                        help="also judge every no-op window of the first design with one key metric P %% worse")
    parser.add_argument("--list", action="store_true", help="print every verdict the rules disagree on, and every "
                                                           "false keep or reject, with its deciding reason")
    args = parser.parse_args(argv)
    rules = RULES if args.rule == "both" else (args.rule,)
    designs = DESIGNS if args.design == "both" else (args.design,)
    found = [case for path, truth in args.stores for case in cases(path, truth, designs, args.inject_pct)]
    print("\n".join(table(found, rules)))
    if args.list:
        for c in found:
            results = {rule: outcome(c.verdict, rule) for rule in rules}
            if len(set(results.values())) > 1 or any(error(c.truth, r) in ("false keep", "false reject")
                                                     for r in results.values()):
                shown = ", ".join(f"{rule} {result}" for rule, result in results.items())
                print(f"- {c.store}/{c.run} {c.arm} ({c.design}, {c.truth}): {shown}: {c.verdict.reasons[0]}")


if __name__ == "__main__":
    main()
