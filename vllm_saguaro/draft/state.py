"""What the draft worker holds for each sequence, and the round protocol's messages
(vllm_glue/proposer.py sends Updates and TargetSteps, gets Results back)."""
from __future__ import annotations

from dataclasses import dataclass, field

from vllm_saguaro.core.cache import SpeculationCache
from vllm_saguaro.core.fallback import FastDraft
from vllm_saguaro.core.sampling import SamplingSpec
from vllm_saguaro.draft.speculation_table import TableView

# (request id, tokens sampled this round or None, full token list on (re)sync or None,
#  the request's SamplingSpec fields on (re)sync or None)
Update = tuple[str, "list[int] | None", "list[int] | None", "tuple | None"]
# (draft tokens, 0..K of them, hit flag, q as uint16 counts [len(tokens), head]
#  (core/sampling.py) or None for greedy)
Result = tuple[list[int], "bool | None", object]
# A target step the proposer measured: (tokens it verified, seconds, whether it ran on the
# draft's cores too: vllm_glue/lending.py[, whether it verified draft tokens])
TargetStep = tuple[int, float, bool] | tuple[int, float, bool, bool]


@dataclass
class SeqState:
    tokens: list[int]                       # verified tokens (prompt + output)
    sampling: SamplingSpec = SamplingSpec()
    kv_tokens: list[int] = field(default_factory=list)  # tokens whose KV is in the pool
    spec: list[int] | None = None           # speculation sent, awaiting its outcome
    cache: SpeculationCache | TableView | None = None  # outcomes pre-speculated for it
    roots: frozenset | None = None          # the outcomes being pre-speculated (after fork)
    source: str = "neural"                  # who drafted spec: "hit" (the cache), "neural",
                                            # "fast"; "plain" = nothing sent
    aborted: bool = False                   # its pre-speculation was cut short
    confidence: list[float] | None = None   # the draft's confidence in each token of spec
    fast: FastDraft | None = None           # the fast backup's latest draft (a miss's)
    shadow_fast: FastDraft | None = None    # the fast backup's draft for this round, not
                                            # sent: its acceptance measured all the same
