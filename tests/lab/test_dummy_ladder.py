"""A `dummy:` model (random weights) through every instrument, as the GPU ladder runs one, here on
the CPU with the few-layer `tiny` shape (what is tested is the lab's side, not the model's size):
valid speed cells in every boot, not-applicable quality cells with their reason, no 5xx, every
boot warm, and a verdict for the arm."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import select

from lab.store import models as m
from lab.store.db import Store
from tests.instruments.ladder_run import run_ladder

pytestmark = pytest.mark.slow

DECODE_TOKENS = 8
LADDER = f"""\
    name: dummy
    engine:
      kind: bundled
      model: dummy:tiny
      # The tiny shape prefills 600 tokens in about 10 ms on a quiet host: a known 30 ms per engine
      # step keeps the mixed instrument's long prefill running when its short chat arrives.
      flags: {{device: cpu, max-model-len: 2048, kv-cache-memory-bytes: 134217728, inject-step-delay-ms: 30}}
    windows:
      - name: W1
        control: C0ctl
        arms:
          - {{name: A1mnbt256, flags: {{max-num-batched-tokens: 256}}}}
    instruments:
      prefill: {{lengths: [100, 700], reps: 1}}
      needle: {{lengths: [256], depths: [0.5]}}
      decode: {{levels: [2], max_tokens: {DECODE_TOKENS}}}  # the KEEP rule's level: eight streams, two at a time
      mixed: {{long_tokens: 600, delay_s: 0.01}}
      qeval: {{per_category: 1}}
      agreement: {{prompts: 2, max_tokens: 8}}
      memory:
    keep:
      metrics:
        - {{metric: decode.agg_tok_s, where: {{level: 2}}}}
        - {{metric: prefill.prefill_tok_s_median, where: {{length: 700}}}}
      gates:
        - {{metric: agreement.exact_match_rate, min: 1}}
    hygiene: {{min_mem_available_gib: 1, warmup_boot: true}}
    """
SPEED = ("prefill", "decode", "mixed", "agreement", "memory")
QUALITY = ("needle", "qeval")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    return run_ladder(tmp_path_factory.mktemp("dummy"), LADDER, "dummy", timeout=600)


def test_every_boot_is_done_and_warm_on_random_weights(store: Store) -> None:
    with store.session() as s:
        boots = s.scalars(select(m.Boot).order_by(m.Boot.id)).all()
        assert [b.status for b in boots] == ["done"] * 4  # warm-up, control, arm, control
        assert [b.cold for b in boots] == [False] * 4


def test_speed_instruments_store_only_valid_cells_in_every_measured_boot(store: Store) -> None:
    with store.session() as s:
        measured = s.scalars(select(m.Boot.id).join(m.Slot, m.Boot.slot_id == m.Slot.id)
                             .where(m.Slot.role != "warmup")).all()
        assert len(measured) == 3
        for boot_id in measured:
            cells = s.scalars(select(m.Cell).where(m.Cell.boot_id == boot_id)).all()
            for instrument in SPEED:
                mine = [c for c in cells if c.instrument == instrument]
                assert mine, f"boot {boot_id}: no {instrument} cells"
                bad = [(c.metric, c.params, c.note) for c in mine if not c.valid]
                assert not bad, f"boot {boot_id}: invalid {instrument} cells {bad}"


def test_quality_instruments_say_not_applicable_and_send_nothing(store: Store) -> None:
    with store.session() as s:
        cells = s.scalars(select(m.Cell).where(m.Cell.instrument.in_(QUALITY))).all()
        assert {c.instrument for c in cells} == set(QUALITY)
        for cell in cells:
            assert cell.value is None and cell.note.startswith("not applicable"), (cell.metric, cell.note)
            assert "random weights" in cell.note
        sent = s.scalars(select(m.Request.endpoint).join(m.Step, m.Request.step_id == m.Step.id)
                         .where(m.Step.instrument.in_(QUALITY))).all()
        assert sent == []


def test_no_request_got_a_server_error_and_every_token_streamed_on_its_own(store: Store) -> None:
    with store.session() as s:
        requests = s.scalars(select(m.Request)).all()
        assert requests
        assert [r.status for r in requests if r.status is None or r.status >= 500] == []
        decode = s.scalars(select(m.Request).join(m.Step, m.Request.step_id == m.Step.id)
                           .where(m.Step.instrument == "decode", m.Request.completion_tokens == DECODE_TOKENS)).all()
        assert decode
        # With ignore_eos every generated token decodes to text of its own, so it arrives as its own chunk.
        assert all(len(r.token_times_ns) == DECODE_TOKENS for r in decode)


def test_the_arm_gets_a_verdict_with_reasons(store: Store) -> None:
    with store.session() as s:
        verdict = s.scalar(select(m.Verdict))
        assert verdict is not None and verdict.decision in ("keep", "reject", "inconclusive")
        assert verdict.reasons and not any("cold" in reason for reason in verdict.reasons)
