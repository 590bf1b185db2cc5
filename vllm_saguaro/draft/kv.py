"""Paged KV for the draft: fixed-size blocks in one pool, a block table per sequence.

Sequences come and go with continuous batching; blocks let them share one pool without
fragmentation, and rolling back rejected tokens is just a shorter length. Branch KV of
the tree decode never enters the pool (it lives in per-round scratch tensors).
"""
from __future__ import annotations

import torch

from vllm_saguaro.draft.model import KV


class PagedKVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, block_size: int = 16, num_blocks: int = 64):
        self.block_size = block_size
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.free_blocks = list(range(num_blocks - 1, -1, -1))
        self.tables: dict[str, list[int]] = {}
        self.lengths: dict[str, int] = {}

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1] // self.block_size

    def _grow(self) -> None:
        """Double the pool; cheaper than refusing work, and rare after warm-up."""
        old = self.num_blocks
        self.k = torch.cat([self.k, torch.zeros_like(self.k)], dim=1)
        self.v = torch.cat([self.v, torch.zeros_like(self.v)], dim=1)
        self.free_blocks = list(range(2 * old - 1, old - 1, -1)) + self.free_blocks

    def length(self, seq: str) -> int:
        return self.lengths.get(seq, 0)

    def truncate(self, seq: str, n: int) -> None:
        """Keep the first n tokens' KV and give surplus blocks back."""
        table = self.tables.setdefault(seq, [])
        self.lengths[seq] = min(n, self.lengths.get(seq, 0))
        keep = -(-self.lengths[seq] // self.block_size)
        self.free_blocks.extend(reversed(table[keep:]))
        del table[keep:]

    def free(self, seq: str) -> None:
        self.truncate(seq, 0)
        self.tables.pop(seq, None)
        self.lengths.pop(seq, None)

    def _slots(self, seq: str, start: int, end: int) -> torch.Tensor:
        table = self.tables.setdefault(seq, [])
        need = -(-end // self.block_size)
        while len(table) < need:
            if not self.free_blocks:
                self._grow()
            table.append(self.free_blocks.pop())
        pos = torch.arange(start, end)
        blocks = torch.tensor(table, dtype=torch.long)[pos // self.block_size]
        return blocks * self.block_size + pos % self.block_size

    def append(self, seqs: list[str], counts: list[int], new_kv: list[KV]) -> None:
        """Write each sequence's first counts[i] new tokens after its current length.

        new_kv: per layer (k, v) of shape [N, Hkv, T, D] from DraftModel.forward.
        """
        slots, rows, cols = [], [], []
        for i, (seq, c) in enumerate(zip(seqs, counts)):
            if c == 0:
                continue
            start = self.length(seq)
            slots.append(self._slots(seq, start, start + c))
            rows.extend([i] * c)
            cols.extend(range(c))
            self.lengths[seq] = start + c
        if not slots:
            return
        idx = torch.cat(slots).to(self.k.device)
        r, c = torch.tensor(rows), torch.tensor(cols)
        for layer, (k, v) in enumerate(new_kv):
            self.k[layer].index_copy_(0, idx, k.transpose(1, 2)[r, c])
            self.v[layer].index_copy_(0, idx, v.transpose(1, 2)[r, c])

    def gather(self, seqs: list[str]) -> tuple[list[KV], torch.Tensor]:
        """Each sequence's KV, padded to the longest: per layer [N, Hkv, Lmax, D], lengths [N]."""
        lens = [self.length(s) for s in seqs]
        lmax = max(lens) if lens else 0
        idx = torch.zeros(len(seqs), lmax, dtype=torch.long)
        for i, (s, n) in enumerate(zip(seqs, lens)):
            if n:
                idx[i, :n] = self._slots(s, 0, n)
        idx = idx.to(self.k.device)
        out: list[KV] = []
        for layer in range(self.k.shape[0]):
            k = self.k[layer][idx].permute(0, 2, 1, 3)  # [N, Hkv, Lmax, D]
            v = self.v[layer][idx].permute(0, 2, 1, 3)
            out.append((k, v))
        return out, torch.tensor(lens, dtype=torch.long)
