"""The tiers under the prefix cache (host memory, a file): evicted blocks come back instead of
being recomputed, a restarted engine finds the file, greedy output equals plain decoding's, and a
damaged, foreign or unwritable file never reaches the KV cache nor stops the engine."""

from __future__ import annotations

import logging
import os
import resource
from pathlib import Path

import httpx
import pytest
import torch

from lab.engine.core.config import ConfigError, from_sources
from lab.engine.core.sampling_params import SamplingParams
from lab.engine.kv.block_manager import chain_hash
from lab.engine.kv import kv_tiers
from lab.engine.kv.file_tier import HEADER_BYTES, MAGIC, FileTier, record_bytes
from lab.engine.kv.host_tier import HostTier
from lab.engine.serve.llm import LLM
from tests.engine.server_process import engine_server

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
# A pool of 10 blocks of 16 tokens: the second 100-token prompt evicts part of the first one's.
SMALL = {"max_model_len": 128, "num_kv_blocks": 10, "cpu_products": "linear"}
FIRST, SECOND = list(range(1000, 1100)), list(range(2000, 2100))
FULL = 6  # full blocks of a 100-token prompt that a lookup may hit (the last token is always computed)
SHAPE, BS = (2, 2, 4, 1, 8), 4  # a made-up block shape for the file format tests
IDENTITY = {"model": "m", "config_hash": "abc", "block_size": BS}


def play(llm: LLM) -> list[list[int]]:
    """FIRST, SECOND, FIRST again, one after another: the replay finds FIRST's head evicted."""
    return [llm.generate(p, GREEDY)[0].token_ids for p in (FIRST, SECOND, FIRST)]


@pytest.fixture(scope="module")
def plain() -> list[list[int]]:
    llm = LLM("smollm2-135m", **SMALL)
    out = play(llm)
    assert llm.engine.blocks.tier_hit_blocks == {"device": 3, "host": 0, "file": 0}  # 3 blocks recomputed
    return out


def block_bytes(llm: LLM) -> int:
    return llm.engine.runner.bytes_per_block


# -- engine ----------------------------------------------------------------------------------

@pytest.mark.slow
def test_evicted_blocks_come_back_from_host_then_file_with_greedy_output_unchanged(plain, tmp_path: Path) -> None:
    path = tmp_path / "kv.kvtier"
    # Host memory for 4 blocks, spilling to the file. The second prompt evicts 3 of FIRST's blocks
    # to host memory; the replay takes 3 of SECOND's device blocks for them, whose eviction pushes
    # host memory's oldest block (one of FIRST's) down to the file: they come back from both tiers.
    llm = LLM("smollm2-135m", **SMALL, kv_host_tier_bytes=4 * 737_280, kv_file_tier_bytes=64 << 20,
              kv_file_tier_path=str(path), kv_tier_write_policy="on-evict")
    assert llm.engine.tiers.host.capacity == 4 and block_bytes(llm) == 737_280
    got = [llm.generate(p, GREEDY)[0] for p in (FIRST, SECOND, FIRST)]
    assert [c.token_ids for c in got] == plain
    assert got[2].num_cached_tokens == FULL * 16
    hits = llm.engine.blocks.tier_hit_blocks
    assert hits["device"] == 3 and hits["host"] >= 1 and hits["file"] >= 1 and sum(hits.values()) == FULL
    written = llm.engine.tiers.file.blocks_written
    # Listed, but it makes no boot cold: only a later request with the same prefix gains from it.
    assert written >= 1 and llm.engine.caches.built() == [{"cache": "kv-file-tier", "path": str(path),
                                                           "entries_added": written, "cold": False}]


@pytest.mark.slow
def test_restart_reads_the_file_and_a_corrupt_block_is_never_loaded(plain, tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    knobs = {**SMALL, "kv_file_tier_bytes": 64 << 20, "kv_file_tier_path": str(tmp_path / "kv.kvtier")}
    first = LLM("smollm2-135m", **knobs)  # write-through: every full block reaches the file
    assert first.generate(FIRST, GREEDY)[0].token_ids == plain[0]
    written = first.engine.tiers.file.blocks_written
    assert written == FULL
    del first
    again = LLM("smollm2-135m", **knobs)
    assert again.engine.tiers.file.blocks_found == FULL and again.engine.caches.built() == []
    out = again.generate(FIRST, GREEDY)[0]
    assert out.token_ids == plain[0] and out.num_cached_tokens == FULL * 16
    assert again.engine.blocks.tier_hit_blocks["file"] == FULL
    assert again.engine.caches.built() == []  # it only read what the first engine wrote: warm
    del again
    # Flip one byte of the 4th block's K/V: blocks 1-3 load, the 4th fails its checksum, the
    # file is emptied with one warning, and the rest is recomputed.
    path = Path(knobs["kv_file_tier_path"])
    with open(path, "r+b") as f:
        f.seek(HEADER_BYTES + 3 * record_bytes(16, 737_280) + 1000)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))
    caplog.set_level(logging.WARNING, logger="lab.engine.kv.file_tier")
    third = LLM("smollm2-135m", **knobs)
    out = third.generate(FIRST, GREEDY)[0]
    assert out.token_ids == plain[0] and out.num_cached_tokens == 3 * 16
    assert third.engine.blocks.tier_hit_blocks["file"] == 3
    assert [r.message for r in caplog.records if "fails its checksum" in r.message] != []
    assert len(caplog.records) == 1


@pytest.mark.slow
def test_a_full_disk_turns_the_file_tier_off_and_the_engine_serves_on(plain, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="lab.engine.kv.file_tier")
    llm = LLM("smollm2-135m", **SMALL, kv_file_tier_bytes=64 << 20, kv_file_tier_path="/dev/full")
    assert llm.generate(FIRST, GREEDY)[0].token_ids == plain[0]
    assert not llm.engine.tiers.file.enabled and "No space left" in llm.engine.tiers.file.disabled
    assert len(caplog.records) == 1 and "running without the file tier" in caplog.records[0].message


@pytest.mark.slow
def test_a_restarted_server_serves_the_prompt_from_the_file_and_reports_it(tmp_path: Path) -> None:
    flags = ("--device", "cpu", "--max-model-len", "128", "--num-kv-blocks", "10", "--cpu-products", "linear",
             "--kv-file-tier-bytes", str(64 << 20), "--kv-file-tier-path", str(tmp_path / "kv.kvtier"))
    body = {"model": "smollm2-135m", "prompt": FIRST, "max_tokens": 4, "temperature": 0}
    boots = []
    for _ in range(2):
        with engine_server(tmp_path, *flags) as server:
            reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).json()
            metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
            boots.append((reply, server.stats(), metrics))
    (first, first_stats, _), (second, stats, metrics) = boots
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == FULL * 16
    # The first boot wrote the on-disk cache the second one used; writing it makes no boot cold (the
    # lab salts each boot's prompts, so no later boot gains from it), and reading it does not either.
    [tier] = [c for c in first_stats["caches_built"] if c["cache"] == "kv-file-tier"]
    assert tier["entries_added"] >= FULL and tier["cold"] is False
    assert not stats["cold"] and not any(c["cache"] == "kv-file-tier" for c in stats["caches_built"])
    assert stats["prefix_cache"]["hits_by_tier"]["file"] == {"blocks": FULL, "tokens": FULL * 16}
    file = stats["prefix_cache"]["tiers"]["file"]
    assert file["blocks_found_at_start"] == FULL and file["blocks_dropped"] == 0
    assert file["staging_blocks"] == (64 << 20) // 737_280  # the default: the tier's size, at most 256 MiB on a CPU
    labels = '{engine="0",model_name="smollm2-135m"}'
    assert f"vllm:external_prefix_cache_hits_total{labels} 96.0" in metrics
    assert f"vllm:external_prefix_cache_queries_total{labels} 100.0" in metrics  # the device held none of it
    assert f"vllm:prefix_cache_hits_total{labels} 0.0" in metrics


def test_tier_knobs_refuse_what_cannot_work() -> None:
    with pytest.raises(ConfigError, match="are set but --kv-file-tier-bytes is 0"):
        from_sources({"kv-file-tier-path": "/tmp/x"})
    with pytest.raises(ConfigError, match="need --enable-prefix-caching true"):
        from_sources({"kv-host-tier-bytes": 1 << 20, "enable-prefix-caching": False})
    with pytest.raises(ConfigError, match="not one of"):
        from_sources({"kv-tier-write-policy": "sometimes"})


def test_block_hashes_are_fixed_values_not_pythons_hash() -> None:
    # Python's hash() of (None, tokens) changes with the process on 3.11 (None hashes by address),
    # so a file tier keyed by it would never hit after a restart; these values are the file format.
    assert chain_hash(None, (1, 2, 3)) == 0xB6A753F87AD5B7D6
    assert chain_hash(chain_hash(None, (1, 2, 3)), (4, 5)) == 0xA23261560D21BBAA


# -- the file format, with made-up blocks -----------------------------------------------------

def blocks(n: int) -> list[tuple[int, tuple[int, ...], torch.Tensor]]:
    out, parent = [], None
    for i in range(n):
        tokens = tuple(range(i * BS, (i + 1) * BS))
        parent = chain_hash(parent, tokens)
        out.append((parent, tokens, torch.full(SHAPE, float(i))))
    return out


def tier(path: Path, capacity: int = 8, **identity) -> FileTier:
    return FileTier(path, {**IDENTITY, **identity}, capacity, SHAPE, torch.float32)


def read(t: FileTier, h: int, tokens: tuple[int, ...]) -> torch.Tensor | None:
    """One block read back as a lookup reads it (a run of one), copied out of the read buffer."""
    for _, records in t.read_run([(h, tokens)]):
        return t.kv(records)[0].clone()
    return None


def spans_of(t: FileTier, keys: list) -> list[list[tuple[int, torch.Tensor]]]:
    """Each span `read_run` gave: (position in `keys`, the block's K/V copied out) per block."""
    return [[(first + i, block.clone()) for i, block in enumerate(t.kv(records))]
            for first, records in t.read_run(keys)]


def test_file_round_trip_and_lru_reuse_of_records(tmp_path: Path) -> None:
    path = tmp_path / "t.kvtier"
    t = tier(path, capacity=3)
    for h, tokens, data in blocks(4):
        t.put(h, tokens, data)
    t.flush()  # the writer thread's records are in the file
    assert path.stat().st_size == HEADER_BYTES + 3 * t.record  # the 4th reused the oldest record
    reopened = tier(path, capacity=3)
    got = {h: read(reopened, h, tokens) for h, tokens, _ in blocks(4)}
    first, *rest = blocks(4)
    assert got[first[0]] is None
    for h, _, data in rest:
        assert torch.equal(got[h], data)
    assert read(reopened, rest[0][0], (9, 9, 9, 9)) is None  # same hash, other tokens: never shared


def test_writes_leave_the_step_loop_but_a_read_never_sees_a_half_written_block(tmp_path: Path) -> None:
    t = tier(tmp_path / "t.kvtier", capacity=16)
    made = blocks(12)  # fewer than the staging buffers: none is dropped
    for h, tokens, data in made:
        t.put(h, tokens, data)
        data.fill_(-1.0)  # the caller reuses its block at once (a device block evicted, say)
    for i, (h, tokens, _) in enumerate(made):  # read back while writes may still be queued
        got = read(t, h, tokens)
        assert got is not None and torch.equal(got, torch.full(SHAPE, float(i)))
    t.close()
    assert t.blocks_written == t.blocks_queued == 12
    assert len(tier(tmp_path / "t.kvtier", capacity=16)) == 12


def test_a_run_is_read_in_sequential_spans_in_the_order_asked(tmp_path: Path) -> None:
    made = blocks(10)
    t = tier(tmp_path / "t.kvtier", capacity=16)
    for h, tokens, data in made[5:] + made[:5]:  # slots: blocks 5-9 in 0-4, blocks 0-4 in 5-9
        t.put(h, tokens, data)
    t.close()
    reader = tier(tmp_path / "t.kvtier", capacity=16)
    reader.span_blocks = 3  # spans of 3, 2 (the slots jump), 3, 2
    keys = [(h, tokens) for h, tokens, _ in made]
    spans = spans_of(reader, keys)
    assert [[i for i, _ in span] for span in spans] == [[0, 1, 2], [3, 4], [5, 6, 7], [8, 9]]
    assert all(torch.equal(block, made[i][2]) for span in spans for i, block in span)
    # A run stops at the first block the file does not hold.
    absent = (chain_hash(None, (7, 7, 7, 7)), (7, 7, 7, 7))
    got = [i for span in spans_of(reader, keys[:2] + [absent] + keys[3:]) for i, _ in span]
    assert got == [0, 1]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_lookup_copies_host_runs_and_file_spans_into_the_blocks_asked_whatever_their_slots(
        tmp_path: Path, monkeypatch, device: str) -> None:
    made = blocks(9)
    keys = [(h, tokens) for h, tokens, _ in made]
    pinned = device == "cuda"
    file = FileTier(tmp_path / "t.kvtier", IDENTITY, 16, SHAPE, torch.float32, pinned=pinned)
    for h, tokens, data in made[5:]:
        file.put(h, tokens, data.to(device))
    file.close()
    file = FileTier(tmp_path / "t.kvtier", IDENTITY, 16, SHAPE, torch.float32, pinned=pinned)
    file.span_blocks = 3  # blocks 5-8: spans of 3 and 1
    host = HostTier(4, SHAPE, torch.float32, pin=pinned)
    for h, tokens, data in [made[3], made[0], made[1], made[2], made[4]]:  # block 3 gives way to block 4
        host.put(h, tokens, data)
    assert [host.take(*k) for k in keys[:5]] == [1, 2, 3, None, 0]  # block 4 took the slot block 3 left
    monkeypatch.setattr(kv_tiers, "COPY_BLOCKS", 2)  # host runs are copied two blocks at a time
    pool = torch.zeros((SHAPE[0], SHAPE[1], 12, *SHAPE[2:]), device=device)
    tiers = kv_tiers.KVTiers(pool, "on-evict", host, file)
    block_ids = [11, 0, 10, 3, 5, 6, 7, 2, 8]  # file blocks 5-7 land in consecutive pool blocks
    origins = tiers.load_run(keys[:3] + [keys[4]] + keys[5:], block_ids[:3] + block_ids[4:])
    assert origins == ["host"] * 4 + ["file"] * 4
    for i, b in enumerate(block_ids):
        expected = torch.zeros(SHAPE) if i == 3 else made[i][2]  # block 3 was asked of no tier
        assert torch.equal(pool[:, :, b].cpu(), expected), f"block {i} in pool block {b}"
    # The run ends at the first block no tier gives back; what came before is loaded.
    assert tiers.load_run(keys[:4], [0, 1, 2, 3]) == ["host"] * 3


def test_a_damaged_block_mid_run_ends_the_run_after_the_good_ones_and_empties_the_file(tmp_path: Path,
                                                                                       caplog) -> None:
    path = tmp_path / "t.kvtier"
    made = blocks(6)
    t = tier(path, capacity=8)
    for h, tokens, data in made:
        t.put(h, tokens, data)
    t.close()
    raw = bytearray(path.read_bytes())
    raw[HEADER_BYTES + 3 * t.record + t.record - 1] ^= 1  # the last K/V byte of block 3
    path.write_bytes(bytes(raw))
    caplog.set_level(logging.WARNING, logger="lab.engine.kv.file_tier")
    reader = tier(path, capacity=8)
    got = [block for span in spans_of(reader, [(h, tk) for h, tk, _ in made]) for block in span]
    assert [i for i, _ in got] == [0, 1, 2] and all(torch.equal(b, made[i][2]) for i, b in got)
    assert len(caplog.records) == 1 and "fails its checksum" in caplog.records[0].message
    assert len(reader) == 0 and path.stat().st_size == HEADER_BYTES


def test_a_block_arriving_while_every_staging_buffer_waits_for_the_disk_is_dropped(tmp_path: Path) -> None:
    block_bytes = torch.empty(SHAPE).numel() * 4
    t = FileTier(tmp_path / "t.kvtier", IDENTITY, 16, SHAPE, torch.float32, staging_bytes=2 * block_bytes)
    assert t.staging_blocks == 2
    made = blocks(6)
    # The writer thread counts a block once its record is written, under this lock: holding it
    # stalls the writer after its first record, as a disk that cannot keep up would, while every
    # put returns at once.
    with t._count_lock:
        for h, tokens, data in made:
            t.put(h, tokens, data)
        assert t.blocks_queued == 2 and t.blocks_dropped == 4
    t.close()
    assert t.blocks_written == 2
    # A dropped block is simply not in the tier; the two staged ones are.
    assert [read(t, h, tk) is not None for h, tk, _ in made] == [True, True, False, False, False, False]
    assert torch.equal(read(tier(tmp_path / "t.kvtier", capacity=16), *made[1][:2]), made[1][2])


@pytest.mark.parametrize("damage, why", [
    ("truncate", "truncated"), ("identity", "written for another engine"), ("version", "format version"),
    ("header", "header checksum mismatch")])
def test_damaged_or_foreign_tier_files_are_ignored_with_one_warning(tmp_path: Path, caplog, damage: str,
                                                                    why: str) -> None:
    path = tmp_path / "t.kvtier"
    t = tier(path)
    for h, tokens, data in blocks(3):
        t.put(h, tokens, data)
    t.close()
    raw = bytearray(path.read_bytes())
    if damage == "truncate":
        raw = raw[:-7]
    elif damage == "version":
        raw[len(MAGIC)] = 9
    elif damage == "header":
        raw[len(MAGIC) + 12] ^= 1
    path.write_bytes(bytes(raw))
    caplog.set_level(logging.WARNING, logger="lab.engine.kv.file_tier")
    other = tier(path, **({"config_hash": "def"} if damage == "identity" else {}))
    assert len(other) == 0 and other.enabled and all(read(other, h, tk) is None for h, tk, _ in blocks(3))
    assert len(caplog.records) == 1 and why in caplog.records[0].message
    assert path.stat().st_size == HEADER_BYTES  # replaced by an empty tier file


def test_a_file_that_is_not_a_tier_file_is_left_untouched(tmp_path: Path, caplog) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("not mine\n")
    caplog.set_level(logging.WARNING, logger="lab.engine.kv.file_tier")
    t = tier(path)
    h, tokens, data = blocks(1)[0]
    t.put(h, tokens, data)
    assert not t.enabled and path.read_text() == "not mine\n"
    assert len(caplog.records) == 1 and "not a KV tier file" in caplog.records[0].message


def test_a_file_size_limit_reached_mid_write_turns_the_tier_off(tmp_path: Path, caplog) -> None:
    path = tmp_path / "t.kvtier"
    t = tier(path)
    caplog.set_level(logging.WARNING, logger="lab.engine.kv.file_tier")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    # The kernel refuses to grow any file of this process past 2.5 records (Python ignores SIGXFSZ).
    resource.setrlimit(resource.RLIMIT_FSIZE, (HEADER_BYTES + 5 * t.record // 2, hard))
    try:
        for h, tokens, data in blocks(4):
            t.put(h, tokens, data)
        t.flush()  # the writes ran on the writer thread; their failure turns the tier off here
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert not t.enabled and t.blocks_written == 2 and len(t) == 0
    assert len(caplog.records) == 1 and "running without the file tier" in caplog.records[0].message
    # The torn third record makes the file truncated: the next engine starts it afresh.
    assert len(tier(path)) == 0
