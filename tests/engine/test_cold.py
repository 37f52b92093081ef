"""A boot is cold when it built an on-disk cache that later boots reuse, and /v1/stats says which:
the GGUF weight cache at load, the CPU product layouts measured at load, Triton's kernel cache
whenever a kernel compiles. Random weights are no cache."""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from lab.engine.core.warm_caches import BuiltCaches, triton_cache_dir
from tests.engine.server_process import engine_server

SMALL = ("--device", "cpu", "--max-model-len", "256", "--kv-cache-memory-bytes", str(32 << 20))
LINEAR = ("--cpu-products", "linear")  # no product layouts to measure, so no layout file to build


def test_triton_cache_dir_is_the_one_triton_uses(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    knobs = pytest.importorskip("triton.knobs")
    cases = [{}, {"TRITON_HOME": str(tmp_path / "home")}, {"TRITON_CACHE_DIR": str(tmp_path / "kernels"),
                                                            "TRITON_HOME": str(tmp_path / "ignored")}]
    for env in cases:
        for name in ("TRITON_HOME", "TRITON_CACHE_DIR"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        assert triton_cache_dir() == Path(knobs.cache.dir).absolute(), env


def test_triton_cache_set_empty_is_not_watched() -> None:
    assert triton_cache_dir({"TRITON_CACHE_DIR": ""}) is None
    assert BuiltCaches.snapshot({"TRITON_CACHE_DIR": ""}).built() == []


def test_triton_entries_count_only_names_added_since_the_snapshot(tmp_path: Path) -> None:
    cache = tmp_path / "triton"
    caches = BuiltCaches.snapshot({"TRITON_CACHE_DIR": str(cache)})  # not there yet: Triton makes it
    assert caches.built() == []
    (cache / "OLD").mkdir(parents=True)
    caches = BuiltCaches.snapshot({"TRITON_CACHE_DIR": str(cache)})
    for name in ("A", "B"):
        (cache / name).mkdir()
    (cache / "OLD").rmdir()
    assert caches.built() == [{"cache": "triton", "path": str(cache), "entries_added": 2, "cold": True}]


@pytest.mark.slow
def test_first_gguf_boot_builds_the_weight_cache_and_the_second_is_warm(tmp_path: Path,
                                                                          smollm2_gguf: Path) -> None:
    root = tmp_path / "lab-cache"
    env = {"LAB_CACHE_DIR": str(root), "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    digest = hashlib.sha256(smollm2_gguf.read_bytes()).hexdigest()
    with engine_server(tmp_path, "--model", "smollm2-135m", *SMALL, env=env) as first:
        stats = first.stats()
    assert stats["cold"] is True and stats["random_weights"] is False
    built = {c["cache"]: c for c in stats["caches_built"]}
    assert built.pop("weights") == {"cache": "weights", "path": str(root / digest[:16]), "built": True, "cold": True}
    # A fresh cache root has no product layouts for this host either: the load measures them, and
    # writes them unless the host was too busy to trust the figures (then no boot reuses them). The
    # file is named for the server's thread count, which `--cpu-threads` sets, not this process's.
    layouts = built.pop("cpu-linear", None)
    assert built == {}
    if layouts is not None:
        path = Path(layouts["path"])
        assert layouts == {"cache": "cpu-linear", "path": str(path), "built": True, "cold": True}
        assert path.parent == root / "cpu-linear" and path.exists()
    with engine_server(tmp_path, "--model", "smollm2-135m", *SMALL, env=env) as second:
        stats = second.stats()
    if layouts is not None:
        assert stats["cold"] is False and stats["caches_built"] == []
    else:
        assert {c["cache"] for c in stats["caches_built"]} <= {"cpu-linear"}


@pytest.mark.slow
def test_dummy_boot_is_warm_until_a_kernel_lands_in_the_triton_cache(tmp_path: Path) -> None:
    triton = tmp_path / "triton"
    env = {"LAB_CACHE_DIR": str(tmp_path / "lab-cache"), "TRITON_CACHE_DIR": str(triton)}
    with engine_server(tmp_path, "--model", "dummy:smollm2-135m", *SMALL, *LINEAR, env=env) as server:
        stats = server.stats()
        assert stats["cold"] is False and stats["caches_built"] == [] and stats["random_weights"] is True
        # What a compile leaves: one directory per kernel hash, written by the engine's process.
        kernel = triton / "K5WJ2OBEPMRLK3DKXHPBYSAGOLKS6IEZBYCZT7MRDSA37XTRCTBQ"
        kernel.mkdir(parents=True)
        (kernel / "decode_attention.json").write_text("{}")
        stats = server.stats()
    assert stats["cold"] is True
    assert stats["caches_built"] == [{"cache": "triton", "path": str(triton), "entries_added": 1, "cold": True}]


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_first_boot_compiles_into_the_triton_cache_and_the_second_reuses_it(tmp_path: Path) -> None:
    env = {"LAB_CACHE_DIR": str(tmp_path / "lab-cache"), "TRITON_CACHE_DIR": str(tmp_path / "triton"),
           "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0")}
    flags = ("--model", "dummy:smollm2-135m", "--device", "cuda", "--max-model-len", "1024",
             "--cuda-graph-max-batch-size", "4")
    with engine_server(tmp_path, *flags, env=env, timeout=600) as first:
        stats = first.stats()
    assert stats["cold"] is True and [c["cache"] for c in stats["caches_built"]] == ["triton"]
    assert stats["caches_built"][0]["entries_added"] > 0
    with engine_server(tmp_path, *flags, env=env, timeout=600) as second:
        stats = second.stats()
    assert stats["cold"] is False and stats["caches_built"] == [], stats["caches_built"]


def _triton_entries(stats: dict) -> int:
    return sum(c.get("entries_added", 0) for c in stats["caches_built"] if c["cache"] == "triton")


# Known gap, measured on an H200 at ac75c68: 14 kernels compiled while serving in both cases. The
# attention kernels no longer do (the H200 ladder's measured boots, graphs off included, built
# nothing after ready), but eager decode steps of a batch no graph capture ran (here 5-12 rows,
# past the largest graph of 4, or every batch with graphs off) still compile skinny-GEMV tiles on
# first use. Remove the mark when startup warms those too.
EAGER_GAP = pytest.mark.xfail(strict=True, reason="eager decode batches past the captured graphs compile "
                                                   "skinny-GEMV tiles on first use")


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("graphs", [pytest.param("true", marks=EAGER_GAP), pytest.param("false", marks=EAGER_GAP)])
def test_gpu_serving_compiles_nothing_after_ready(tmp_path: Path, graphs: str) -> None:
    """Every kernel variant a step can launch is compiled before the engine serves: a burst of
    prompts (the paged prefill kernel), chunked prefill over a cached prefix and decodes of every
    batch size add nothing to the Triton cache, so a measured boot is never a compiling one."""
    env = {"LAB_CACHE_DIR": str(tmp_path / "lab-cache"), "TRITON_CACHE_DIR": str(tmp_path / "triton"),
           "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0")}
    flags = ("--model", "dummy:smollm2-135m", "--device", "cuda", "--max-model-len", "2048",
             "--max-num-batched-tokens", "256", "--cuda-graph-max-batch-size", "4", "--cuda-graphs", graphs)
    with engine_server(tmp_path, *flags, env=env, timeout=600) as server:
        url = f"{server.url}/v1/completions"
        # The first completion is the lab's readiness probe.
        httpx.post(url, json={"prompt": "Hi", "max_tokens": 1}, timeout=120).raise_for_status()
        before = _triton_entries(server.stats())

        def complete(prompt: str, tokens: int) -> None:
            body = {"prompt": prompt, "max_tokens": tokens, "ignore_eos": True, "temperature": 0}
            httpx.post(url, json=body, timeout=300).raise_for_status()

        with ThreadPoolExecutor(12) as pool:
            list(pool.map(lambda i: complete(" the" * (3 + 37 * i), 6 + i), range(12)))
        complete(" the quiet river" * 300, 40)  # 900+ tokens: chunks over a cached prefix
        complete(" the quiet river" * 300 + " and more", 5)  # a prefix-cache hit
        after = _triton_entries(server.stats())
    assert after == before, f"{after - before} Triton kernels compiled while serving"
