"""What spends a study's budget: every trial it asked for, but those that measured nothing of their
own values: a trial a killed `lab tune` left running (abandoned), and the two failures in a row that
stopped the study (they measured the host or the base, not the trial's knobs). So a resumed or
repaired study still gets the trials it was given.

Such a trial is named by a study user attribute `not_counted:<number>` holding why: one attribute
per trial, so processes sharing a study never overwrite each other's, and set on the study because
Optuna freezes a trial's own attributes once it has finished.
"""

from __future__ import annotations

import optuna

PREFIX = "not_counted:"


def exclude(study: optuna.Study, number: int, why: str) -> None:
    study.set_user_attr(f"{PREFIX}{number}", why)


def not_counted(study: optuna.Study) -> dict[int, str]:
    """Trial number -> why it does not spend the budget."""
    return {int(key[len(PREFIX):]): why for key, why in study.user_attrs.items() if key.startswith(PREFIX)}


def counted(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    excluded = not_counted(study)
    return [t for t in study.get_trials(deepcopy=False) if t.number not in excluded]


def spent_s(study: optuna.Study) -> float:
    """Seconds the counted trials took. An abandoned trial "ends" when the next `lab tune` fails it,
    so its span is not time it measured."""
    return sum((t.datetime_complete - t.datetime_start).total_seconds()
               for t in counted(study) if t.datetime_complete and t.datetime_start)
