"""The draft worker's counters: what the benchmark's profile table is built from.

Cumulative (the benchmark takes differences between two reports), plain numbers so they
cross Ray and JSON as they are.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# Why a lookup missed (DraftStats.miss_*):
#   k          no branch was pre-speculated for the accepted length k
#   bonus      branches for that k, but not for the bonus token the verifier drew
#   cut_short  the pre-speculation was cut short (a certain miss elsewhere in the batch)
#   not_started  no pre-speculation ran for that speculation before its outcome came
MISS_REASONS = ("k", "bonus", "cut_short", "not_started")


@dataclass
class DraftStats:
    lookups: int = 0
    hits: int = 0
    fallback_rounds: int = 0      # rounds in which the neural fallback drafted
    fallback_seqs: int = 0        # sequences drafted by the fallback (misses + syncs)
    fast_seqs: int = 0            # misses drafted by the fast backup instead
    syncs: int = 0                # new or resynchronised sequences
    branches: int = 0             # branches pre-speculated
    prespec_s: float = 0.0        # time spent pre-speculating (hidden behind verification)
    fallback_s: float = 0.0       # time spent drafting on the critical path
    aborted: int = 0              # pre-speculations cut short by a certain miss
    lock_wait_s: float = 0.0      # time step() waited for the pre-speculation in flight
    acceptance_rate: float = 0.0  # the fitted a_p the geometric fan-out now uses
    budget: int = 0               # the geometric budget per sequence now in use
    fast_rounds: int = 0          # rounds whose misses the fast backup alone drafted
    fast_shadowed: int = 0        # outcomes that judged a fast-backup draft not sent
    text_changes: int = 0         # new text moved the 3-token match share: rates forgotten
    sampling_changes: int = 0     # the batch's sampled share moved: rates forgotten
    # Verified outcomes and the tokens they gave (accepted + bonus), by who drafted the
    # speculation: the theory's E_hit and E_miss, and the fast backup's own acceptance.
    hit_outcomes: int = 0
    hit_tokens: int = 0
    neural_outcomes: int = 0
    neural_tokens: int = 0
    fast_outcomes: int = 0
    fast_tokens: int = 0
    plain_outcomes: int = 0       # rounds a sequence sent nothing (plain decoding)
    plain_tokens: int = 0
    # The controller: sequence-rounds by the number of tokens sent (index = length), and
    # pre-speculations skipped because no cached token would have been sent.
    sent: list[int] = field(default_factory=lambda: [0] * 33)
    prespec_skipped: int = 0
    lent_probes: int = 0          # batch sizes idled once to measure the lent cores
    catch_up_idles: int = 0       # steps that idled rather than prefill the batch (catch_up_pays)
    lent_sd_steps: int = 0        # steps in the lent_sd regime (SD on every core, no pre-speculation)
    catch_up_glues: int = 0       # pre-speculations cut to the glue pass (a new sequence's prefill)
    lent_sd_explores: int = 0     # close idles ended by trying SD on the lent cores again
    ssd_explores: int = 0         # explorations of SSD where SD on the lent cores was chosen
    ssd_explores_cut: int = 0     # of them, ended early: what SSD gave was surely below
    ssd_retries_held: int = 0     # idles that held a try of SSD: its model not risen since one lost
    prefill_s_per_token: float = 0.0  # the draft's prefill speed as now measured (not cumulative)
    ops_rows: int = 0             # sampled rows drawn by ops.saguaro_sample (GPU path)
    ops_forks: int = 0            # positions forked by ops.fork_candidates (GPU path)
    # The controller's cost models as now fitted (not cumulative): the target's step
    # t(w) = fixed + per_token x w, a neural draft step d(rows) = fixed + per_row x rows,
    # and the fast backup's per-token acceptance (vllm-saguaro tune reads them).
    target_fixed_s: float | None = None
    target_per_token_s: float | None = None
    draft_fixed_s: float | None = None
    draft_per_row_s: float | None = None
    lent_fixed_s: float | None = None      # the target's step on the lent cores (every core)
    lent_per_token_s: float | None = None
    # SD on the lent cores: its verification on every core, the draft's step with the
    # target's cores borrowed, and what its round costs beyond the two (an average)
    lent_sd_fixed_s: float | None = None
    lent_sd_per_token_s: float | None = None
    borrowed_draft_fixed_s: float | None = None
    borrowed_draft_per_row_s: float | None = None
    lent_sd_overhead_s: float | None = None
    fast_acceptance_rate: float = 0.0
    # The round's profile: why lookups missed, where the draft's time went.
    miss_k: int = 0
    miss_bonus: int = 0
    miss_cut_short: int = 0
    miss_not_started: int = 0
    glue_s: float = 0.0           # pre-speculation: the glue pass (and the fork)
    tree_s: float = 0.0           # pre-speculation: the tree decode
    prespec_runs: int = 0
    prespec_done: int = 0         # pre-speculations that filled their caches
    q_bytes: int = 0              # bytes of draft distributions q sent to the target
    channel_sends: int = 0      # rounds whose q went over the TensorChannel (transport)

    def note_outcome(self, source: str, tokens: int) -> None:
        setattr(self, f"{source}_outcomes", getattr(self, f"{source}_outcomes") + 1)
        setattr(self, f"{source}_tokens", getattr(self, f"{source}_tokens") + tokens)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


