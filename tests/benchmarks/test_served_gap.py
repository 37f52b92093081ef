"""`benchmarks/served_gap.py` end to end on the CPU: a real server booted and stopped, text and
token-id prompts timed and split by the server's own histograms, the same ids offline."""

from __future__ import annotations

import pytest

from tests.benchmarks.scripts import numbers, run_script


@pytest.mark.slow
def test_served_gap_splits_each_prompts_time_to_first_token_beside_offline() -> None:
    text = run_script("served_gap.py", "--lengths", "48,200", "--reps", "1", "--model", "dummy:smollm2-135m",
                      "--device", "cpu", "--max-model-len", "512", timeout=300)
    rows = [numbers(line) for line in text.splitlines() if line.split()[:1] in (["48"], ["200"])]
    forms = [line.split()[1] for line in text.splitlines() if line.split()[:1] in (["48"], ["200"])]
    assert forms == ["text", "ids", "text", "ids"], text
    for length, client, http, host, queue, prefill, offline, ratio in rows:
        # Every part is time the request spent, the engine's prefill the largest of them; the
        # ratio printed is offline over the client's time.
        assert client > prefill > 0 and http > 0 and host > 0 and queue >= 0, text
        assert client > http + host and offline > 0
        assert ratio == pytest.approx(offline / client, abs=0.002)
    assert rows[2][5] > rows[0][5]  # 200 tokens take the engine longer to prefill than 48
