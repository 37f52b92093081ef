"""Where each short n-gram of one sequence last ended, kept up to date as its tokens reach the host,
so that prompt lookup's draft, and whether there is one, is a dictionary lookup and not a search.

After each token the index knows its *source*: the end of the latest earlier occurrence of the
longest n-gram (n from max down to min) that ends at that token. The tokens that followed the
source are the draft; the first of them is the index's prediction of the next token, and
whether that prediction came true is known, for free, as soon as the next token is on the host.
Those outcomes (`advance`'s hits) measure how well the sequence's text copies itself whether or
not it is drafting, which is what decides if its drafts pay (`acceptance.py`)."""

from __future__ import annotations


class NgramIndex:
    def __init__(self, n_min: int, n_max: int) -> None:
        self.sizes = range(n_max, n_min - 1, -1)  # longest first
        self.last_end: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self.indexed = 0  # tokens indexed so far
        self.source = -1  # see the module's docstring; -1: no n-gram ending at the last token recurs

    def start(self, tokens: list[int], count: int) -> None:
        """Index a new sequence's first `count` (at least one) tokens, its prompt, at once."""
        head = count - 1
        for n in self.sizes:
            many = head - n + 1  # the n-grams ending before the last token
            if many > 0:  # in C: later ends overwrite earlier ones
                grams = zip(*(tokens[i:i + many] for i in range(n)))
                self.last_end[n].update(zip(grams, range(n - 1, head)))
        self._add(tokens, head)

    def advance(self, tokens: list[int], known: int) -> list[bool]:
        """Index the tokens up to `known`; for each, whether it is the one the index predicted."""
        hits = []
        for j in range(self.indexed, known):
            hits.append(self.source >= 0 and tokens[self.source + 1] == tokens[j])
            self._add(tokens, j)
        return hits

    def _add(self, tokens: list[int], j: int) -> None:
        self.source = -1
        for n in self.sizes:
            if j + 1 < n:
                continue
            gram = tuple(tokens[j + 1 - n:j + 1])
            ends = self.last_end[n]
            if self.source < 0:
                self.source = ends.get(gram, -1)
            ends[gram] = j
        self.indexed = j + 1

    def draft(self, tokens: list[int], k: int) -> list[int]:
        """The k tokens that followed the source; empty when there is none. A source within the last
        k tokens means the text repeats with a short period (`period` tokens), and the draft goes on
        repeating it."""
        if self.source < 0:
            return []
        start = self.source + 1
        period = self.indexed - start
        return [tokens[start + i % period] for i in range(k)]
