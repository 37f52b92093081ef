"""The instruments that act on the engine's process, through the real `lab run` on SmolLM2: `restart`
(a conversation resumed after the lab restarts the engine inside the boot, or after other prompts
evicted it) and `offline` (`lab engine bench` on the boot's own config, beside the served figures).
One run of three boots: the control, an arm with both a file tier and a host-memory tier, the
control again."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from lab.store.frames import run_tables
from tests.instruments.ladder_run import run_ladder

pytestmark = pytest.mark.slow

# 16 MiB of float32 KV: 352 tokens, so 400 tokens of other prompts evict the 320-token conversation.
LADDER = """\
    name: tiers
    engine:
      kind: bundled
      model: smollm2-135m
      flags: {device: cpu, max-model-len: 352, kv-cache-memory-bytes: 16777216, enable-prefix-caching: true}
    windows:
      - name: W1
        control: C0ctl
        arms:
          - {name: T12, multi: true, flags: {kv-file-tier-bytes: 67108864, kv-host-tier-bytes: 67108864}}
    instruments:
      prefill: {lengths: [128], reps: 1}
      restart: {context_tokens: 256, turn_tokens: 64, resume_tokens: 16, max_tokens: 4, modes: [restart, evict],
                evict_tokens: 400}
      offline: {prefill_lengths: [128], concurrency: 2, prompt_tokens: 16, decode_tokens: 4, repeats: 1}
    keep:
      metrics: [{metric: restart.resume_ttft_s, where: {mode: restart}}]
    """


@pytest.fixture(scope="module")
def tables(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pd.DataFrame]:
    cwd = tmp_path_factory.mktemp("tiers")
    store = run_ladder(cwd, LADDER, "tiers", timeout=900)
    try:
        return run_tables(store, 1)
    finally:
        store.close()


def cell(tables: dict[str, pd.DataFrame], arm: str, position: str, instrument: str, metric: str,
         **params: object) -> pd.Series:
    slots = tables["slots"].merge(tables["arms"], left_on="arm_id", right_on="id", suffixes=("", "_arm"))
    slot_id = slots[(slots["name"] == arm) & (slots["position"] == position)]["id"].item()
    cells = tables["cells"]
    rows = cells[(cells["slot_id"] == slot_id) & (cells["instrument"] == instrument) & (cells["metric"] == metric)]
    rows = rows[rows["params"].map(lambda p: all((p if isinstance(p, dict) else json.loads(p)).get(k) == v
                                                 for k, v in params.items()))]
    assert len(rows) == 1, (arm, instrument, metric, params, rows)
    return rows.iloc[0]


def test_a_file_tier_serves_the_history_after_a_restart_and_the_control_recomputes_it(tables) -> None:
    # The restart empties host memory: only the file kept the history.
    for arm, position, cached, file_tokens in (("C0ctl", "open", 0, 0), ("T12", "arm", 256, 256),
                                              ("C0ctl", "close", 0, 0)):
        got = cell(tables, arm, position, "restart", "resume_cached_tokens", mode="restart")
        assert got["valid"] and got["value"] == cached, (arm, got["note"])
        assert cell(tables, arm, position, "restart", "resume_tier_tokens", mode="restart", tier="file")["value"] \
            == file_tokens
        # A tier changes nothing but time: every resume answers the warm engine's greedy text.
        assert cell(tables, arm, position, "restart", "resume_matches_warm", mode="restart")["value"] == 1
        restart = cell(tables, arm, position, "restart", "restart_s", mode="restart")
        assert restart["valid"] and restart["value"] > 0
        # The file kept every block of the play: none found the staging full.
        dropped = cell(tables, arm, position, "restart", "play_blocks_dropped", mode="restart")
        if file_tokens:
            assert dropped["valid"] and dropped["value"] == 0 and "0 of 16 blocks offered" in dropped["note"]
        else:
            assert not dropped["valid"] and "no file tier" in dropped["note"]


def test_a_host_tier_serves_the_history_after_other_prompts_evicted_it(tables) -> None:
    # Evicted blocks went down to host memory, which is read before the file.
    for arm, position, tier in (("C0ctl", "open", None), ("T12", "arm", "host")):
        got = cell(tables, arm, position, "restart", "resume_cached_tokens", mode="evict")
        assert got["valid"] and got["value"] == (0 if tier is None else 256), (arm, got["note"])
        if tier:
            assert cell(tables, arm, position, "restart", "resume_tier_tokens", mode="evict", tier=tier)["value"] == 256
        assert cell(tables, arm, position, "restart", "resume_matches_warm", mode="evict")["value"] == 1
        # The resume adds resume_tokens, not a turn, to the 256-token history.
        note = cell(tables, arm, position, "restart", "resume_ttft_s", mode="evict")["note"]
        assert "after 400 prompt tokens" in note and "272 prompt tokens" in note


def test_a_restarted_engine_stays_one_warm_boot_of_the_planned_config(tables) -> None:
    boots = tables["boots"]
    assert list(boots["status"]) == ["done"] * 3 and not boots["cold"].any()
    for path in boots["log_path"]:
        log = Path(path).read_text()
        # Served, restarted by the restart instrument, stopped for the bench, served again.
        assert log.count("== the lab restarts the engine") == 2 and "== lab engine bench:" in log


def test_offline_figures_sit_beside_the_served_ones_of_the_same_boot(tables) -> None:
    for arm, position in (("C0ctl", "open"), ("T12", "arm")):
        offline = cell(tables, arm, position, "offline", "prefill_tok_s", length=128)
        served = cell(tables, arm, position, "prefill", "prefill_tok_s_median", length=128)
        assert offline["valid"] and offline["value"] > 0
        ratio = cell(tables, arm, position, "offline", "served_over_offline", length=128)
        assert ratio["valid"] and ratio["value"] == pytest.approx(served["value"] / offline["value"])
        for batch in (1, 2):
            assert cell(tables, arm, position, "offline", "decode_tok_s", batch=batch)["value"] > 0
        # No decode instrument in this ladder: its ratio says why it has no value.
        level = cell(tables, arm, position, "offline", "served_over_offline", level=1)
        assert not level["valid"] and "no served decode" in level["note"]
