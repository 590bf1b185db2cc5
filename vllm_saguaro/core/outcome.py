"""Verification outcomes and speculation-cache keys: the one definition both sides use."""
from __future__ import annotations

from typing import NamedTuple


class Outcome(NamedTuple):
    """One round's result for one sequence: k accepted draft tokens, then bonus token t*."""

    k: int
    bonus: int


def outcome_from_sampled(sampled: list[int]) -> Outcome:
    """vLLM emits the accepted draft tokens followed by the bonus token."""
    if not sampled:
        raise ValueError("a verified round emits at least the bonus token")
    return Outcome(len(sampled) - 1, sampled[-1])


def is_consistent(sampled: list[int], speculation: list[int]) -> bool:
    """The accepted tokens must be a prefix of what was speculated."""
    k = len(sampled) - 1
    return k <= len(speculation) and list(sampled[:k]) == list(speculation[:k])
