"""A long prompt's tokenization, whole against in pieces on the tokenizers library's threads.

The text is what the prefill instrument sends (random token ids of the model's vocabulary,
decoded); the serving path encodes it before the prompt's first step, so every millisecond here
is time to first token. Both ways give the same ids (checked); the figure is the median of
`--repeats` encodes.

    PYTHONPATH=. python benchmarks/tokenize_prompt.py --tokens 2000 8000 32000 131000
    PYTHONPATH=. python benchmarks/tokenize_prompt.py --model smollm2-135m
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections.abc import Callable

from lab.engine.model_config import PRESETS
from lab.engine.weights import text_pieces
from lab.engine.weights.loader import DUMMY_PREFIX, bundled_model_path
from lab.engine.weights.tokenizer import Tokenizer
from lab.engine.weights.tokenizer_dummy import dummy_tokenizer
from lab.engine.weights.weights_gguf import read_gguf


def tokenizer(model: str) -> Tokenizer:
    """The model's tokenizer without its weights: a dummy preset's synthetic one, or a GGUF's."""
    if model.startswith(DUMMY_PREFIX):
        return dummy_tokenizer(PRESETS[model.removeprefix(DUMMY_PREFIX)].vocab_size)
    return read_gguf(bundled_model_path() if model == "smollm2-135m" else model)[2]


def median_ms(works: list[Callable[[], object]], repeats: int) -> list[float]:
    """Each work's median milliseconds, the works taking turns within every repeat: whichever
    runs first after another kind of work pays for waking the tokenizers library's threads."""
    times: list[list[float]] = [[] for _ in works]
    for _ in range(repeats):
        for work, spent in zip(works, times):
            started = time.perf_counter()
            work()
            spent.append(time.perf_counter() - started)
    return [1e3 * statistics.median(spent) for spent in times]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="dummy:llama3-8b", help="dummy:<preset>, smollm2-135m or a .gguf file")
    ap.add_argument("--tokens", type=int, nargs="+", default=[2000, 8000, 32000, 131000],
                    help="random token ids decoded to make each text")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--piece-chars", type=int, nargs="+", default=[0],
                    help="piece sizes to time, as --tokenize-piece-chars takes them (0: by this host's cores)")
    args = ap.parse_args()
    tok = tokenizer(args.model)
    rng = random.Random(0)
    print(f"{args.model}'s tokenizer, {len(os.sched_getaffinity(0))} usable cores")
    for n in args.tokens:
        text = tok.decode([rng.randrange(1000, min(tok.vocab_size, 100_000)) for _ in range(n)])
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == tok._backend.encode(text, add_special_tokens=False).ids, "the pieces gave other ids"
        def encode(chars: int) -> Callable[[], object]:
            def work() -> object:
                tok.piece_chars = chars
                return tok.encode(text, add_special_tokens=False)
            assert work() == ids, f"pieces of {chars} gave other ids"
            return work

        whole, *each = median_ms([lambda: tok._backend.encode(text, add_special_tokens=False)]
                                 + [encode(chars) for chars in args.piece_chars], args.repeats)
        timed = []
        for chars, ms in zip(args.piece_chars, each):
            chosen = text_pieces.piece_chars_for(len(text), chars)
            label = "whole" if chosen == text_pieces.WHOLE else f"pieces of {chosen}{' (by cores)' if not chars else ''}"
            timed.append(f"{label}: {ms:8.2f} ms ({whole / ms:.2f}x)")
        print(f"  {len(ids):8,d} tokens ({len(text) / 1e3:5.0f} kB): whole {whole:8.2f} ms, " + ", ".join(timed))


if __name__ == "__main__":
    main()
