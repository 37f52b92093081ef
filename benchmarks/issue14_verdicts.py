"""Tally a run's stored KEEP verdicts for issue 14's targets: keeps, rejects citing a regression,
rejects for no effect, inconclusive (undecided or a void window), and the repeats the undecided
ones ask for. Judges the run again first, so the newest calibration of its ladder is used.

    .venv/bin/python benchmarks/issue14_verdicts.py DB RUN
"""

from __future__ import annotations

import collections
import sys

from lab.analysis.verdicts import judge_run
from lab.store import reader
from lab.store.db import open_store


def main(db: str, run: str) -> None:
    store = open_store(db, create=False)
    run_id = reader.find_run(store, run).id
    tally: collections.Counter[str] = collections.Counter()
    needed = []
    for arm, verdict in judge_run(store, run_id).items():
        statuses = {str(row.status) for row in verdict.metrics}
        if verdict.decision == "reject":
            kind = "reject: regression" if "regressed" in statuses else "reject: no effect"
        else:
            kind = str(verdict.decision)
        tally[kind] += 1
        needed += [row.repeats_needed for row in verdict.metrics if row.repeats_needed]
        mde = ", ".join(f"{row.interval.mde_pct:.1f}" for row in verdict.metrics if row.interval)
        print(f"{arm}: {kind}; MDE % [{mde}]; {verdict.reasons[0]}")
    print(dict(tally), "undecided metrics ask for", sorted(needed), "boots")


if __name__ == "__main__":
    main(*sys.argv[1:3])
