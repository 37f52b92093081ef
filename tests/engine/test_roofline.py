"""The floors every "of floor" figure is measured against, on Llama-3-8B's shapes, checked
against the same arithmetic done by hand (a decode step's bytes and FLOPs per part, at the
measured copy and matmul ceilings)."""

from __future__ import annotations

import pytest

from lab.engine.model.roofline import Ceilings, decode_step_floor_s, decode_step_part_floors_s
from lab.engine.model_config import PRESETS

CEILINGS = Ceilings(copy_bytes_per_s=4.25e12, matmul_flops_per_s=750e12, device="cuda", dtype="bfloat16")
LLAMA = PRESETS["llama3-8b"]
CONTEXT = 397_312  # 256 sequences at 1,552 tokens


@pytest.mark.parametrize("kv_bytes, attention_ms", [(1, 6.13), (2, 12.25)])
def test_decode_step_floor_at_256_rows_is_compute_bound_for_products(kv_bytes: int, attention_ms: float) -> None:
    floors = decode_step_part_floors_s(LLAMA, 2, kv_bytes, 256, CONTEXT, CEILINGS)
    # 7.50 G weights: 15.0 GB (3.53 ms) or 3.84 TFLOP at 256 rows (5.12 ms), the larger.
    assert floors["products"] * 1e3 == pytest.approx(5.12, abs=0.01)
    assert floors["attention"] * 1e3 == pytest.approx(attention_ms, abs=0.01)


def test_at_one_row_the_part_floors_are_the_bytes_floor() -> None:
    floors = decode_step_part_floors_s(LLAMA, 2, 2, 1, 192, CEILINGS)
    assert floors["products"] * 1e3 == pytest.approx(3.53, abs=0.01)
    assert sum(floors.values()) == pytest.approx(decode_step_floor_s(LLAMA, 2, 2, 192, CEILINGS))
