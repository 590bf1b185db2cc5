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


def budget_that_fits(max_budget: int, batch: int, window_s: float, cost: "StepCost",
                     steps: int) -> int:
    """The per-sequence budget whose tree decode fits in the time the target verifies.

    Pre-speculation must end before the target's round does, or the next step waits for it:
    at batch 16 a budget of 8 is 128 branch rows per tree step. The tree decode costs
    steps x cost(batch x budget) seconds, so the budget is the largest whose decode fits.
    Nothing measured yet: max_budget.
    """
    if not cost.measured:
        return max_budget
    fits = [b for b in range(1, max_budget + 1) if steps * cost.seconds(batch * b) <= window_s]
    return fits[-1] if fits else 1


class StepCost:
    """Seconds of one tree-decode step as a + b x rows, fitted online (decayed least squares).

    A draft step is mostly fixed cost at small row counts (reading the weights, per-call
    overhead: on a CPU core one row takes 9 ms, 32 rows 38 ms for the reference draft), so
    a cost per row measured at a small budget would forbid ever growing it. Until two row
    counts have been seen the slope is a prior: the cost doubles every `knee` rows.
    """

    def __init__(self, knee: float = 8.0, decay: float = 0.95):
        self.knee, self.decay = knee, decay
        self.w = self.x = self.y = self.xx = self.xy = 0.0

    @property
    def measured(self) -> bool:
        return self.w > 0

    def add(self, rows: float, seconds: float) -> None:
        d = self.decay
        self.w = self.w * d + 1.0
        self.x = self.x * d + rows
        self.y = self.y * d + seconds
        self.xx = self.xx * d + rows * rows
        self.xy = self.xy * d + rows * seconds

    def coefficients(self) -> tuple[float, float]:
        mx, my = self.x / self.w, self.y / self.w
        var = self.xx / self.w - mx * mx
        if var < 0.25:  # one row count seen: the prior's slope through the measured point
            b = my / (self.knee + mx)
        else:
            b = max((self.xy / self.w - mx * my) / var, 0.0)
        return max(my - b * mx, 0.0), b

    def seconds(self, rows: float) -> float:
        a, b = self.coefficients()
        return a + b * rows


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
