"""The profiles (`benchmarks/step_profile.py`, `benchmarks/prefill_profile.py`), end to end on the CPU
with a random-weight model, small: a script that breaks costs a GPU call."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.benchmarks.scripts import BENCHMARKS, numbers, run_script


@pytest.mark.slow
def test_prefill_profile_splits_a_chunked_prefill_by_part_beside_its_floors(tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    text = run_script("prefill_profile.py", "--model", "dummy:smollm2-135m", "--device", "cpu", "--dtype", "float32",
                      "--lengths", "300", "--max-num-batched-tokens", "128", "--json", str(out))
    (found,) = json.loads(out.read_text())["lengths"]
    assert found["tokens"] == 300 and found["seconds"] > 0
    # Three chunks of 128 tokens: the products and attention ran, and each has its FLOP floor.
    assert found["parts_s"]["products"] > 0 and found["parts_s"]["attention"] > 0
    assert 0 < found["part_floors_s"]["attention"] < found["part_floors_s"]["products"]
    assert "300 tokens:" in text and "of it" in text


@pytest.mark.slow
def test_step_profile_splits_a_decode_step_by_part_beside_its_compute_aware_floor() -> None:
    text = run_script("step_profile.py", "--model", "dummy:smollm2-135m", "--device", "cpu", "--dtype", "float32",
                      "--requests", "3", "--prompt-tokens", "48", "--decode-before", "4", "--steps", "3",
                      "--max-model-len", "256")
    assert "3 sequences at" in text and "ms of operators per step (3 steps)" in text
    floor_line = next(line for line in text.splitlines() if line.startswith("floor at this run's ceilings"))
    # Both parts ran and each stands beside its own floor.
    assert "products" in floor_line and "attention" in floor_line and "(measured 0.00x)" not in floor_line


def test_prefill_profile_finds_where_the_gpu_waited() -> None:
    import importlib.util
    from types import SimpleNamespace

    import torch

    spec = importlib.util.spec_from_file_location("prefill_profile", BENCHMARKS / "prefill_profile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def event(kind: str, start_us: float, end_us: float, name: str) -> SimpleNamespace:
        device = torch.autograd.DeviceType.CUDA if kind == "gpu" else torch.autograd.DeviceType.CPU
        return SimpleNamespace(device_type=device, time_range=SimpleNamespace(start=start_us, end=end_us), name=name)

    # The host prepares for 2 ms, then two kernels with a 3 ms wait on a host copy between them.
    events = [event("cpu", 0, 2_000, "prepare"), event("gpu", 2_000, 10_000, "gemm"),
              event("cpu", 10_500, 12_500, "aten::copy_"), event("gpu", 13_000, 20_000, "attention")]
    found = module.idle_gaps(events, profiled_s=0.021)
    assert abs(found["lead_s"] - 0.002) < 1e-9 and abs(found["between_s"] - 0.003) < 1e-9
    assert abs(found["idle_s"] - 0.006) < 1e-9  # 21 ms profiled, 15 ms of kernels
    assert found["largest"] == [(3.0, "aten::copy_ 2.00 ms")]


def test_tokenize_prompt_times_a_prompt_whole_and_in_pieces_to_the_same_ids() -> None:
    text = run_script("tokenize_prompt.py", "--tokens", "300", "6000", "--repeats", "2", "--piece-chars", "512", "-1")
    rows = [line for line in text.splitlines() if "tokens (" in line]
    assert len(rows) == 2 and all("whole" in r and "pieces of 512:" in r and "whole:" in r for r in rows)
    short, long = (numbers(r) for r in rows)
    # tokens, kB, whole ms, then 512, its ms, whole / its ms, then the whole again: ms, 1.0x-ish
    assert long[0] > short[0] > 0 and min(short[2:] + long[2:]) > 0
    assert long[5] == pytest.approx(long[2] / long[4], rel=0.02)
