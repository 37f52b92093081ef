"""The batched sampler: greedy rows take the argmax, a seeded row's tokens are those of the per-row
draw (target_probs + draw) and do not depend on its batch, unseeded rows follow the target
distribution, and filters keep what they cut out of every draw."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from lab.engine.core.sampler import draw, sample, target_probs
from lab.engine.core.sampling_params import SamplingParams

VOCAB = 512
# A mixed batch: greedy by temperature and by top-k 1, seeded and unseeded rows with and without
# filters, at several temperatures. None: unseeded.
MIXED: list[tuple[SamplingParams, int | None]] = [
    (SamplingParams(temperature=0.0), None),
    (SamplingParams(temperature=0.8, seed=11), 11),
    (SamplingParams(temperature=1.0), None),
    (SamplingParams(temperature=0.7, top_k=20), None),
    (SamplingParams(temperature=1.3, seed=12), 12),
    (SamplingParams(temperature=0.9, top_p=0.8), None),
    (SamplingParams(temperature=1.0, top_k=1), None),
    (SamplingParams(temperature=0.6, top_k=5, seed=13), 13),
    (SamplingParams(temperature=1.1, top_p=0.9, seed=14), 14),
    (SamplingParams(temperature=0.5, min_p=0.05, seed=15), 15),
    (SamplingParams(temperature=1.2, top_k=VOCAB, seed=16), 16),  # a top-k that cuts nothing
]
SEEDED = [i for i, (_, seed) in enumerate(MIXED) if seed is not None]


def generators(seeds: list[int | None]) -> list[torch.Generator | None]:
    return [None if s is None else torch.Generator().manual_seed(s) for s in seeds]


def steps_logits(steps: int, rows: int, vocab: int = VOCAB) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(rows, vocab, generator=g) * 3 for _ in range(steps)]


@pytest.mark.parametrize("vocab", [8, 128_256])
def test_a_row_of_the_noise_gets_the_values_of_a_fresh_tensor(vocab: int) -> None:
    """The batched sampler fills row j of an [n, V] noise tensor where `draw` makes a fresh [V]
    one: same generator state, same values, and the generator left in the same state after."""
    for seed in (0, 1, 2**40 + 3):
        alone, batched = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        want = torch.empty(vocab, dtype=torch.float32).exponential_(generator=alone)
        noise = torch.empty(3, vocab, dtype=torch.float32)
        noise[1].exponential_(generator=batched)
        assert torch.equal(noise[1], want)
        assert torch.equal(batched.get_state(), alone.get_state())


def test_in_a_mixed_batch_greedy_rows_take_the_argmax_and_seeded_rows_ignore_the_batch() -> None:
    params = [p for p, _ in MIXED]
    batch_gens = generators([s for _, s in MIXED])
    alone_gens = {i: torch.Generator().manual_seed(MIXED[i][1]) for i in SEEDED}
    # The same seeded rows again, in reverse order, beside other unseeded rows.
    shuffled = SEEDED[::-1] + [2, 3]
    shuffled_gens = generators([MIXED[i][1] for i in shuffled])
    for logits in steps_logits(6, len(MIXED)):
        tokens = sample(logits, params, batch_gens)
        assert tokens[0] == logits[0].argmax() and tokens[6] == logits[6].argmax()
        again = sample(logits[shuffled], [params[i] for i in shuffled], shuffled_gens)
        for i in SEEDED:
            alone = sample(logits[i:i + 1], [params[i]], [alone_gens[i]])
            assert tokens[i] == alone[0] == again[shuffled.index(i)], f"row {i}"


def test_the_batched_draw_is_the_per_row_draw_token_for_token() -> None:
    """Same seeds, same tokens as target_probs + draw row by row (greedy rows: the argmax)."""
    params = [p for p, _ in MIXED]
    seeds = [s if s is not None or p.greedy else 100 + i for i, (p, s) in enumerate(MIXED)]
    batch_gens, row_gens = generators(seeds), generators(seeds)
    for logits in steps_logits(8, len(MIXED)):
        want = [int(logits[i].argmax()) if p.greedy else int(draw(target_probs(logits[i], p), row_gens[i]))
                for i, p in enumerate(params)]
        assert sample(logits, params, batch_gens).tolist() == want


def test_sample_handles_all_filtered_and_all_greedy_batches() -> None:
    logits = steps_logits(1, 3)[0]
    topk = SamplingParams(temperature=1.0, top_k=4)
    tokens = sample(logits, [topk] * 3, [None] * 3)
    for row, token in zip(logits, tokens):
        assert token in row.topk(4).indices
    greedy = SamplingParams(temperature=0.0)
    assert torch.equal(sample(logits, [greedy] * 3, [None] * 3), logits.argmax(-1))


def test_unseeded_rows_in_a_batch_follow_the_target_distribution() -> None:
    """Chi-square over V=8 for unseeded rows drawn together (beside a seeded and a greedy row);
    a top-k row never leaves its top k and follows the renormalised top k; two unseeded rows with
    the same logits get different noise."""
    torch.manual_seed(0)
    vocab, draws, k = 8, 4000, 3
    logits = torch.randn(6, vocab) * 1.5
    logits[3] = logits[2]
    params = [SamplingParams(temperature=0.5), SamplingParams(temperature=1.0), SamplingParams(temperature=1.0),
              SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=k),
              SamplingParams(temperature=0.0)]
    gens = [None, None, None, None, None, None]
    gens[1] = torch.Generator().manual_seed(5)
    counts = np.zeros((len(params), vocab))
    same = 0
    for _ in range(draws):
        tokens = sample(logits, params, gens).tolist()
        counts[np.arange(len(params)), tokens] += 1
        same += tokens[2] == tokens[3]
    for i in (0, 2, 3):
        p = (logits[i] / params[i].temperature).double().softmax(-1).numpy()
        assert chisquare(counts[i], draws * p).pvalue > 1e-3, f"row {i}"
    # The test tells the temperature apart: row 0 (T=0.5) is not distributed as at T=1.
    assert chisquare(counts[0], draws * logits[0].double().softmax(-1).numpy()).pvalue < 1e-6
    top = logits[4].topk(k).indices.numpy()
    outside = np.setdiff1d(np.arange(vocab), top)
    assert counts[4][outside].sum() == 0
    p_top = (logits[4][top] / 0.8).double().softmax(-1).numpy()
    assert chisquare(counts[4][top], draws * p_top).pvalue > 1e-3
    assert counts[5][int(logits[5].argmax())] == draws
    assert same < draws / 2  # independent noise: equal about sum(p^2) of the time, not always
