"""needle in resident mode on the real engine: two long sessions held running beside the needle in
a KV pool that cannot hold them and the needle at once, and the passphrase is found as it is solo."""

from __future__ import annotations

import re

import pytest

from lab.instruments.needle import NeedleInstrument, NeedleParams, passphrase_found

pytestmark = pytest.mark.slow


def test_retrieval_beside_two_resident_sessions_equals_the_solo_result(sessions_bench) -> None:
    pool = sessions_bench.server.stats()["kv_pool"]["tokens"]
    params = {"lengths": [1000], "depths": [0.5], "resident_sessions": 2, "resident_tokens": 1000}
    assert 2 * 1000 + 1000 > pool  # the sessions and the needle do not fit the pool together
    stored = sessions_bench.measure(NeedleInstrument(), params, salt="needle-resident")
    assert [(s.key, s.status) for s in stored.steps] == [("length=1000/depth=0.5/rep=0", "ok"), ("found_rate", "ok")]
    solo, resident = stored.cell("found", length=1000, depth=0.5), stored.cell("found_resident", length=1000, depth=0.5)
    assert solo.valid and resident.valid, (solo.note, resident.note)
    assert resident.value == solo.value == 1.0, resident.note
    assert "resident: found, solo: found" in resident.note and "2 sessions resident" in resident.note

    asked = stored.requests_of(resident)
    beside, sessions = asked[-1], asked[:-1]
    (alone,) = stored.requests_of(solo)
    passphrase = solo.note.split("'")[1]
    assert passphrase_found(passphrase, beside.text)
    assert beside.prompt_tokens == alone.prompt_tokens == 1000 and beside.cached_tokens == 0
    assert beside.payload["prompt"] != alone.payload["prompt"]  # its own salt: prefilled again
    assert len(sessions) > 2 and all(r.error is None and r.prompt_tokens == 1000 for r in sessions)
    # a session was running while the needle was prefilled and answered
    assert any(r.t_sent_ns < beside.t_done_ns and r.t_done_ns > beside.t_sent_ns for r in sessions[2:])
    # and the pool could not keep everything: a session's prefix was evicted and prefilled again,
    # or the engine preempted a sequence
    preempted = int(re.search(r"preempted (\d+) sequences", resident.note).group(1))
    assert preempted > 0 or any(r.cached_tokens < r.prompt_tokens - 16 for r in sessions[2:]), resident.note
    assert stored.cell("found_resident_rate").value == stored.cell("found_rate").value == 1.0


def test_resident_mode_declares_its_cells_and_its_longest_request() -> None:
    params = NeedleParams(lengths=[1000], resident_sessions=2, resident_tokens=3000)
    instrument = NeedleInstrument()
    assert instrument.cell_params(params)["found_resident"] == [{"length": 1000, "depth": 0.5}]
    assert instrument.prompt_tokens(params) == {"lengths": 1012, "resident_tokens": 3016}
    assert "found_resident" not in instrument.metrics(NeedleParams(lengths=[1000]))
