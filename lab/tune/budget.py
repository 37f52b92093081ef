"""What spends a study's budget: every trial it asked for, but those that measured nothing of their
own values and say why in the user attribute `not_counted`: a trial a killed `lab tune` left
running (abandoned), and the two failures in a row that stopped the study (they measured the host
or the base, not the trial's knobs). So a resumed or repaired study still gets the trials it was
given."""

from __future__ import annotations

import optuna

NOT_COUNTED = "not_counted"  # trial user attribute: why the trial does not spend the budget


def counted(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    return [t for t in study.get_trials(deepcopy=False) if NOT_COUNTED not in t.user_attrs]


def spent_s(study: optuna.Study) -> float:
    """Seconds the counted trials took. An abandoned trial "ends" when the next `lab tune` fails it,
    so its span is not time it measured."""
    return sum((t.datetime_complete - t.datetime_start).total_seconds()
               for t in counted(study) if t.datetime_complete and t.datetime_start)
