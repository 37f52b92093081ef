"""needle on the real engine: passphrases at 1K and 2K tokens are found, the match is strict, and
the grid's found rate covers every cell."""

from __future__ import annotations

import pytest

from lab.instruments.needle import NeedleInstrument, NeedleParams, passphrase_found

pytestmark = pytest.mark.slow


def test_needles_at_1k_and_2k_are_found_with_exact_lengths_and_prefill_speeds(bench) -> None:
    stored = bench.measure(NeedleInstrument(), {"lengths": [1000, 2000], "depths": [0.5]}, salt="needle-a")
    assert [s.key for s in stored.steps] == ["length=1000/depth=0.5/rep=0", "length=2000/depth=0.5/rep=0",
                                             "found_rate"]
    assert all(s.status == "ok" for s in stored.steps)
    passphrases = set()
    for length, rep in ((1000, 0), (2000, 0)):
        found = stored.cell("found", rep, length=length, depth=0.5)
        (request,) = stored.requests_of(found)
        assert found.valid and found.value == 1.0, found.note
        assert request.prompt_tokens == length and request.cached_tokens == 0
        assert request.payload["temperature"] == 0
        passphrase = found.note.split("'")[1]
        assert passphrase_found(passphrase, request.text)
        passphrases.add(passphrase)
        speed = stored.cell("prefill_tok_s", rep, length=length, depth=0.5)
        assert speed.valid and speed.value == pytest.approx(length * 1e9 / (request.t_first_ns - request.t_sent_ns))
    assert len(passphrases) == 2  # a fresh passphrase per cell
    rate = stored.cell("found_rate")
    assert rate.valid and rate.value == 1.0 and rate.note == "2 of 2 found"


def test_a_grid_with_a_cell_that_cannot_be_asked_has_no_valid_found_rate(bench) -> None:
    stored = bench.measure(NeedleInstrument(), {"lengths": [256, 4090], "depths": [0.0]}, salt="needle-b")
    assert stored.cell("found", length=256, depth=0.0).valid
    over = stored.cell("found", length=4090, depth=0.0)
    assert not over.valid and "exceed the engine's context of 4096" in over.note
    rate = stored.cell("found_rate")
    assert not rate.valid and rate.note.startswith("only 1 of 2 needle cells were answered")


def test_a_failed_request_is_an_invalid_cell_with_its_reason(bench) -> None:
    stored = bench.measure(NeedleInstrument(), {"lengths": [256]}, salt="needle-c", model="no-such-model")
    found = stored.cell("found", length=256, depth=0.5)
    (request,) = stored.requests_of(found)
    assert not found.valid and found.note.startswith("HTTP 404") and request.error == found.note
    assert not stored.cell("found_rate").valid


def test_the_match_is_whole_words_after_normalising_case_and_punctuation() -> None:
    assert passphrase_found("silver comet", ' "Silver Comet."')
    assert passphrase_found("silver comet", "silver-comet, as the text says")
    assert not passphrase_found("silver comet", "silver")
    assert not passphrase_found("silver comet", "silvery comet")
    assert not passphrase_found("silver comet", "comet silver")


def test_the_gpu_preset_reaches_300k_and_repeats_the_longest_length() -> None:
    params = NeedleParams(preset="gpu")
    steps = NeedleInstrument().plan(params)
    at_longest = [s.key for s in steps if s.params.get("length") == 300000]
    assert max(params.lengths) == 300000
    assert at_longest == [f"length=300000/depth={d:g}/rep={r}" for d in params.depths for r in range(3)]
    assert all(s.params["rep"] == 0 for s in steps[:-1] if s.params["length"] != 300000)
    assert steps[-1].key == "found_rate"
