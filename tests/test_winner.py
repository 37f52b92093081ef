"""The winner rule `lab tune` and `lab serve --best` share, on verdicts the KEEP rule gives for
constructed windows (each arm one boot between controls at 100)."""

from __future__ import annotations

from lab.analysis.keep import ArmEvidence, BootValues, KeepRule, KeyMetric, Verdict, judge
from lab.analysis.winner import pick

TOKENS = KeyMetric("decode.agg_tok_s", higher_is_better=True)
TTFT = KeyMetric("decode.ttft_s", higher_is_better=False)
RULE = KeepRule(2.0, [TOKENS, TTFT], [], None)


def judged(tokens: float, ttft: float = 1.0) -> Verdict:
    return judge(RULE, ArmEvidence(arm=[BootValues("arm", {TOKENS.name: tokens, TTFT.name: ttft})],
                                   opening_control=BootValues("C#1", {TOKENS.name: 100.0, TTFT.name: 1.0}),
                                   closing_control=BootValues("C#2", {TOKENS.name: 100.0, TTFT.name: 1.0})))


def test_one_kept_arm_wins() -> None:
    assert pick({"A1": judged(120.0), "A2": judged(90.0)}) == pick({"A1": judged(120.0)})
    assert pick({"A1": judged(120.0), "A2": judged(90.0)}).arm == "A1"
    assert pick({"A1": judged(120.0)}).why == "the only arm kept"


def test_of_several_kept_arms_the_largest_gain_on_the_first_key_metric_wins() -> None:
    best = pick({"A1": judged(120.0), "A2": judged(150.0), "A3": judged(130.0)})
    assert best.arm == "A2"
    assert best.why == "best of 3 kept arms on decode.agg_tok_s: +50.0 % (A3: +30.0 %, A1: +20.0 %)"


def test_a_tie_on_the_first_key_metric_is_broken_by_the_next() -> None:
    best = pick({"A1": judged(120.0, ttft=0.9), "A2": judged(120.0, ttft=0.8)})
    assert best.arm == "A2" and best.why == "best of 2 kept arms on decode.ttft_s: +20.0 % (A1: +10.0 %)"


def test_kept_arms_no_key_metric_tells_apart_have_no_winner() -> None:
    best = pick({"A1": judged(120.0), "A2": judged(120.0)})
    assert best.arm is None
    assert best.why == ("kept 2 arms, and no key metric tells A1, A2 apart (+20.0 % on decode.agg_tok_s, "
                        "+0.0 % on decode.ttft_s)")


def test_no_kept_arm_no_winner_with_each_verdict_and_reason() -> None:
    best = pick({"A1": judged(90.0), "A2": judged(101.0)})
    assert best.arm is None
    assert best.why.startswith("kept no arm (A1: reject (decode.agg_tok_s -10.0 %")
    assert "; A2: reject (no key metric improves by more than 2 %" in best.why
    assert pick({}).why == "kept no arm (no arm has a verdict)"
