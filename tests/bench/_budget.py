"""A bench time budget for tests: spent once a given number of runs have started (the benches ask before each)."""
from __future__ import annotations

from atelier_studio.bench.harness import Budget


class SpentAfter(Budget):
    """A budget spent after `n` runs have started: deterministic, unlike a clock."""

    def __init__(self, n: int):
        super().__init__(60.0)
        self.runs_left = n

    def spent(self) -> bool:
        self.runs_left -= 1
        return self.runs_left < 0
