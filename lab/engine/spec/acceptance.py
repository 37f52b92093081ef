"""How many of a draft's tokens one sequence can expect to be accepted, from its recent *hits*: the
n-gram index's one-token predictions that came true (`ngram_index.py`).

Copying comes in runs (a quoted passage, a repeated line, an unchanged stretch of code), so hits
are modelled as a two-state chain: the chance of a hit right after a hit, and right after a miss,
each an exponentially weighted mean over the sequence's recent tokens. A draft's first token is
accepted with the chance that follows the last known token's outcome, each further token with
the chance after a hit, and acceptance stops at the first rejection. Greedy verification keeps a
draft token exactly when it is the token decoding would emit, and sampled verification keeps it
with the target's probability of it, which is the chance that a sampled token equals it: either
way a hit is an accepted draft token in expectation."""

from __future__ import annotations

from dataclasses import dataclass

ALPHA = 1 / 8  # the newest outcome's weight: about the last eight of each kind count
# Before a run has been seen, a first hit is worth about one look; a sequence that has not
# copied a single token yet expects nothing and never looks.
PRIOR_AFTER_HIT = 0.5


@dataclass
class HitRates:
    after_hit: float = PRIOR_AFTER_HIT
    after_miss: float = 0.0
    last_hit: bool = False

    def update(self, hit: bool) -> None:
        if self.last_hit:
            self.after_hit += ALPHA * (hit - self.after_hit)
        else:
            self.after_miss += ALPHA * (hit - self.after_miss)
        self.last_hit = hit

    @property
    def first(self) -> float:
        """The chance that the next token is a hit."""
        return self.after_hit if self.last_hit else self.after_miss

