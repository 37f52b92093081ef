"""`lab report --study NAME` (also written at the end of `lab tune`): a study's report in
`<out>/<study>/`, as `lab report` writes a run's: `index.md`, a self-contained `index.html` and one
PNG per figure. It shows the optimization history, Optuna's parameter importances, the Pareto front
when there are several objectives, every trial with its run and boot, its constraints' figures
and what made it infeasible or failed, and the confirmation's KEEP verdicts with how far the
confirmed numbers moved from the trials' own.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import optuna
import pandas as pd
from matplotlib.ticker import MaxNLocator

from lab.report import document as doc
from lab.report.figures import ARM_COLOURS, Drawn, new_figure, png
from lab.store.db import Store
from lab.store.study_storage import has_studies, study_storage
from lab.tune import constraints
from lab.tune.budget import not_counted
from lab.tune.confirmation import Confirmation, stored
from lab.tune.spec import TuneFile, parse_tune

log = logging.getLogger("lab.report")
INFEASIBLE = "#d62728"


def write_tune_report(store: Store, study_name: str, out: str | Path = "reports") -> Path:
    """Write the report of a study and return its directory; LookupError when the store has no such study."""
    missing = LookupError(f"no study {study_name!r} in this store; `lab tune TUNE.yaml` makes one")
    if not has_studies(store):
        raise missing
    try:
        study = optuna.load_study(study_name=study_name, storage=study_storage(store))
    except KeyError:
        raise missing from None
    tune = parse_tune(study.user_attrs["tune_text"], f"{study_name} (stored tune file)")
    trials = study.get_trials(deepcopy=False)
    complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    confirmation = stored(store, study, tune)
    scores = importances(study, tune)
    drawn = [_history(complete, tune, study), _importances(scores, complete, tune)]
    if len(tune.objectives) > 1:
        drawn.append(_pareto(study, complete, tune))
    directory = Path(out) / study_name.replace("/", "_")
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob("*.png"):
        stale.unlink()
    for figure in drawn:
        if figure.png is not None:
            (directory / f"{figure.name}.png").write_bytes(figure.png)
    blocks = _blocks(study, tune, trials, drawn, confirmation, scores)
    title = f"Study {study_name}"
    (directory / "index.md").write_text(doc.markdown(title, blocks))
    (directory / "index.html").write_text(doc.html_document(title, blocks))
    log.info("report of study %s written to %s", study_name, directory)
    return directory


def _feasible(trial: optuna.trial.FrozenTrial) -> bool:
    return all(c <= 0 for c in trial.user_attrs.get(constraints.VIOLATIONS) or [])


def _history(complete: list[optuna.trial.FrozenTrial], tune: TuneFile, study: optuna.Study) -> Drawn:
    title = "Optimization history"
    if not complete:
        return Drawn("history", title, None, "No trial was measured.")
    figure = new_figure(height=3.2 * len(tune.objectives))
    for i, (objective, direction) in enumerate(zip(tune.objectives, study.directions)):
        ax = figure.add_subplot(len(tune.objectives), 1, i + 1)
        maximize = direction == optuna.study.StudyDirection.MAXIMIZE
        feasible = [t for t in complete if _feasible(t)]
        infeasible = [t for t in complete if not _feasible(t)]
        ax.scatter([t.number for t in feasible], [t.values[i] for t in feasible], color=ARM_COLOURS[0],
                   label="trial (feasible)", zorder=3)
        if infeasible:
            ax.scatter([t.number for t in infeasible], [t.values[i] for t in infeasible], color=INFEASIBLE,
                       marker="x", label="trial (violates a constraint)", zorder=3)
        best, xs, ys = None, [], []
        for t in sorted(feasible, key=lambda t: t.number):
            if best is None or (t.values[i] > best if maximize else t.values[i] < best):
                best = t.values[i]
            xs.append(t.number)
            ys.append(best)
        if xs:
            ax.step(xs, ys, where="post", color=ARM_COLOURS[1], label="best feasible so far")
        ax.set_xlabel("trial")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(f"{objective.metric} ({'max' if maximize else 'min'})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return Drawn("history", title, png(figure), "Each measured trial's objective in the order the trials "
                                                 "were asked for; failed trials have no value and are not drawn.")


def importances(study: optuna.Study, tune: TuneFile) -> dict[str, dict[str, float]] | str:
    """Optuna's importance of each parameter per objective, or why it cannot rate them yet."""
    found: dict[str, dict[str, float]] = {}
    for i, (objective, direction) in enumerate(zip(tune.objectives, study.directions)):
        # The default evaluator (PED-ANOVA) rates what it takes to make the target low: a maximized
        # objective is negated, and its warning saying so is expected.
        sign = -1.0 if direction == optuna.study.StudyDirection.MAXIMIZE else 1.0
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*computes the importances of params to achieve low")
                found[objective.metric] = optuna.importance.get_param_importances(
                    study, target=lambda t, i=i, sign=sign: sign * t.values[i])
        except (ValueError, RuntimeError) as exc:  # too few trials, or a parameter that never varied
            return f"Optuna cannot rate the parameters yet: {exc}"
    if not any(found.values()):
        return "Optuna cannot rate the parameters yet: too few measured trials."
    return found


def _importances(found: dict[str, dict[str, float]] | str, complete: list[optuna.trial.FrozenTrial],
                 tune: TuneFile) -> Drawn:
    title = "Parameter importances"
    if isinstance(found, str):
        return Drawn("importances", title, None, found)
    figure = new_figure(height=1.2 + 0.9 * len(tune.space) * len(found))
    ax = figure.add_subplot()
    names = [p.name for p in tune.space]
    height = 0.8 / len(found)
    for k, (metric, scores) in enumerate(found.items()):
        ax.barh([j + k * height for j in range(len(names))], [scores.get(n, 0.0) for n in names], height=height,
                color=ARM_COLOURS[k % len(ARM_COLOURS)], label=metric)
    ax.set_yticks([j + height * (len(found) - 1) / 2 for j in range(len(names))], names)
    ax.set_xlabel("importance (Optuna's default evaluator; sums to 1 per objective)")
    ax.legend(fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    return Drawn("importances", title, png(figure), f"How much of each objective's variation over the "
                                                     f"{len(complete)} measured trials each parameter explains.")


def _pareto(study: optuna.Study, complete: list[optuna.trial.FrozenTrial], tune: TuneFile) -> Drawn:
    title = "Pareto front"
    front = {t.number for t in study.best_trials}
    if not complete:
        return Drawn("pareto", title, None, "No trial was measured.")
    figure = new_figure(width=6.4, height=5.2)
    ax = figure.add_subplot()
    for group, colour, label in (([t for t in complete if t.number in front], ARM_COLOURS[1], "Pareto front"),
                                 ([t for t in complete if t.number not in front and _feasible(t)], ARM_COLOURS[0],
                                  "dominated"),
                                 ([t for t in complete if not _feasible(t)], INFEASIBLE, "violates a constraint")):
        if group:
            ax.scatter([t.values[0] for t in group], [t.values[1] for t in group], color=colour, label=label, zorder=3)
            for t in group:
                ax.annotate(str(t.number), (t.values[0], t.values[1]), fontsize=7, xytext=(3, 3),
                            textcoords="offset points")
    ax.set_xlabel(tune.objectives[0].metric)
    ax.set_ylabel(tune.objectives[1].metric)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return Drawn("pareto", title, png(figure), "The first two objectives of each measured trial (its number "
                                               "beside it); the front is the feasible trials no other one beats "
                                               "on every objective.")


def _blocks(study: optuna.Study, tune: TuneFile, trials: list[optuna.trial.FrozenTrial], drawn: list[Drawn],
            confirmation: Confirmation | None, scores: dict[str, dict[str, float]] | str) -> list[doc.Block]:
    states = pd.Series([t.state.name.lower() for t in trials]).value_counts()
    objectives = ", ".join(f"{o.metric} ({d.name.lower()})" for o, d in zip(tune.objectives, study.directions))
    blocks: list[doc.Block] = [doc.Paragraph(
        f"Tune file {tune.name}: {len(tune.space)} parameters, objectives {objectives}, "
        f"{len(tune.constraints)} constraint{'' if len(tune.constraints) == 1 else 's'}, seed {tune.seed}, "
        f"budget {tune.budget.trials} trials. "
        + ", ".join(f"{n} {state}" for state, n in states.items()) + ".")]
    blocks.append(doc.Heading("Confirmation"))
    if confirmation is None:
        blocks.append(doc.Paragraph("No confirmation yet: a plain `lab tune` runs it once the budget is spent.",
                                    note=True))
    else:
        blocks.append(doc.Paragraph(
            f"The best trials re-measured as arms of run {confirmation.run}, bracketed by the base configuration "
            "as warm control and judged by the KEEP rule. "
            + (f"Winner: {confirmation.winner.arm} (trial {confirmation.winner.trial}), {confirmation.why}; "
               f"`lab serve --best {confirmation.run}` serves it (the same rule picks it)."
               if confirmation.winner else f"No winner: the confirmation {confirmation.why}. The base stays.")))
        blocks.append(doc.TableBlock(_confirmation_table(confirmation, tune), row_class="KEEP"))
    for figure in drawn:
        blocks += [doc.Heading(figure.title), doc.FigureBlock(figure)]
        if figure.name == "importances" and not isinstance(scores, str):
            blocks.append(doc.TableBlock(pd.DataFrame(
                [{"parameter": p.name, **{m: f"{v.get(p.name, 0.0):.3f}" for m, v in scores.items()}}
                 for p in tune.space])))
    front = {t.number for t in study.best_trials} if len(tune.objectives) > 1 else None
    blocks += [doc.Heading("Trials"), doc.TableBlock(_trials_table(trials, tune, front, not_counted(study)))]
    blocks += [doc.Heading("Open it in optuna-dashboard"),
               doc.Paragraph(f"The study is named {study.study_name} in the lab's store: "
                             "`pip install optuna-dashboard`, then `optuna-dashboard sqlite:///lab.db` "
                             "(or the store's `postgresql://…` URL).")]
    blocks += [doc.Heading("Tune file"), doc.Code(study.user_attrs["tune_text"], "yaml")]
    return blocks


def _confirmation_table(confirmation: Confirmation, tune: TuneFile) -> pd.DataFrame:
    rows = []
    for c in confirmation.candidates:
        row = {"arm": c.arm, "trial": c.trial, "params": _params(c.params)}
        for o, t, v, d in zip(tune.objectives, c.trial_values, c.confirmed, c.moved_pct()):
            row[f"{o.metric} trial"] = f"{t:.4g}"
            row[f"{o.metric} confirmed"] = "no value" if v is None else f"{v:.4g}"
            row[f"{o.metric} moved"] = "" if d is None else f"{d:+.1f} %"
        row["KEEP"] = c.decision
        row["reason"] = c.reason
        rows.append(row)
    return pd.DataFrame(rows)


def _trials_table(trials: list[optuna.trial.FrozenTrial], tune: TuneFile, front: set[int] | None,
                  excluded: dict[int, str]) -> pd.DataFrame:
    rows = []
    for t in trials:
        row = {"trial": t.number, "state": t.state.name.lower(), "params": _params(t.params)}
        for i, o in enumerate(tune.objectives):
            row[o.metric] = "" if t.values is None else f"{t.values[i]:.4g}"
        figures = t.user_attrs.get(constraints.FIGURES) or [None] * len(tune.constraints)
        for gate, value in zip(tune.constraints, figures):
            row[f"{constraints.key(gate)} ({constraints.bounds(gate)})"] = "" if value is None else f"{value:.4g}"
        row["feasible"] = "" if t.values is None else ("yes" if _feasible(t) else "no")
        if front is not None:
            row["Pareto front"] = "yes" if t.number in front else ""
        row["run"] = t.user_attrs.get("run", "")
        row["boot"] = t.user_attrs.get("boot_id", "")
        row["host"] = t.user_attrs.get("host", "")
        row["why"] = _why(t, tune, figures, excluded.get(t.number))
        rows.append(row)
    return pd.DataFrame(rows)


def _why(t: optuna.trial.FrozenTrial, tune: TuneFile, figures: list[float | None], excluded: str | None) -> str:
    """Why the trial failed or is infeasible, whether it spends the budget, and whether it booted cold."""
    parts = []
    if t.values is not None and not _feasible(t):
        broken = constraints.broken(tune.constraints, figures) if constraints.FIGURES in t.user_attrs else ""
        parts.append(f"infeasible: {broken or 'a constraint is violated'}")
    if t.user_attrs.get("reason"):
        parts.append(t.user_attrs["reason"])
    if excluded:
        parts.append(f"not counted against the budget: {excluded}")
    if t.user_attrs.get("cold"):
        parts.append(f"booted cold twice ({t.user_attrs['cold']})")
    elif t.user_attrs.get("rebooted"):
        parts.append(f"measured on a second boot (the first was {t.user_attrs['rebooted']})")
    return " · ".join(parts)


def _params(params: dict[str, object]) -> str:
    return ", ".join(f"{k.split(':', 1)[1]}={v:.4g}" if isinstance(v, float) else f"{k.split(':', 1)[1]}={v}"
                     for k, v in params.items())
