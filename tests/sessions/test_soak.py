"""soak on the real engine: two sessions grow with big tool outputs, a subagent joins, both compact.
Reuse against the previous prompt is near 100 %, the whole-prompt figure is far lower on the small
contexts, a compaction reads its previous prompt from cache, and every request is a receipt."""

from __future__ import annotations

import pytest

from lab.instruments.soak import SoakInstrument, SoakParams
from lab.instruments.soak_sessions import COMPACT, RESUME

pytestmark = pytest.mark.slow

# Turn 0 at ~200 tokens, turn 1 at ~480, turn 2 past 700: compaction, then turn 3 from the summary.
SOAK = {"sessions": 2, "turns": 4, "start_tokens": 150, "tool_tokens": [250, 300], "answer_tokens": 8,
        "subagent_every": 2, "subagents": 1, "subagent_tokens": 64, "subagent_answer_tokens": 6,
        "compact_at_tokens": 700, "summary_tokens": 16, "bands": [512]}


def test_a_soak_reuses_the_previous_prompt_and_compacts_from_cache(sessions_bench) -> None:
    stored = sessions_bench.measure(SoakInstrument(), SOAK, salt="soak-a")
    assert [(s.key, s.status) for s in stored.steps] == [("soak", "ok")]
    receipts = stored.requests_of(stored.cell("requests"))
    chats = [r for r in receipts if r.endpoint == "/v1/chat/completions"]
    # 2 sessions x 4 turns, 2 compactions, 2 subagents and the one sent alone
    assert stored.cell("requests").value == len(chats) == 13 and stored.cell("errors").value == 0
    assert all(r.error is None and r.cached_tokens is not None for r in chats)

    for session in (0, 1):
        prev = stored.cell("reuse_prev", session=session, turn=2)
        (turn,) = stored.requests_of(prev)
        assert prev.valid and prev.value >= 0.95, prev.note  # a long turn: its previous prompt came from cache
        assert "previous prompt" in prev.note and "whole prompt" in stored.cell("reuse_whole", session=session,
                                                                                 turn=2).note
        small = stored.cell("reuse_whole", session=session, turn=1)
        assert small.value < 0.5 < stored.cell("reuse_prev", session=session, turn=1).value, small.note
        (small_turn,) = stored.requests_of(small)
        assert small.value == pytest.approx(small_turn.cached_tokens / small_turn.prompt_tokens)
        assert turn.prompt_tokens >= SOAK["compact_at_tokens"]
    assert stored.cell("reuse_prev_worst").value >= 0.95 and stored.cell("reuse_whole_median").value < 0.9

    assert stored.cell("compactions").value == 2
    reuse = stored.cell("compaction_reuse")
    assert reuse.valid and reuse.value >= 0.95, reuse.note
    (summary,) = stored.requests_of(reuse)
    assert summary.payload["messages"][-1]["content"] == COMPACT and summary.cached_tokens >= 0.95 * turn.prompt_tokens
    after = [r for r in chats if r.payload["messages"][1]["content"].count(RESUME)]
    assert len(after) == 2 and all(r.prompt_tokens < 500 for r in after)  # restarted from the summary

    turns = [r for r in chats if r.payload["max_tokens"] == SOAK["answer_tokens"]]
    assert stored.cell("turn_latency_s", band="all", stat="max").value == pytest.approx(
        max(r.t_done_ns - r.t_sent_ns for r in turns) / 1e9)
    assert stored.cell("subagent_queued_s").value == pytest.approx(
        stored.cell("subagent_cold_start_s").value - stored.cell("subagent_alone_s").value, abs=1e-9)
    free = stored.cell("engine_free_memory_min_gib")
    (stats,) = stored.requests_of(free)
    assert free.valid and stats.endpoint == "/v1/stats" and free.value == pytest.approx(
        stats.response["free_memory_bytes"] / 2**30)
    gate = stored.cell("pass")
    assert gate.value == 1.0 and gate.note == "judged errors, latency, reuse"


def test_the_gpu_preset_is_three_sessions_past_100k() -> None:
    params = SoakParams(preset="gpu")
    assert params.sessions == 3 and params.start_tokens >= 100000 and params.subagents == 2
    assert SoakInstrument().prompt_tokens(params)["compact_at_tokens"] <= 131072  # fits llama3-8b's context


def test_bad_sizes_are_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="write it as \\[least, most\\]"):
        SoakParams(tool_tokens=[500, 100])
    with pytest.raises(ValueError, match="compact_at_tokens \\(500\\) must exceed start_tokens \\(600\\)"):
        SoakParams(compact_at_tokens=500)
