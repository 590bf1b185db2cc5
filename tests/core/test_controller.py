"""The speculation-length controller (core/controller.py): optimal lengths, plain decoding
when nothing pays, the neural / fast / none choice, and the step-cost model."""
import itertools
import random

import pytest

from vllm_saguaro.core.controller import (Candidate, RealizedRate, StepCost, batch_limit,
                                          choose_lengths, expected_tokens, may_idle,
                                          schedule_limit, scheduled_k)


def linear(fixed, per_token):
    return lambda w: fixed + per_token * w


def rate_of(cands, lengths, target, draft_step=lambda rows: 0.0, neural=None):
    neural = neural or [False] * len(cands)
    tokens = len(cands)
    for c, L, u in zip(cands, lengths, neural):
        tokens += expected_tokens((c.neural if u else c.free)[:L])
    steps = max((L for L, u in zip(lengths, neural) if u), default=0)
    rows = sum(1 for L, u in zip(lengths, neural) if u and L)
    return tokens / (target(len(cands) + sum(lengths)) + (steps * draft_step(rows) if rows else 0))


@pytest.mark.parametrize("seed", range(8))
def test_optimal_against_brute_force_for_free_tokens(seed):
    rng = random.Random(seed)
    n, k = rng.randint(1, 4), 3
    cands = [Candidate(free=tuple(rng.uniform(0.05, 0.98) for _ in range(k)), cap=k)
             for _ in range(n)]
    target = linear(rng.uniform(0.02, 0.1), rng.uniform(0.0, 0.03))
    plan = choose_lengths(cands, target, lambda rows: 0.0)
    best = max(rate_of(cands, ls, target) for ls in itertools.product(range(k + 1), repeat=n))
    assert plan.rate == pytest.approx(best, rel=1e-9)
    assert plan.rate == pytest.approx(rate_of(cands, plan.lengths, target), rel=1e-9)


def _plan_rebuilt_for_every_m(cands, target_s, draft_step_s):
    """choose_lengths as first written: the whole plan rebuilt for each number of tokens
    (O(n^2 K)); the running totals that replaced it must choose the same plans."""
    steps = [0] + sorted({d for c in cands if c.neural
                          for d in range(1, min(c.cap, len(c.neural)) + 1)})
    need = max((min(c.cap, len(c.neural)) for c in cands
                if c.fixed and c.neural and len(c.free) < c.cap), default=0)
    best = None
    for d in (d for d in steps if d >= need):
        alphas, neural = [], []
        for c in cands:
            free, whole = c.free[:c.cap], min(c.cap, len(c.neural))
            use = d > 0 and bool(c.neural) and (not c.fixed or d >= whole) and (
                expected_tokens(c.neural[:min(d, c.cap)]) > expected_tokens(free)
                or (c.fixed and len(free) < c.cap))
            alphas.append(tuple(c.neural[:min(d, c.cap)]) if use else free)
            neural.append(use)
        ls = [len(a) if c.fixed else 0 for a, c in zip(alphas, cands)]
        tokens = len(cands) + sum(expected_tokens(a) for a, c in zip(alphas, cands) if c.fixed)
        items = sorted(((p, i) for i, (a, c) in enumerate(zip(alphas, cands)) if not c.fixed
                        for p in itertools.accumulate(a, lambda x, y: x * y)),
                       key=lambda x: -x[0])

        def plan_for(ls, tokens):
            used = [u and L > 0 for u, L in zip(neural, ls)]
            steps_needed = max((L for u, L in zip(used, ls) if u), default=0)
            draft = steps_needed * draft_step_s(sum(used)) if steps_needed else 0.0
            return (list(ls), used, steps_needed, tokens,
                    target_s(len(cands) + sum(ls)) + draft)

        plan = plan_for(ls, tokens)
        for p, i in items:
            ls[i] += 1
            tokens += p
            trial = plan_for(ls, tokens)
            if trial[3] / trial[4] > plan[3] / plan[4] + 1e-12:
                plan = trial
        if best is None or plan[3] / plan[4] > best[3] / best[4] + 1e-12:
            best = plan
    return best


@pytest.mark.parametrize("seed", range(12))
def test_running_totals_choose_the_plans_of_the_rebuilt_search(seed):
    rng = random.Random(seed)
    k = rng.randint(1, 5)

    def cand():
        free = tuple(rng.uniform(0.05, 0.98) for _ in range(rng.randint(0, k)))
        neural = tuple(rng.uniform(0.05, 0.98) for _ in range(rng.choice([0, k])))
        return Candidate(free, neural, rng.randint(0, k), rng.random() < 0.15)

    for _ in range(20):
        cands = [cand() for _ in range(rng.randint(1, 24))]
        target = linear(rng.uniform(0.02, 0.1), rng.uniform(0.0, 0.01))
        step = rng.choice([0.0, 0.0005, 0.003, 0.02])
        plan = choose_lengths(cands, target, lambda rows: step * (1 + 0.1 * rows))
        ref = _plan_rebuilt_for_every_m(cands, target, lambda rows: step * (1 + 0.1 * rows))
        assert (plan.lengths, plan.neural, plan.draft_steps) == tuple(ref[:3])
        assert (plan.tokens, plan.seconds) == (ref[3], ref[4])


def test_nothing_pays_is_plain_decoding():
    cands = [Candidate(free=(0.3, 0.2, 0.1), cap=3)] * 8
    plan = choose_lengths(cands, linear(0.05, 0.05), lambda rows: 0.0)  # a token = a step
    assert plan.lengths == [0] * 8 and plan.draft_steps == 0


def test_free_tokens_pay_at_a_flat_target_cost():
    cands = [Candidate(free=(0.9, 0.8, 0.5), cap=3), Candidate(free=(0.1, 0.1, 0.1), cap=3)]
    plan = choose_lengths(cands, linear(0.05, 0.0005), lambda rows: 0.0)
    assert plan.lengths[0] == 3  # a likely speculation is sent whole
    assert plan.lengths[1] < plan.lengths[0]


def test_the_uncertain_tail_is_cut():
    cands = [Candidate(free=(0.95, 0.9, 0.05), cap=3)]
    plan = choose_lengths(cands, linear(0.05, 0.01), lambda rows: 0.0)
    assert plan.lengths == [2]


def test_cap_and_fixed():
    c = Candidate(free=(0.9, 0.9, 0.9), cap=1)
    assert choose_lengths([c], linear(0.05, 0.0), lambda r: 0.0).lengths == [1]
    pinned = Candidate(free=(0.01, 0.01, 0.01), cap=3, fixed=True)  # sent whole regardless
    assert choose_lengths([pinned], linear(0.05, 0.05), lambda r: 0.0).lengths == [3]


def test_expensive_fallback_is_skipped_cheap_one_used():
    hit = Candidate(free=(0.9, 0.8, 0.7), cap=3)
    miss = Candidate(free=(), neural=(0.6, 0.6, 0.6), cap=3)
    target = linear(0.05, 0.002)
    dear = choose_lengths([hit, miss], target, lambda rows: 0.05)  # a draft step = a target step
    assert dear.lengths[1] == 0 and dear.draft_steps == 0 and dear.lengths[0] == 3
    cheap = choose_lengths([hit, miss], target, lambda rows: 0.001)
    assert cheap.neural == [False, True] and cheap.lengths[1] > 0
    assert cheap.draft_steps == cheap.lengths[1]


def test_fast_backup_preferred_when_neural_is_dear():
    miss = Candidate(free=(0.4, 0.3, 0.2), neural=(0.7, 0.7, 0.7), cap=3)  # free = fast backup
    target = linear(0.05, 0.001)
    dear = choose_lengths([miss] * 4, target, lambda rows: 0.03)
    assert not any(dear.neural) and sum(dear.lengths) > 0
    cheap = choose_lengths([miss] * 4, target, lambda rows: 0.0005)
    assert all(cheap.neural)


def test_never_worse_than_fixed_k_or_plain():
    rng = random.Random(3)
    for _ in range(50):
        n = rng.randint(1, 16)
        cands = [Candidate(free=tuple(rng.uniform(0.0, 1.0) for _ in range(4)), cap=4)
                 for _ in range(n)]
        target = linear(rng.uniform(0.01, 0.1), rng.uniform(0.0, 0.02))
        plan = choose_lengths(cands, target, lambda r: 0.0)
        for k in range(5):
            assert plan.rate >= rate_of(cands, [k] * n, target) - 1e-9


def test_batch_limit_falls_with_token_cost():
    from vllm_saguaro.core.theory import ssd_rate

    def limit(per_token, plain_gain=1.0):
        target = linear(0.05, per_token)
        rate = lambda b: ssd_rate(0.7, 3, 0.6, b, target, lambda rows: 0.004)  # noqa: E731
        return batch_limit(rate, lambda b: target(b) / plain_gain, max_batch=64)

    assert limit(0.0001) == 64 and 0 < limit(0.003) < 64 and limit(0.1) == 0
    assert limit(0.003, plain_gain=1.4) < limit(0.003)  # plain on lent cores: a higher bar


def test_a_realized_rate_needs_as_many_rows_at_any_batch_size():
    """min_rows: a round of b rows sums b rows' tokens, so 48 rows are 48 rounds at batch
    1, 12 at batch 4, and never fewer than min_rounds."""
    r = RealizedRate(min_rounds=8, alpha=0.02, min_rows=48)
    assert [r.rounds_needed(b) for b in (1, 2, 4, 5, 16)] == [48, 24, 12, 10, 8]
    for batch in (1, 4, 16):
        for i in range(r.rounds_needed(batch)):
            assert r.rate(batch, 0.0) is None
            r.observe(batch, 2 * batch, 0.1, 0.0)
        assert r.rate(batch, 0.0) == pytest.approx(20 * batch)


def test_step_cost_learns_a_line():
    rng = random.Random(0)
    cost = StepCost()
    assert not cost.known and cost.predict(10) == 0.0
    for _ in range(200):
        w = rng.randint(1, 64)
        cost.observe(w, 0.05 + 0.003 * w + rng.gauss(0, 0.001))
    assert cost.slope() == pytest.approx(0.003, rel=0.1)
    assert cost.predict(32) == pytest.approx(0.05 + 0.003 * 32, rel=0.05)


def test_step_cost_without_spread_keeps_the_prior_or_last_slope():
    cost = StepCost(token_cost=0.1)
    for _ in range(20):
        cost.observe(1, 0.06)
    assert cost.predict(1) == pytest.approx(0.06)
    assert cost.slope() == pytest.approx(0.1 * 0.06 / 1.1)  # prior: t = fixed (1 + 0.1 w)
    tuned = StepCost(fixed_s=0.05, per_token_s=0.004)
    assert tuned.predict(11) == pytest.approx(0.094)
    for _ in range(100):  # a pinned width later: the step time there follows the measurements
        tuned.observe(16, 0.12)
    assert tuned.predict(16) == pytest.approx(0.12, rel=0.02)


def test_fixed_miss_is_drafted_whole_however_dear():
    miss = Candidate(free=(), neural=(0.2, 0.2, 0.2), cap=3, fixed=True)
    plan = choose_lengths([miss, Candidate(free=(0.9,) * 3, cap=3)], linear(0.05, 0.01),
                          lambda rows: 0.1)
    assert plan.lengths[0] == 3 and plan.neural[0] and plan.draft_steps == 3


def test_batch_size_aware_fallback_crosses_like_the_papers_b_star():
    """One miss in a batch of hits: the neural backup (3 steps that stall the whole batch)
    pays at batch 1 and not at a large batch, where the fast backup takes over; the
    paper's b* (Corollary 16) for the same figures lies between."""
    from vllm_saguaro.core.theory import fallback_crossover

    hit = Candidate(free=(0.7, 0.7, 0.7), cap=3)
    miss = Candidate(free=(0.3, 0.3, 0.3), neural=(0.7, 0.7, 0.7), cap=3)
    target = linear(0.1, 0.0)  # verification as cheap per token as the GPU case
    step = lambda rows: 0.04 / 3  # noqa: E731  a neural backup of 0.4 rounds, as in the paper
    small = choose_lengths([miss], target, step)
    large = choose_lengths([miss] + [hit] * 63, target, step)
    assert small.neural[0] and not large.neural[0] and large.lengths[0] > 0
    e_n, e_f = 1 + expected_tokens((0.7,) * 3), 1 + expected_tokens((0.3,) * 3)
    b_star = fallback_crossover(0.7, e_n, e_n, e_f, 1.0, 0.4, 0.0)
    assert b_star is not None and 1 < b_star < 64


def test_fixed_miss_with_a_weak_fast_backup_is_never_cut():
    """K pinned: the neural backup drafts all K or the fast one does, never a shorter
    neural draft (found by the benchmark's lengths table)."""
    miss = Candidate(free=(0.2, 0.2, 0.2), neural=(0.6, 0.6, 0.6), cap=3, fixed=True)
    for step_s in (0.0001, 0.01, 1.0):
        plan = choose_lengths([miss], linear(0.05, 0.001), lambda rows: step_s)
        assert plan.lengths == [3]
    assert choose_lengths([miss], linear(0.05, 0.001), lambda rows: 0.0001).neural == [True]
    assert choose_lengths([miss], linear(0.05, 0.001), lambda rows: 1.0).neural == [False]


def test_realized_rate_is_known_after_enough_rounds_and_forgotten_after_ttl():
    r = RealizedRate(min_rounds=3, ttl_s=10.0, alpha=0.5)
    for i in range(2):
        r.observe(4, tokens=8, seconds=1.0, now=float(i))
    assert r.rate(4, 2.0) is None  # two rounds: not yet
    r.observe(4, tokens=4, seconds=1.0, now=2.0)
    assert r.rate(4, 2.0) == pytest.approx(6.0)  # 8, 8, then halfway to 4 (alpha)
    r.observe(4, tokens=6, seconds=2.0, now=2.5)  # tokens over seconds, not rates averaged
    assert r.rate(4, 2.5) == pytest.approx(6.0 / 1.5) and r.rounds(4) == 4
    assert r.rate(1, 2.0) is None  # another batch size: never measured
    assert r.rate(4, 13.0) is None  # ttl passed: speculation is to be tried again
    for i in range(3):  # measured anew from scratch, the old average forgotten
        r.observe(4, tokens=2, seconds=1.0, now=20.0 + i)
    assert r.rate(4, 22.0) == pytest.approx(2.0)
    m = RealizedRate(min_rounds=3, alpha=0.1)  # a plain mean while rounds < 1 / alpha
    for tokens in (1, 2, 3):
        m.observe(1, tokens=tokens, seconds=0.05, now=0.0)
    assert m.rate(1, 0.0) == pytest.approx(40.0)
    r.observe(4, tokens=9, seconds=0.0, now=22.0)  # no time: ignored
    assert r.rate(4, 22.0) == pytest.approx(2.0)


def test_the_realized_rate_bound_widens_with_noise_and_narrows_with_rounds():
    """RealizedRate.bounds: rate + REALIZED_Z standard errors of the ratio estimator; as
    tight as the rate for rounds that all gave the same, and a dip that noise explains
    (rounds of 1 or 2 tokens at ~0.04 s, SD on the lent cores at batch 1) does not put
    the bound below what the model expects there."""
    from vllm_saguaro.core.controller import REALIZED_Z

    steady = RealizedRate(min_rounds=4, alpha=0.05)
    for i in range(50):
        steady.observe(1, tokens=2, seconds=0.05, now=0.0)
    assert steady.bounds(1, 0.0)[1] == pytest.approx(steady.rate(1, 0.0))
    assert steady.rate(1, 0.0) == pytest.approx(40.0)
    noisy, few = RealizedRate(min_rounds=4, alpha=0.05), RealizedRate(min_rounds=4, alpha=0.05)
    pattern = [1, 1, 2, 1, 1, 2, 1, 2]  # 11 tokens in 8 rounds: a dip to 34 tok/s
    for i in range(48):
        noisy.observe(1, tokens=pattern[i % 8], seconds=0.04, now=0.0)
    for t in pattern:
        few.observe(1, tokens=t, seconds=0.04, now=0.0)
    rate = noisy.rate(1, 0.0)
    assert rate == pytest.approx(few.rate(1, 0.0), rel=0.05)
    assert rate < 36.0 < noisy.bounds(1, 0.0)[1]  # the model's 36: not ruled out
    # more rounds, tighter
    assert few.bounds(1, 0.0)[1] - rate > noisy.bounds(1, 0.0)[1] - rate > 0
    # a loss beyond the noise is: 1 token a round where the model expects 1.5
    losing = RealizedRate(min_rounds=4, alpha=0.05)
    for i in range(48):
        losing.observe(1, tokens=1 + (i % 10 == 0), seconds=0.04, now=0.0)
    assert losing.bounds(1, 0.0)[1] < 36.0
    assert noisy.bounds(1, 0.0, z=0.0)[1] == pytest.approx(rate) and REALIZED_Z > 0
    assert noisy.bounds(2, 0.0) is None  # not measured: as rate


def test_the_fallback_drafts_on_while_the_run_of_likely_tokens_pays():
    """draft_more_pays: one more step where the next token, guessed as likely as the
    last, raises the batch's expected rate over its cost; not for an unlikely one."""
    from vllm_saguaro.core.controller import draft_more_pays

    def verify(w):
        return 0.04 + 0.001 * w

    sure = [Candidate(free=(0.9,), cap=1)], [Candidate(free=(0.9, 0.9), cap=2)]
    assert draft_more_pays(*sure, verify, step_s=0.005, spent_s=0.005)  # 2.71 / 53 ms > 1.9 / 47
    unsure = [Candidate(free=(0.2,), cap=1)], [Candidate(free=(0.2, 0.2), cap=2)]
    assert not draft_more_pays(*unsure, verify, step_s=0.005, spent_s=0.005)
    # a costly step (a large batch's draft, a slow draft) does not pay even for a sure token
    assert not draft_more_pays(*sure, verify, step_s=0.05, spent_s=0.005)
    # the other rows' tokens count in the batch's rate: beside a hit of 3 sure tokens the
    # same step is worth less
    hit = Candidate(free=(0.95,) * 3, cap=3)
    assert not draft_more_pays([hit, sure[0][0]], [hit, sure[1][0]], verify, step_s=0.012,
                               spent_s=0.005)
    assert draft_more_pays(*sure, verify, step_s=0.012, spent_s=0.005)


def test_the_measured_rate_clamps_the_model_both_ways():
    """RealizedRate.clamp: the model's rate where nothing is measured, and within the
    measurement's bounds; moved to the nearer bound where the measurement rules it out,
    up as well as down (SSD on code at batch 1 gave 1.4x what its model said)."""
    r = RealizedRate(min_rounds=4, alpha=0.05)
    assert r.clamp(30.0, 1, 0.0) == 30.0 and r.bounds(1, 0.0) is None
    pattern = [1, 1, 2, 1, 1, 2, 1, 2]  # 11 tokens in 8 rounds of 0.04 s: 34.4 tok/s
    for i in range(48):
        r.observe(1, tokens=pattern[i % 8], seconds=0.04, now=0.0)
    lower, upper = r.bounds(1, 0.0)
    assert lower < r.rate(1, 0.0) < upper
    assert upper - r.rate(1, 0.0) == pytest.approx(r.rate(1, 0.0) - lower)  # either side
    assert r.clamp(r.rate(1, 0.0), 1, 0.0) == pytest.approx(r.rate(1, 0.0))  # not ruled out
    assert r.clamp(20.0, 1, 0.0) == pytest.approx(lower) and lower > 20.0  # measured above
    assert r.clamp(50.0, 1, 0.0) == pytest.approx(upper) and upper < 50.0  # measured below
    assert r.clamp(20.0, 2, 0.0) == 20.0  # another batch size: the model's


def test_sd_on_the_lent_cores_is_discounted_only_when_taken_up():
    from vllm_saguaro.core.controller import LENT_SD_ENTRY_MARGIN, lent_sd_worth

    assert lent_sd_worth(30.0, continuing=True) == 30.0
    assert lent_sd_worth(30.0, continuing=False) == pytest.approx(30.0 / (1 + LENT_SD_ENTRY_MARGIN))
    assert lent_sd_worth(None, continuing=False) is None and LENT_SD_ENTRY_MARGIN > 0


def test_auto_regime_settles_as_the_workers_rules_do():
    from vllm_saguaro.core.controller import LENT_SD_ENTRY_MARGIN, auto_regime

    m = 1 + LENT_SD_ENTRY_MARGIN
    assert auto_regime(20.0, None, 25.0) == ("plain", 25.0)        # nothing beats plain
    assert auto_regime(26.0, None, 25.0) == ("ssd", 26.0)          # no lent cores: SSD
    assert auto_regime(20.0, 30.0, 25.0) == ("lent_sd", 30.0)      # runs at its own rate
    # ahead of plain decoding, but not by the entry margin: never taken up
    assert auto_regime(20.0, 25.0 * m * 0.99, 25.0) == ("plain", 25.0)
    assert auto_regime(20.0, 25.0 * m * 1.01, 25.0)[0] == "lent_sd"
    # ahead of SSD, not by the margin: SSD
    assert auto_regime(27.0, 27.0 * m * 0.99, 25.0) == ("ssd", 27.0)


def test_a_catch_up_pays_only_if_the_gain_repays_it_within_the_horizon():
    from vllm_saguaro.core.controller import CATCH_UP_HORIZON_S, catch_up_pays

    # 10 tokens/s lost for 1 s: a gain of 2 tokens/s repays it in 5 s, 1.9 does not
    assert catch_up_pays(2.0, 1.0, 10.0, horizon_s=5.0)
    assert not catch_up_pays(1.9, 1.0, 10.0, horizon_s=5.0)
    assert catch_up_pays(0.1, 0.0, 10.0)           # nothing to catch up
    assert catch_up_pays(0.1, 3.0, 0.0)            # nothing lost meanwhile (no lending)
    assert catch_up_pays(0.1, 3.0, -5.0)           # the lent cores were no faster
    assert not catch_up_pays(0.0, 1.0, 1.0) and CATCH_UP_HORIZON_S > 0


def test_lent_sd_pays_only_when_known_and_faster():
    from vllm_saguaro.core.controller import lent_sd_pays

    assert lent_sd_pays(30.0, 31.0)
    assert not lent_sd_pays(30.0, 30.0) and not lent_sd_pays(30.0, 29.0)
    assert not lent_sd_pays(30.0, None)  # not measured yet: SSD


def test_ssd_takes_over_from_sd_on_the_lent_cores_only_with_a_margin():
    """continuing: SD on the lent cores runs already; SSD must be expected
    SSD_ENTRY_MARGIN faster to take over (a switch costs both ways)."""
    from vllm_saguaro.core.controller import SSD_ENTRY_MARGIN, lent_sd_pays

    m = 1 + SSD_ENTRY_MARGIN
    assert lent_sd_pays(30.0 * m * 0.99, 30.0, continuing=True)  # SSD ahead, not by the margin
    assert not lent_sd_pays(30.0 * m * 1.01, 30.0, continuing=True)
    assert not lent_sd_pays(30.0 * m * 0.99, 30.0)  # not running: merely ahead suffices
    assert not lent_sd_pays(10.0, None, continuing=True)


def test_scheduled_k_reads_vllms_schedule():
    """Ranges as vLLM's scheduler reads them: a gap and the tail carry the K before them,
    K caps every entry, no schedule is K everywhere (vLLM's own lookup is compared in
    tests/vllm_glue/test_patches.py)."""
    sched = [(1, 2, 3), (3, 4, 2), (8, 8, 5), (9, 16, 0)]
    got = [scheduled_k(sched, b, 4) for b in range(1, 21)]
    assert got == [3, 3, 2, 2, 2, 2, 2, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
    assert [scheduled_k(None, b, 4) for b in (1, 64)] == [4, 4]


def test_schedule_limit_is_the_largest_batch_below_that_may_send():
    sched = [(1, 2, 3), (3, 8, 0), (9, 12, 1), (13, 1024, 0)]
    assert schedule_limit(sched, 16, 3) == 12
    assert schedule_limit(sched, 12, 3) == 11 and schedule_limit(sched, 8, 3) == 2
    assert schedule_limit(sched, 1, 3) == 0
    assert schedule_limit([(1, 1024, 0)], 4, 3) == 0


def test_the_draft_may_idle_under_auto_or_a_schedule_with_a_zero():
    """Where the draft may idle its cores are lent on CPU (vllm_glue/lending.py): with K
    pinned too once vLLM's schedule lets nothing be sent at some batch size."""
    zero, none = [(1, 4, 3), (5, 1024, 0)], [(1, 4, 3), (5, 1024, 1)]
    assert may_idle("auto", True, None) and may_idle("auto", True, none)
    assert may_idle("fixed", True, zero)
    assert not may_idle("fixed", True, None) and not may_idle("fixed", True, none)
    assert not may_idle("auto", False, zero) and not may_idle("fixed", False, zero)
