"""TensorChannel: the per-round tensors (draft tokens, hit flags, q) between the target's
worker (rank 0) and the draft worker (rank 1) over a 2-rank torch.distributed group of
their own, outside vLLM's default group; Ray stays the control channel (the step call
and its small reply).

Why a process group and not Ray's object store: on GPUs the group is NCCL, so q goes
device to device instead of through host memory and Ray's serialisation (the issue's
57 MB a round for a 128k vocabulary); on CPU the same code runs with gloo, which is how it
is tested here. Why not a Ray Compiled Graph with an NCCL channel: it fixes the actor
call graph at compile time, and the draft worker's protocol has two concurrent calls
(step and the pre-speculation, which step may cut short) and a supervisor that restarts
the actor; a plain group is created again with the new worker.

Tensors cross as point-to-point send/recv; the receiver learns shapes and dtypes from the
Ray reply (``describe``), so nothing is sent twice. Every wait is bounded by the
channel's timeout: a dead peer raises, never hangs (the supervisor then falls back to
plain decoding, as for any draft failure).
"""
from __future__ import annotations

import datetime
import socket

import torch
import torch.distributed as dist

DTYPES = {str(t): t for t in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.bool,
                              torch.float32, torch.bfloat16, torch.float16)}


def free_address(host: str = "127.0.0.1") -> tuple[str, int]:
    with socket.socket() as s:
        s.bind((host, 0))
        return host, s.getsockname()[1]


class TensorChannel:
    """One end of the 2-rank group. Both ends construct at the same time (the constructor
    waits for the other, up to the timeout)."""

    def __init__(self, address: tuple[str, int], rank: int, backend: str = "gloo",
                 timeout_s: float = 60.0, device: torch.device | str = "cpu"):
        if rank not in (0, 1):
            raise ValueError(f"TensorChannel: rank must be 0 (target) or 1 (draft), not {rank}")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"TensorChannel: backend must be 'gloo' or 'nccl', not {backend!r}")
        self.rank, self.peer, self.backend = rank, 1 - rank, backend
        self.device = torch.device(device)
        timeout = datetime.timedelta(seconds=timeout_s)
        host, port = address
        self.store = dist.TCPStore(host, port, world_size=2, is_master=rank == 0,
                                   timeout=timeout, wait_for_workers=False)
        store = dist.PrefixStore(f"saguaro/{host}:{port}/", self.store)
        if backend == "gloo":
            self.group = dist.ProcessGroupGloo(store, rank, 2, timeout)
        else:
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.group = dist.ProcessGroupNCCL(store, rank, 2, opts)
        self._tag = 0

    @staticmethod
    def describe(tensors: list[torch.Tensor]) -> list[tuple[tuple[int, ...], str]]:
        """What the receiver needs to allocate: shape and dtype of each tensor."""
        return [(tuple(t.shape), str(t.dtype)) for t in tensors]

    def send(self, tensors: list[torch.Tensor]) -> list:
        """Start sending; returns the works (keep them, and the tensors, until done)."""
        works = []
        for t in tensors:
            if t.numel() == 0:  # nothing to send; recv() makes it from its description
                continue
            t = t.to(self.device).contiguous()
            works.append((self.group.send([t], self.peer, self._tag), t))
            self._tag += 1
        return works

    def recv(self, described: list[tuple[tuple[int, ...], str]]) -> list[torch.Tensor]:
        """Receive tensors of the shapes and dtypes `describe` gave on the other side."""
        out = []
        for shape, dtype in described:
            t = torch.empty(shape, dtype=DTYPES[dtype], device=self.device)
            if t.numel():
                self.group.recv([t], self.peer, self._tag).wait()
                self._tag += 1
            out.append(t)
        return out

    @staticmethod
    def wait(works: list) -> None:
        for work, _ in works:
            work.wait()
