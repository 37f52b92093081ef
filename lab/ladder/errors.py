"""A ladder refused: every problem as `file:line: reason`, one line each."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Problem:
    line: int  # 1-based; 0 when the problem belongs to the whole file
    reason: str


class LadderError(ValueError):
    def __init__(self, path: str, problems: list[Problem]) -> None:
        self.path = path
        self.problems = sorted(set(problems))
        super().__init__("\n".join(self.lines()))

    def lines(self) -> list[str]:
        return [f"{self.path}:{p.line}: {p.reason}" if p.line else f"{self.path}: {p.reason}" for p in self.problems]
