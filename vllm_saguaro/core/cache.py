"""SpeculationCache: the next speculation for each likely outcome of the round in flight."""
from __future__ import annotations

from dataclasses import dataclass, field

from vllm_saguaro.core.outcome import Outcome


@dataclass
class Speculation:
    """K draft tokens and (when sampled) the distributions q they were drawn from."""

    tokens: list[int]
    hit: bool = False


@dataclass
class SpeculationCache:
    """Outcome-keyed speculations for one sequence, rebuilt every round.

    It is valid only for the speculation it was built from: a hit needs the outcome's k
    and bonus token to match a cached branch exactly.
    """

    entries: dict[Outcome, list[int]] = field(default_factory=dict)

    def put(self, outcome: Outcome, tokens: list[int]) -> None:
        self.entries[outcome] = tokens

    def lookup(self, outcome: Outcome) -> list[int] | None:
        return self.entries.get(outcome)

    def __len__(self) -> int:
        return len(self.entries)
