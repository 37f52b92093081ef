"""`lab serve --best RUN`: put the configuration the KEEP rule kept into service.

The verdicts are judged from the run's stored cells as `lab report` judges them
(`lab.analysis.verdicts`), and the arm is picked by the rule `lab tune` names its winner by
(`lab.analysis.winner`): the one kept arm, or the best of several on the key metrics.

The arm is re-rendered from the run's stored ladder text, and its config hash must equal the one
stored with the run: what is served is what was measured, or the command refuses. The engine then
replaces this process (exec), so it runs in the foreground and gets the terminal's signals itself.
"""

from __future__ import annotations

import logging
import os
import shlex
from dataclasses import dataclass

from lab.analysis import verdicts as keep_verdicts
from lab.analysis import winner
from lab.ladder import render
from lab.ladder.engines import Launch, kind_of
from lab.ladder.validate import parse_ladder
from lab.runner import boot as engine_boot
from lab.store import reader
from lab.store.db import Store

log = logging.getLogger("lab.serve")


class ServeError(LookupError):
    """No arm to serve (none kept, kept arms nothing tells apart, an unknown --arm, a config that no
    longer renders the same)."""


@dataclass(frozen=True)
class Chosen:
    run: str
    arm: str
    window: str
    decision: str  # keep | reject | inconclusive | control (a control has no verdict)
    reason: str
    picked: str  # why this arm: the winner rule's word, or that --arm named it
    config_hash: str
    launch: Launch

    def shell_line(self) -> str:
        """The environment the lab sets and the argv, as one line a shell runs as is."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.launch.env.items()))
        return (f"env {env} " if env else "") + shlex.join(self.launch.argv)


def choose(store: Store, run_ref: str, arm: str | None, host: str, port: int) -> Chosen:
    """The run's winner (`lab.analysis.winner`), or `arm` whatever its verdict; ServeError says why
    there is none."""
    run = reader.find_run(store, run_ref)
    verdicts = keep_verdicts.judge(keep_verdicts.load(store, run.id))
    stored = {a.name: a for a in reader.arms(store, run.id)}
    picked = "picked with --arm"
    if arm is None:
        best = winner.pick(verdicts)
        if best.arm is None:
            raise ServeError(f"run {run.name} {best.why}; serve one anyway with --arm NAME")
        arm, picked = best.arm, best.why
    if arm not in stored:
        raise ServeError(f"run {run.name} has no arm {arm!r}; its arms: {', '.join(stored)}")
    ladder = parse_ladder(run.ladder_text, f"{run.name} (stored ladder)")
    spec = render.plan(ladder).arm(arm)
    if spec.config_hash != stored[arm].config_hash:
        raise ServeError(f"arm {arm} renders to config {spec.config_hash} here but was measured as "
                         f"{stored[arm].config_hash}; this lab version would not serve what run {run.name} measured")
    verdict = verdicts.get(arm)
    decision = str(verdict.decision) if verdict else stored[arm].role
    reason = (verdict.reasons[0] if verdict and verdict.reasons else
              "the unchanged base" if stored[arm].role == "control" else "not judged: the ladder names no key metric")
    return Chosen(run.name, arm, stored[arm].window, decision, reason, picked, spec.config_hash,
                  kind_of(spec.recipe).launch(spec, port, host))


def exec_engine(chosen: Chosen) -> None:
    """Replace this process with the engine: inherited LAB_ENGINE_* variables removed, the arm's set,
    exactly as every measured boot of it ran."""
    env, removed = engine_boot.child_env(chosen.launch.env)
    if removed:
        log.warning("not passed to the engine (the arm sets its own): %s", ", ".join(removed))
    os.execvpe(chosen.launch.argv[0], chosen.launch.argv, env)
