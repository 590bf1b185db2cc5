"""What speculation is worth to a batch that drains: the caller waits for every request
of the batch (offline `LLM.generate`) and none waits to take a finished one's place.

The controller's usual objective, the batch's expected tokens per second, counts a token
accepted in any row as worth the same: right where a finished request's place goes to
the next (a queue), or where each request's own latency is what counts (a server: the
sum of the requests' rates). A draining batch ends with its last row, and its rows
share every step: a token accepted in a row the batch does not wait for saves no step.
Measured (issue 19, twenty-third round; MT-Bench, batch 4, T = 0, 64 tokens a request):
the idle's lookup drafts had 96 tokens accepted over six batches of 4 prompts, in the
rows continuing a match at the time, and each batch still took 63-64 steps where plain
decoding took 64-65; every round of them paid its verification's extra width, and
speculation ran 0.95x plain decoding.

Which rows the batch waits for: row n, with r_n tokens left and accepting g_n tokens a
round on average (its pace: what its drafts are expected to give, over its recent
rounds, sent or not), finishes in about S_n = r_n / (1 + g_n) steps; the rows within a
step or two of the longest S (SPAN_TIE_STEPS, SPAN_TIE_SHARE) are the ones the batch
waits for, k of them.
Under plain decoding on the line t(w) = fixed + per_token * w, rows with r_n tokens left
finish after

  T = fixed * max_n r_n + per_token * sum_n r_n,

so a token accepted in one of the k rows the batch waits for is worth fixed / k of a
step (the k rows need it alike), one in any other row per_token (the later steps
narrow). With every row alike (k = batch: text that repeats in every row) that is the
tokens-per-second objective's worth, fixed / batch + per_token; with one row it is a
whole step, as at batch 1. Myopic, as the rest of the controller; budgets (max_tokens)
are what the engine knows, and a request that ends early on its stop token only ends
sooner.

fixed / k assumes the k rows share their tokens over what is left of the batch. A row
among them that has nothing to send this round and is not expected to accept a single
token before it ends (its pace times its steps left below one: text that does not
repeat) finishes on its own count of steps whatever the others accept: while it does,
the others' tokens save none of the batch's steps (a blocker, blocks_the_batch), and are
worth per_token only. That is the batch's first match in a row of prose beside rows
that match nothing, before the matching row's pace takes it out of the k.
"""
from __future__ import annotations

from typing import Callable

from vllm_saguaro.core.controller import _prefix_probs, expected_tokens

# Rows whose finishing steps S_n are within SPAN_TIE_STEPS + SPAN_TIE_SHARE x the
# longest of it count as the ones the batch waits for: the paces are estimates, and
# rows that close are as likely to be the last.
SPAN_TIE_STEPS = 1.0
SPAN_TIE_SHARE = 0.05

# A waited row's draft this round gives fewer tokens than this, expected: it has nothing
# to send (blocks_the_batch).
BLOCKER_TOKENS = 0.1


def waited_for(left: list[int], pace: list[float]) -> list[bool]:
    """The rows the draining batch waits for: left[n] tokens, pace[n] accepted a round."""
    steps = [r / (1.0 + max(g, 0.0)) for r, g in zip(left, pace)]
    last = max(steps, default=0.0)
    return [s >= last - SPAN_TIE_STEPS - SPAN_TIE_SHARE * last for s in steps]


def blocks_the_batch(alphas: tuple[float, ...] | None, left: int, pace: float) -> bool:
    """Whether a row the batch waits for holds it whatever the others accept: nothing to
    send this round (alphas None, or fewer than BLOCKER_TOKENS expected) and less than
    one token expected over its steps left (pace x left / (1 + pace) < 1)."""
    pace = max(pace, 0.0)
    sends = alphas is not None and expected_tokens(alphas) >= BLOCKER_TOKENS
    return not sends and pace * left / (1.0 + pace) < 1.0


def span_lengths(alphas: list[tuple[float, ...] | None], left: list[int], pace: list[float],
                 plain_line: tuple[float, float], verify_s: Callable[[int], float],
                 margin: float) -> list[int]:
    """The lengths that finish the draining batch soonest: alphas[n], the acceptance of
    each token row n may send (None: it sends nothing); the batch's best m tokens by
    their worth (waited_for; per_token alone while a waited row blocks the batch,
    blocks_the_batch) for every m, the best m kept. All 0 unless it saves `margin` of a
    plain step."""
    batch = len(alphas)
    lengths = [0] * batch
    if not batch:
        return lengths
    fixed, per_token = plain_line
    waited = waited_for(left, pace)
    blocked = any(w and blocks_the_batch(a, r, g)
                  for w, a, r, g in zip(waited, alphas, left, pace))
    share = 0.0 if blocked else fixed / sum(waited)
    worth = [share * w + per_token for w in waited]
    # (seconds saved, row): each row's tokens in order, worth x P(accepted); the sort is
    # stable, so a row's tokens stay in order where they tie
    items = sorted(((worth[n] * p, n) for n, a in enumerate(alphas)
                    for p in _prefix_probs(a or ())), key=lambda item: -item[0])
    plain_s = fixed + per_token * batch
    saved, best, best_m = 0.0, margin * plain_s, 0
    for m, (value, _) in enumerate(items, 1):
        saved += value
        gain = saved - (verify_s(batch + m) - plain_s)
        if gain > best:
            best, best_m = gain, m
    for _, n in items[:best_m]:
        lengths[n] += 1
    return lengths
