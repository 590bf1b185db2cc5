"""SpeculationCache: the next speculation for each likely outcome of the round in flight."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm_saguaro.core.outcome import Outcome


@dataclass
class Speculation:
    """K draft tokens and, when they were sampled, the K distributions q they came from
    (the verifier needs that very q; None = greedy drafts, q one-hot); the draft's
    confidence in each token (None where it has none: core/controller.py)."""

    tokens: list[int]
    probs: Any = None
    confidence: list | None = None


@dataclass
class SpeculationCache:
    """Outcome-keyed speculations for one sequence, rebuilt every round.

    It is valid only for the speculation it was built from: a hit needs the outcome's k
    and bonus token to match a cached branch exactly.
    """

    entries: dict[Outcome, Speculation] = field(default_factory=dict)

    def put(self, outcome: Outcome, speculation: Speculation) -> None:
        self.entries[outcome] = speculation

    def lookup(self, outcome: Outcome) -> Speculation | None:
        return self.entries.get(outcome)

    def __len__(self) -> int:
        return len(self.entries)
