"""The host's own ceilings (`benchmarks/cpu_read_ceiling.py`, `benchmarks/file_tier_io.py`) and the
engine's host work per decode step (`benchmarks/host_overhead.py`), end to end on the CPU, small."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmarks.scripts import numbers, run_script


def test_cpu_read_ceiling_gives_copy_read_and_product_bandwidth() -> None:
    text = run_script("cpu_read_ceiling.py", "--mib", "16", "--layers", "2", "--repeats", "2")
    first, *gemv = text.splitlines()
    assert " threads: copy " in first and ", read " in first
    threads, copy, read, ratio = numbers(first)
    assert threads >= 1 and copy > 0 and read > 0 and ratio > 0
    assert [line.split()[1] for line in gemv] == ["float32:", "bfloat16:"]
    for line in gemv:
        mib, ms, rate, share = numbers(line.split(":", 1)[1])
        assert mib > 0 and ms > 0 and rate > 0 and share > 0, line


def test_file_tier_io_states_each_tier_figure_against_its_ceiling_and_leaves_nothing_behind(tmp_path: Path) -> None:
    text = run_script("file_tier_io.py", "--blocks", "8", "--dir", str(tmp_path))
    head, *lines = text.splitlines()
    assert head.startswith("cpu 8 blocks, ")
    ceilings = {line.split("ceiling ")[1].rsplit(None, 2)[0]: numbers(line)[-1] for line in lines if "ceiling " in line}
    assert set(ceilings) == {"page-cache write", "page-cache read", "disk read", "host memory copy"}
    assert min(ceilings.values()) > 0
    [puts] = [line for line in lines if "tier puts" in line]
    returned_s, written_s, rate, share, dropped, offered, staging = numbers(puts)
    assert 0 < returned_s <= written_s and rate > 0 and share > 0 and (dropped, offered) == (0, 8) and staging > 8
    assert puts.endswith(f"of the page-cache write; 0 of 8 dropped (staging: {staging:.0f} blocks)")
    resumes = [line for line in lines if "tier resume" in line]
    for line, ceiling in zip(resumes, ("page-cache read", "disk read", "host memory copy")):
        took, rate, share = numbers(line)
        assert took > 0 and share == pytest.approx(rate / ceilings[ceiling], rel=0.05, abs=0.01)
        assert line.endswith(f"of the {ceiling}")
    assert len(resumes) == 3 and list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_host_overhead_times_a_decode_step_per_batch_size() -> None:
    text = run_script("host_overhead.py", "--sequences", "1", "4", "--prompt-tokens", "32", "--steps", "5")
    rows = [line for line in text.splitlines() if "ms host work per decode step" in line]
    assert [numbers(line)[0] for line in rows] == [1, 4]
    assert all(numbers(line)[1] > 0 and line.endswith("(median of 5)") for line in rows)
