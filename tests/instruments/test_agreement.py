"""agreement: two boots of the same SmolLM2 config agree exactly; a bfloat16 arm does not; the KL
definition; text-only comparison when logprobs are absent; the completions endpoint."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Iterator
from dataclasses import replace

import pytest
from scipy.stats import entropy
from sqlalchemy import select

from lab.instruments.agreement import AgreementInstrument, AgreementParams, Generation, compare, topk_kl
from lab.instruments.base import BootContext
from lab.instruments.opening_control import load_reference
from lab.store import models as m
from lab.store.db import Store
from lab.store.records import Cell
from lab.store.stored_rows import StoredRows
from tests.instruments.ladder_run import run_ladder
from tests.instruments.speed_boot import SpeedBench

# bfloat16 leaves float32's greedy path within a few tokens on some of the eight prompts (at the
# first and the fifth token here), so 16 tokens a prompt show the divergence the tests look for.
MAX_TOKENS = 16
AGREEMENT_LADDER = """\
    name: agree
    engine:
      kind: bundled
      model: smollm2-135m
      flags: {device: cpu, dtype: float32, max-model-len: 1024, kv-cache-memory-bytes: 67108864}
    windows:
      - name: W1
        control: C0ctl
        arms:
          - {name: A1bf16, flags: {dtype: bfloat16}}
    instruments:
      agreement: {prompts: 8, max_tokens: %d, top_logprobs: 5}
    """ % MAX_TOKENS


@pytest.fixture(scope="module")
def agreement_window(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    """`lab run` of C0ctl (float32), A1bf16, C0ctl: the same config twice around a bfloat16 arm."""
    store = run_ladder(tmp_path_factory.mktemp("agreement"), AGREEMENT_LADDER, "agree", timeout=300)
    yield store
    store.close()


def boots(store: Store) -> dict[str, int]:
    """'open' / 'A1bf16' / 'close' -> boot id."""
    with store.session() as s:
        rows = s.execute(select(m.Slot.position, m.Arm.name, m.Boot.id).join(m.Boot, m.Boot.slot_id == m.Slot.id)
                         .join(m.Arm, m.Slot.arm_id == m.Arm.id).where(m.Boot.status == "done")).all()
    return {name if position == "arm" else position: boot for position, name, boot in rows}


def cells(store: Store, boot_id: int) -> dict[str, m.Cell]:
    with store.session() as s:
        rows = s.scalars(select(m.Cell).where(m.Cell.boot_id == boot_id, m.Cell.instrument == "agreement")).all()
    return {c.metric + (f"[{c.params['prompt']}]" if c.params else ""): c for c in rows}


def stored(store: Store, boot_id: int) -> list[Generation]:
    with store.session() as s:
        rows = s.scalars(select(m.Request).where(m.Request.boot_id == boot_id).order_by(m.Request.idx)).all()
    return [Generation.from_stored(r) for r in rows]


@pytest.mark.slow
def test_the_opening_control_stores_the_reference_with_top_k_logprobs(agreement_window: Store) -> None:
    opening = boots(agreement_window)["open"]
    found = cells(agreement_window, opening)
    assert set(found) == {"errors"} and found["errors"].value == 0
    reference = stored(agreement_window, opening)
    assert len(reference) == 8
    for generation in reference:
        assert generation.error is None and generation.tokens and len(generation.tokens) <= MAX_TOKENS
        # The bundled engine also returns the end token's logprob, which is not part of the text.
        assert "".join(generation.tokens).startswith(generation.text) and generation.text
        assert all(top is not None and len(top) == 5 for top in generation.tops or [])


@pytest.mark.slow
def test_two_boots_of_the_same_config_agree_exactly(agreement_window: Store) -> None:
    ids = boots(agreement_window)
    found = cells(agreement_window, ids["close"])
    assert found["exact_match_rate"].value == 1.0 and found["topk_consistent_rate"].value == 1.0
    assert found["mean_kl"].value < 1e-6 and found["max_kl"].value < 1e-6
    assert found["top1_agreement_rate"].value == 1.0
    assert found["unpaired_prompts"].value == 0 and found["errors"].value == 0
    lengths = [len(g.tokens or []) for g in stored(agreement_window, ids["close"])]
    assert found["first_divergence_mean"].value == sum(lengths) / 8
    # KL covered every generated position, each with five alternatives on both sides.
    assert found["mean_kl"].note.startswith(f"{sum(lengths)} compared positions")
    per_prompt = [c for name, c in found.items() if name.startswith("first_divergence[")]
    assert len(per_prompt) == 8 and all(c.note.startswith("identical") for c in per_prompt)


@pytest.mark.slow
def test_a_bfloat16_arm_diverges_and_the_cells_say_where(agreement_window: Store) -> None:
    ids = boots(agreement_window)
    found = cells(agreement_window, ids["A1bf16"])
    assert found["exact_match_rate"].value < 1.0 and found["mean_kl"].value > 1e-5
    assert found["first_divergence_mean"].value < MAX_TOKENS
    diverged = [c for name, c in found.items() if name.startswith("first_divergence[") and "diverged" in c.note]
    assert diverged and all(c.value < MAX_TOKENS for c in diverged)
    assert f"opening control, boot {ids['open']}" in found["exact_match_rate"].note


@pytest.mark.slow
def test_without_logprobs_only_the_text_is_compared(agreement_window: Store) -> None:
    ids = boots(agreement_window)
    reference = [replace(g, tokens=None, tops=None) for g in stored(agreement_window, ids["open"])]
    prompts = [f"p{i}" for i in range(8)]
    for boot, expected_exact in ((ids["close"], 1.0), (ids["A1bf16"], None)):
        found = {c.metric: c for c in compare(reference, stored(agreement_window, boot), prompts, "vs open", 5)}
        exact = found["exact_match_rate"]
        assert exact.valid and "text only" in exact.note
        if expected_exact is not None:
            assert exact.value == expected_exact
        else:
            assert exact.value < 1.0
        for name in ("first_divergence_mean", "mean_kl", "max_kl", "top1_agreement_rate", "topk_consistent_rate"):
            assert not found[name].valid and found[name].note.startswith("no logprobs from the opening control")


@pytest.mark.slow
def test_a_reference_that_is_missing_is_named(agreement_window: Store) -> None:
    ctx = _ctx(AgreementParams(), "http://127.0.0.1:9/v1", role="arm", controls=[boots(agreement_window)["open"]],
               store=agreement_window, position="arm")
    assert load_reference(ctx, "agreement").problem is None
    problem = load_reference(ctx, "needle").problem
    assert problem is not None and "stored no needle step" in problem


def _ctx(params: AgreementParams, api_base: str, role: str = "control", controls: list[int] | None = None,
         store: Store | None = None, position: str = "open") -> BootContext:
    return BootContext(base_url=api_base.removesuffix("/v1"), api_base=api_base, model="smollm2-135m", api_key=None,
                       run_id=1, run_name="t", slot_id=1, boot_id=99, arm="A1", window="W1",
                       role=role, position=position,  # type: ignore[arg-type]
                       salt="s", engine_kind="bundled", params=params,
                       stored=None if store is None else StoredRows(store),  # type: ignore[arg-type]
                       control_boot_ids=controls or [], mem=None,  # type: ignore[arg-type]
                       log=logging.getLogger("test.agreement"))


@pytest.mark.slow
def test_completions_endpoint_and_a_closing_control_without_an_opening_one(bench: SpeedBench) -> None:
    params = AgreementParams(prompts=3, max_tokens=8, endpoint="completions", top_logprobs=3)
    no_logprobs = AgreementParams(prompts=3, max_tokens=8, endpoint="completions", top_logprobs=0)
    instrument = AgreementInstrument()
    step = instrument.plan(params)[0]
    api_base = f"{bench.server.url}/v1"
    first = asyncio.run(instrument.run_step(_ctx(params, api_base), step))
    second = asyncio.run(instrument.run_step(_ctx(params, api_base, position="close"), step))
    bare = asyncio.run(instrument.run_step(_ctx(no_logprobs, api_base), step))
    assert all(r.endpoint == "/v1/completions" and r.payload["logprobs"] == 3 for r in first.receipts)
    ids = ["a", "b", "c"]
    found = {c.metric: c for c in compare([Generation.from_receipt(r) for r in first.receipts],
                                          [Generation.from_receipt(r) for r in second.receipts], ids, "vs first", 3)}
    assert found["exact_match_rate"].value == 1.0 and found["mean_kl"].value == 0.0
    generated = sum(r.completion_tokens for r in second.receipts)
    assert generated > 0 and found["mean_kl"].note.startswith(f"{generated} compared positions")
    # A closing control whose opening control is missing is not a reference: every comparison cell says why.
    invalid = [c for c in second.cells if c.metric != "errors"]
    assert invalid and all(not c.valid and "no warm control of window W1" in c.note for c in invalid)
    assert all(r.logprobs is None and "logprobs" not in r.payload for r in bare.receipts)
    text_only = {c.metric: c for c in compare([Generation.from_receipt(r) for r in first.receipts],
                                              [Generation.from_receipt(r) for r in bare.receipts], ids, "x", 0)}
    assert text_only["exact_match_rate"].value == 1.0
    assert text_only["mean_kl"].note.startswith("logprobs not requested (top_logprobs: 0)")


def _kl_reference(p: dict[str, float], q: dict[str, float]) -> float:
    """The definition spelled out with scipy: floors at each side's smallest logprob, renormalised."""
    support = sorted(p.keys() | q.keys())
    pp = [math.exp(p.get(t, min(p.values()))) for t in support]
    qq = [math.exp(q.get(t, min(q.values()))) for t in support]
    return float(entropy(pp, qq))  # scipy normalises both and returns KL(p || q) in nats


def test_top_k_kl_follows_its_definition() -> None:
    same = {"a": -0.1, "b": -2.5, "c": -4.0}
    assert topk_kl(same, dict(same)) == 0.0
    disjoint_tail = ({"a": -0.1, "b": -2.5}, {"a": -0.1, "c": -2.0})
    shifted = ({"a": -0.05, "b": -3.2, "c": -4.1}, {"a": -0.4, "b": -1.2, "c": -4.0})
    for p, q in (disjoint_tail, shifted):
        assert topk_kl(p, q) == pytest.approx(_kl_reference(p, q), rel=1e-12)
        assert topk_kl(p, q) > 0 and topk_kl(p, q) != pytest.approx(topk_kl(q, p))


def test_divergence_positions_and_top_k_consistency() -> None:
    top0 = {"A": -0.1, "B": -2.5}
    near_tie = {"x": -0.69, "y": -0.70}
    control = [Generation("p0", "AxC", ["A", "x", "C"], [top0, near_tie, {"C": -0.1}], None),
               Generation("p1", "AB", ["A", "B"], [top0, {"B": -0.2}], None)]
    here = [Generation("p0", "AyD", ["A", "y", "D"], [top0, {"y": -0.69, "x": -0.70}, {"D": -0.1}], None),
            Generation("p1", "A", ["A"], [top0], None)]
    found = {c.metric + str(c.params.get("prompt", "")): c for c in compare(control, here, ["p0", "p1"], "x", 5)}
    # p0 diverges at token 1 between near-tied tokens; p1 stops after one token where the control went on.
    assert (found["first_divergencep0"].value, found["first_divergencep1"].value) == (1, 1)
    assert found["exact_match_rate"].value == 0.0 and found["topk_consistent_rate"].value == 0.5
    # Compared positions: p0 tokens 0-1 (through the divergence), p1 token 0; top-1 differs only at p0's divergence.
    assert found["mean_kl"].note.startswith("3 compared positions")
    assert found["top1_agreement_rate"].value == pytest.approx(2 / 3)
    assert found["max_kl"].value == pytest.approx(topk_kl(near_tie, {"y": -0.69, "x": -0.70}))


def test_an_errored_or_unmatched_prompt_is_unpaired_not_dropped() -> None:
    control = [Generation("p0", "A", ["A"], [{"A": -0.1}], None), Generation("gone", "B", ["B"], [{"B": -0.1}], None)]
    here = [Generation("p0", "A", ["A"], [{"A": -0.1}], None), Generation("p1", "", None, None, "HTTP 503: busy")]
    found: dict[str, Cell] = {c.metric: c for c in compare(control, here, ["p0", "p1"], "x", 5)}
    assert found["unpaired_prompts"].value == 2
    assert found["unpaired_prompts"].note == "p1; 1 prompt(s) only on the control"
    assert found["exact_match_rate"].value == 1.0
