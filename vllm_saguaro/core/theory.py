"""The paper's speedup formulas, to put predictions next to measurements."""
from __future__ import annotations


def expected_tokens_per_round(acceptance_rate: float, k: int) -> float:
    """E[tokens per round] = (1 - a^(K+1)) / (1 - a) under i.i.d. acceptance."""
    a = acceptance_rate
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def sd_speedup(expected_tokens: float, draft_time_ratio: float) -> float:
    """SD over autoregressive: E / (1 + T_SD), T_SD = drafting time / verify time."""
    return expected_tokens / (1.0 + draft_time_ratio)


def ssd_speedup(p_hit: float, e_hit: float, e_miss: float, t_primary: float, t_backup: float,
                batch_size: int = 1) -> float:
    """Theorem 7 (batch 1) and its batched form: one miss stalls the whole step."""
    p_all = p_hit ** batch_size
    tokens = p_hit * e_hit + (1.0 - p_hit) * e_miss
    time = p_all * max(1.0, t_primary) + (1.0 - p_all) * (1.0 + t_backup)
    return tokens / time


def fallback_crossover(p_hit: float, e_hit: float, e_miss_neural: float, e_miss_fast: float,
                       t_primary: float, t_neural: float, t_fast: float, max_batch: int = 1024) -> int | None:
    """b*: the smallest batch size at which the fast backup beats the neural one."""
    for b in range(1, max_batch + 1):
        neural = ssd_speedup(p_hit, e_hit, e_miss_neural, t_primary, t_neural, b)
        fast = ssd_speedup(p_hit, e_hit, e_miss_fast, t_primary, t_fast, b)
        if fast > neural:
            return b
    return None


# Predicted decode rates from measured costs (vllm-saguaro tune): target_s(w) is the
# target's step time at w tokens verified, draft_step_s(rows) one draft step for that
# many rows (core/controller.py StepCost); a = per-token acceptance (i.i.d.). overhead_s:
# what a speculating round costs beyond those steps (the draft's reply crossing, vLLM's
# spec-decode bookkeeping), measured by tune; left out (0) the prediction was 20-25% too
# high on the reference pair at every batch size (benchmarks/results/tune).
def target_alone_rate(batch: int, target_s) -> float:
    """Tokens per second of plain decoding."""
    return batch / target_s(batch)


def sd_rate(a: float, k: int, batch: int, target_s, draft_step_s,
            overhead_s: float = 0.0) -> float:
    """Synchronous SD: every round drafts K steps, then verifies K+1 tokens a sequence."""
    if k == 0:
        return target_alone_rate(batch, target_s)
    e = expected_tokens_per_round(a, k)
    return batch * e / (target_s(batch * (k + 1)) + k * draft_step_s(batch) + overhead_s)


def ssd_rate(a: float, k: int, p_hit: float, batch: int, target_s, draft_step_s,
             a_fast: float | None = None, overhead_s: float = 0.0,
             fast: list[tuple[float, float]] | None = None, rest_neural: bool = True) -> float:
    """SSD: a round waits for a fallback unless no sequence needs the neural one; the
    neural fallback drafts K steps for the missed rows, the fast one is free. fast: the
    misses the fast backup serves, as (share of the misses, its acceptance on them), the
    rest the neural one's (core/fallback.py MatchAcceptance: by match length), or, with
    rest_neural False, nobody's: they send nothing and decode one token, as the
    controller does with a miss no draft makes worth verifying (choose_lengths). Where
    the neural fallback's stall costs more than its tokens give (a batch of 4 and more,
    with most positions matching nothing), that is the best the fast backup can do.
    a_fast: every miss the fast backup's, at that acceptance. The draft's
    pre-speculation is assumed hidden (it fits the round: fit_to_round)."""
    if k == 0:
        return target_alone_rate(batch, target_s)
    if a_fast is not None:
        fast = [(1.0, a_fast)]
    fast = fast or []
    e = expected_tokens_per_round(a, k)
    served = min(1.0, sum(share for share, _ in fast))
    e_rest = e if rest_neural else 1.0
    e_miss = (sum(share * expected_tokens_per_round(af, k) for share, af in fast)
              + (1.0 - served) * e_rest)
    # a row's chance to need the neural fallback, and to send k tokens
    neural = (1.0 - p_hit) * (1.0 - served) if rest_neural else 0.0
    sent = p_hit + (1.0 - p_hit) * served + neural
    stall = 0.0
    if neural > 0.0:
        rows = max(1, round(batch * neural))
        stall = (1.0 - (1.0 - neural) ** batch) * k * draft_step_s(rows)
    tokens = batch * (p_hit * e + (1.0 - p_hit) * e_miss)
    return tokens / (target_s(batch * (1 + k * sent)) + stall + overhead_s)
