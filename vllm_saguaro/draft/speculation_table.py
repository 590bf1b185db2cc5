"""SpeculationTable: one round's speculation cache for the whole batch, as flat tensors on
the draft device, looked up by one op (ops.cache_lookup).

core/cache.SpeculationCache keeps each sequence's branches in a dict of Python objects:
the right shape for CPU, where a dict lookup costs microseconds (benchmarks/ops_timing.py).
On a GPU the branches' tokens and q are produced there by the tree decode, and every
per-branch Python object is a host round trip. Here the pre-speculation writes them into
preallocated buffers (keys [N, 3] = (slot, k, t*), tokens [N, K], q counts [N, K, head])
and the next round's outcomes of all sequences are matched in one call; only the hit
rows' tokens come back to the host.

q is kept as the exact integer counts the draft sampled from (core/sampling.Q_SCALE), two
bytes each like bf16, but exact: the verifier must be told the very q a token was drawn
from, and bf16's 8 bits of mantissa would change it (the sampled output would no longer
be distributed as the target's). Counts run to Q_SCALE = 2^15, one past int16, so they are
stored as uint16 bit patterns in int16 (core/sampling.counts_int16).

The branches' KV is not kept: the next round's glue pass runs the sent speculation into
the paged KV anyway (draft/kv.py), so a branch's scratch KV would only save that pass's
K tokens per sequence, at the price of copying every branch's KV into blocks each round
(most branches are never hit).
"""
from __future__ import annotations

import torch

from vllm_saguaro.core.cache import Speculation
from vllm_saguaro.core.outcome import Outcome
from vllm_saguaro.core.sampling import counts_int16, q_from_int16
from vllm_saguaro.ops import cache_lookup


class SpeculationTable:
    def __init__(self, K: int, head: int, device: torch.device | str, capacity: int = 64):
        self.K, self.head, self.device = K, head, torch.device(device)
        self.capacity = capacity
        self.keys = torch.full((capacity, 3), -1, dtype=torch.long, device=self.device)
        self.tokens = torch.zeros(capacity, K, dtype=torch.long, device=self.device)
        self.lengths = torch.zeros(capacity, dtype=torch.long, device=self.device)
        self.confidence = torch.full((capacity, K), float("nan"), device=self.device)
        self.q: torch.Tensor | None = None         # [capacity, K, head] int16, on first q
        self.sampled = torch.zeros(capacity, dtype=torch.bool, device=self.device)
        self.size = 0
        self.slots: dict[str, int] = {}             # sequence -> its slot in the keys

    def clear(self) -> None:
        """Empty the table (the buffers stay allocated)."""
        self.size = 0
        self.slots = {}

    def retain(self, rids: list[str]) -> None:
        """Keep only these sequences' branches (the ones whose outcome is still to come),
        moved to the front of the buffers: the pre-speculation calls this before it adds
        the round's new branches, so the table holds at most one round per sequence."""
        keep = [r for r in rids if r in self.slots]
        if len(keep) == len(self.slots):
            return
        if not keep:
            self.clear()
            return
        remap = torch.full((len(self.slots),), -1, dtype=torch.long, device=self.device)
        for new, rid in enumerate(keep):
            remap[self.slots[rid]] = new
        rows = (remap[self.keys[: self.size, 0]] >= 0).nonzero()[:, 0]
        n = rows.numel()
        buffers = ["keys", "tokens", "lengths", "confidence", "sampled"]
        for name in buffers + (["q"] if self.q is not None else []):
            buf = getattr(self, name)
            buf[:n] = buf[rows]  # the gather is a new tensor: no overlap in the copy
        self.keys[:n, 0] = remap[self.keys[:n, 0]]
        self.size = n
        self.slots = {rid: i for i, rid in enumerate(keep)}

    def _reserve(self, n: int) -> None:
        """Room for n more branches: double the buffers (rare after warm-up)."""
        need = self.size + n
        if need <= self.capacity:
            return
        cap = max(need, 2 * self.capacity)

        def grow(t: torch.Tensor, fill) -> torch.Tensor:
            out = torch.full((cap, *t.shape[1:]), fill, dtype=t.dtype, device=self.device)
            out[: self.capacity] = t
            return out

        self.keys, self.tokens = grow(self.keys, -1), grow(self.tokens, 0)
        self.lengths, self.sampled = grow(self.lengths, 0), grow(self.sampled, False)
        self.confidence = grow(self.confidence, float("nan"))
        if self.q is not None:
            self.q = grow(self.q, 0)
        self.capacity = cap

    def put(self, rid: str, branches: list[Outcome], specs: list[Speculation]) -> None:
        """One sequence's branches (outcome -> speculation), as the tree decode drafted them."""
        if rid in self.slots:  # its old branches would match first: retain() drops them
            raise ValueError(f"sequence {rid!r} already has branches on the table")
        slot = self.slots[rid] = len(self.slots)
        n = len(branches)
        self._reserve(n)
        rows = slice(self.size, self.size + n)
        # built on the host, then one copy per buffer (not one per branch and field)
        tokens = torch.zeros(n, self.K, dtype=torch.long)
        conf = torch.full((n, self.K), float("nan"))
        for j, spec in enumerate(specs):
            m = len(spec.tokens)
            tokens[j, :m] = torch.tensor(spec.tokens, dtype=torch.long)
            if spec.confidence is not None:
                conf[j, :m] = torch.tensor([float("nan") if c is None else c
                                            for c in spec.confidence])
        self.keys[rows] = torch.tensor([(slot, o.k, o.bonus) for o in branches],
                                       dtype=torch.long).view(n, 3).to(self.device)
        self.tokens[rows] = tokens.to(self.device)
        self.confidence[rows] = conf.to(self.device)
        self.lengths[rows] = torch.tensor([len(s.tokens) for s in specs],
                                          dtype=torch.long).to(self.device)
        self.sampled[rows] = torch.tensor([s.probs is not None for s in specs],
                                          dtype=torch.bool).to(self.device)
        for r, spec in zip(range(self.size, self.size + n), specs):
            if spec.probs is not None:  # q is on the draft's device already
                if self.q is None:
                    self.q = torch.zeros(self.capacity, self.K, self.head, dtype=torch.int16,
                                         device=self.device)
                self.q[r, :len(spec.tokens)] = counts_int16(spec.probs.to(self.device))
        self.size += n

    def lookup(self, queries: list[tuple[str, Outcome]]) -> list[Speculation | None]:
        """Each (sequence, verified outcome) -> its cached speculation, or None (a miss),
        in one op over the table."""
        if not queries:
            return []
        q = torch.tensor([(self.slots.get(rid, -1), o.k, o.bonus) for rid, o in queries],
                         dtype=torch.long).to(self.device)
        idx = cache_lookup(self.keys[: self.size], q).tolist()
        hit_rows = [i for i in idx if i >= 0]
        if not hit_rows:
            return [None] * len(queries)
        rows = torch.tensor(hit_rows, device=self.device)
        tokens = self.tokens[rows].tolist()
        lengths = self.lengths[rows].tolist()
        conf = self.confidence[rows].tolist()
        sampled = self.sampled[rows].tolist()
        found = {}
        for j, (r, m) in enumerate(zip(hit_rows, lengths)):
            probs = None
            if sampled[j]:
                probs = q_from_int16(self.q[r, :m])
            found[r] = Speculation(tokens[j][:m], probs,
                                   [None if c != c else c for c in conf[j][:m]])
        return [found.get(i) if i >= 0 else None for i in idx]


class TableView:
    """One sequence's branches in the table, with SpeculationCache's lookup: the worker's
    per-sequence state points at it where the table is in use."""

    def __init__(self, table: SpeculationTable, rid: str, size: int):
        self.table, self.rid, self.size = table, rid, size

    def lookup(self, outcome: Outcome) -> Speculation | None:
        return self.table.lookup([(self.rid, outcome)])[0]

    @property
    def entries(self) -> dict[Outcome, Speculation]:
        """Every branch as SpeculationCache holds them (inspection and tests: one lookup
        per branch)."""
        slot = self.table.slots.get(self.rid)
        if slot is None:
            return {}
        keys = self.table.keys[: self.table.size]
        outcomes = [Outcome(k, t) for s, k, t in keys[keys[:, 0] == slot].tolist()]
        return dict(zip(outcomes, self.table.lookup([(self.rid, o) for o in outcomes])))

    def __len__(self) -> int:
        return self.size
