"""Fan-out: how many bonus-token candidates to pre-speculate for each accepted length k."""
from __future__ import annotations


def _round_to_budget(weights: list[float], budget: int) -> list[int]:
    """Largest-remainder rounding so the integers sum to exactly the budget."""
    total = sum(weights)
    exact = [budget * w / total for w in weights]
    counts = [int(x) for x in exact]
    order = sorted(range(len(exact)), key=lambda i: exact[i] - counts[i], reverse=True)
    for i in order[: budget - sum(counts)]:
        counts[i] += 1
    return counts


def geometric_fanout(k_max: int, budget: int, acceptance_rate: float, miss_exponent: float) -> list[int]:
    """Theorem 12: F_k proportional to a^(k/(1+r)), the last one boosted by (1-a)^(-1/(1+r)).

    It mirrors the capped-geometric law of the accepted length: outcomes that occur more
    often get more cached bonus-token candidates. Returns K+1 counts summing to budget.
    """
    if not 0.0 < acceptance_rate < 1.0:
        raise ValueError("acceptance_rate must be in (0, 1)")
    if budget < 1 or k_max < 1:
        raise ValueError("budget and K must be >= 1")
    e = 1.0 / (1.0 + miss_exponent)
    weights = [acceptance_rate ** (k * e) for k in range(k_max)]
    weights.append(acceptance_rate ** (k_max * e) * (1.0 - acceptance_rate) ** (-e))
    return _round_to_budget(weights, budget)


class BudgetControl:
    """The per-sequence budget that fits the round, found by watching whether it does.

    Pre-speculation must end before the target's next step arrives, or the target waits
    for it (or, on a certain miss, it is cut short and wasted). So: a step that finds the
    pre-speculation still running shrinks the budget (x shrink); `patience` steps in a row
    that find it done grow it by one, up to the configured maximum. A model of the tree
    decode's cost (fixed + per-row, fitted online) did this before and was measured to
    shrink the budget at batch 1 where 8 branches fitted (benchmarks/results/selection):
    the outcome itself needs no model and holds on any hardware.
    """

    def __init__(self, max_budget: int, patience: int = 2, shrink: float = 0.75):
        self.max_budget, self.patience, self.shrink = max_budget, patience, shrink
        self.budget = max_budget
        self._clean = 0

    def observe(self, overran: bool) -> int:
        if overran:
            self.budget = max(1, int(self.budget * self.shrink))
            self._clean = 0
        else:
            self._clean += 1
            if self._clean >= self.patience:
                self.budget = min(self.max_budget, self.budget + 1)
                self._clean = 0
        return self.budget


class AcceptanceFit:
    """Online estimate of a_p, the per-token acceptance rate the geometric fan-out needs.

    Under the paper's model each draft token is accepted with probability a_p until the
    first rejection, so a round with k of n drafts accepted shows k acceptances and, if
    k < n, one rejection: the estimate is accepted / (accepted + rejected). The prior is
    worth prior_weight tokens, so the first rounds stay sane; decay < 1 forgets old rounds,
    so the fan-out follows a change of prompt mix.
    """

    def __init__(self, prior: float, prior_weight: float = 16.0, decay: float = 0.99):
        self.prior, self.prior_weight, self.decay = prior, prior_weight, decay
        self.accepted = 0.0
        self.rejected = 0.0

    def observe(self, accepted: int, drafted: int) -> None:
        self.accepted = self.accepted * self.decay + accepted
        self.rejected = self.rejected * self.decay + (1.0 if accepted < drafted else 0.0)

    @property
    def rate(self) -> float:
        w = self.prior_weight
        a = (self.accepted + self.prior * w) / (self.accepted + self.rejected + w)
        return min(max(a, 0.01), 0.99)


class SplitAcceptanceFit:
    """a_p for greedy and for sampled requests apart, and a batch's as the mix of its
    rows' (sampled_share, which the draft worker sets from the batch each step).

    A greedy request accepts a draft token where it is the target's argmax, a sampled
    one with the target's probability of it: they differ by the sampling, not by the
    text, and a batch may hold both. One fit for both carried a T = 0 batch's rate into
    the T = 1 batch after it (issue 19's twentieth round)."""

    def __init__(self, prior: float, **kwargs):
        self.fits = {True: AcceptanceFit(prior, **kwargs), False: AcceptanceFit(prior, **kwargs)}
        self.sampled_share = 0.0

    def observe(self, accepted: int, drafted: int, greedy: bool = True) -> None:
        self.fits[greedy].observe(accepted, drafted)

    def rate_of(self, greedy: bool) -> float:
        return self.fits[greedy].rate

    @property
    def rate(self) -> float:
        s = self.sampled_share
        return (1.0 - s) * self.fits[True].rate + s * self.fits[False].rate


def uniform_fanout(k_max: int, width: int) -> list[int]:
    """The reference engine's default: the same number of candidates at every k."""
    return [width] * (k_max + 1)


def fanout_for(policy: str, k_max: int, *, budget: int, width: int,
               acceptance_rate: float, miss_exponent: float) -> list[int]:
    if policy == "geometric":
        return geometric_fanout(k_max, budget, acceptance_rate, miss_exponent)
    if policy == "uniform":
        return uniform_fanout(k_max, width)
    raise ValueError(f"unknown fan-out policy {policy!r}")
