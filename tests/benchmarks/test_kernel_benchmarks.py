"""The kernel and component micro-benchmarks (`benchmarks/kernels/`), each end to end on the CPU at
tiny shapes: the Triton products and attention kernels in Triton's interpreter, PyTorch's
attention and the sampler on CPU tensors. Each table must hold every row it promises, with
positive times and outputs that match their reference."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.benchmarks.scripts import BENCHMARKS, ROOT, numbers, run_script


def rows_after(text: str, header_start: str) -> list[list[str]]:
    """The whitespace-split rows of the table whose header line starts with `header_start`, up to
    the next blank line."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith(header_start))
    rows = []
    for line in lines[start + 1:]:
        if not line.strip():
            break
        rows.append(line.split())
    return rows


@pytest.mark.slow
def test_bench_gemv_checks_every_product_and_the_chains_in_the_interpreter() -> None:
    text = run_script("kernels/bench_gemv.py", "--device", "cpu", interpret=True)
    shapes = rows_after(text, "shape  M")
    assert [(r[0], r[1]) for r in shapes] == [(name, m) for name in ("qkv", "o", "gate_up", "down", "down+silu",
                                                                     "lm_head") for m in ("1", "5")]
    for row in shapes:
        triton_us, cublas_us, err = float(row[2]), float(row[3]), float(row[9])
        assert triton_us > 0 and cublas_us > 0 and err < 1e-5, row
        assert row[4:9] == ["-"] * 5, row  # no rates from the interpreter
    chain = rows_after(text, "M   form")
    assert [(r[0], r[1]) for r in chain] == [("1", "plain"), ("1", "fused"), ("5", "plain"), ("5", "fused")]
    assert all(float(r[2]) > 0 and float(r[3]) > 0 for r in chain)
    norms = rows_after(text, "M separate ms")
    assert [r[0] for r in norms] == ["1", "5"]
    # Norms, residual adds and RoPE folded into the products give the separate kernels' logits.
    assert all(float(r[1]) > 0 and float(r[2]) > 0 and float(r[6]) < 1e-5 for r in norms)


@pytest.mark.slow
def test_bench_kernels_checks_decode_splits_and_prefill_in_the_interpreter() -> None:
    text = run_script("kernels/bench_kernels.py", "--device", "cpu", "--batches", "2", "--contexts", "40",
                      "--splits", "2", interpret=True)
    (decode,) = [line for line in text.splitlines() if line.split()[:2] == ["2", "40"]]
    cells = [cell.split() for cell in decode.split("|")[1:3]]
    for dtype, cell in zip(("float32", "fp8"), cells):
        splits, graph_us, eager_us, err = cell[0], cell[1], float(cell[2]), float(cell[5])
        assert splits == "2" and graph_us == "-" and eager_us > 0 and err < 1e-5, (dtype, cell)
    prefill = rows_after(text, "query context")
    assert [(r[0], r[1]) for r in prefill] == [("16", "16"), ("40", "40"), ("16", "72")]
    assert all(float(r[2]) > 0 and float(r[5]) < 1e-5 for r in prefill), prefill


@pytest.mark.parametrize("script", ["bench_gemv.py", "bench_kernels.py"])
def test_the_kernel_benchmarks_refuse_the_cpu_without_the_interpreter(script: str) -> None:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(BENCHMARKS / "kernels" / script), "--device", "cpu"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**env, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        f"{script}: error: --device cpu runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1")


def test_attention_prefill_times_each_part_against_float32_attention() -> None:
    text = run_script("kernels/attention_prefill.py", "--device", "cpu", "--dtype", "float32", "--lengths", "40",
                      "--rows", "16", "--prefixes", "50", "--repeats", "2")
    lines = text.splitlines()
    square = [line for line in lines if line.startswith("square causal L=    40       cpu")]
    prefix = [line for line in lines if line.startswith("prefix dense rows=   16 P=      50       cpu")]
    chunk = [line for line in lines if line.startswith("chunk L=   16 over P=      50")]
    assert len(square) == 2 and len(prefix) == 1 and len(chunk) == 1, text
    for line in square + prefix:
        ms, rate, err = numbers(line.split(":", 1)[1])
        assert ms > 0 and rate > 0 and err < 1e-5, line
    # The split-and-merge path gives the bottom-right causal call's numbers.
    assert numbers(chunk[0].rsplit("max diff", 1)[1])[0] < 1e-5


def test_attention_shapes_times_a_first_and_a_repeated_call_per_backend_and_shape() -> None:
    text = run_script("kernels/attention_shapes.py", "--device", "cpu", "--dtype", "float32", "--shapes", "37x0,5x40",
                      "--repeats", "2")
    rows = [line.split() for line in text.splitlines()[1:]]
    assert [(r[0], r[1], r[2]) for r in rows] == [("cudnn", "37", "0"), ("cudnn", "5", "40"),
                                                  ("flash", "37", "0"), ("flash", "5", "40")]
    assert all(float(r[3]) > 0 and float(r[4]) > 0 for r in rows)


def test_sampler_batch_draws_the_per_row_tokens_and_times_both() -> None:
    text = run_script("kernels/sampler_batch.py", "--device", "cpu", "--rows", "4", "--vocab", "500", "--calls", "3")
    assert text.startswith("cpu, 4 seeded rows x 500 vocab: ") and text.rstrip().endswith("same tokens: yes")
    batched, looped = numbers(text.split("batched", 1)[1])[:2]
    assert batched > 0 and looped > 0
