"""TensorChannel with gloo between two processes (the draft worker's end in a spawned
process, as the Ray actor is): tensors arrive bit for bit, empty ones too, and a peer
that never comes or dies raises within the timeout instead of hanging."""
import multiprocessing as mp
import time

import pytest
import torch

from vllm_saguaro.transport import TensorChannel, free_address


def _echo(address, descriptions, rounds):
    ch = TensorChannel(address, 1, timeout_s=30)
    for _ in range(rounds):
        got = ch.recv(descriptions.get())
        ch.wait(ch.send([g if g.dtype == torch.bool else g + 1 for g in got]))
    time.sleep(0.2)


def _die_after_connecting(address):
    TensorChannel(address, 1, timeout_s=30)
    time.sleep(0.5)


def _spawn(target, *args):
    ctx = mp.get_context("spawn")
    p = ctx.Process(target=target, args=args, daemon=True)
    p.start()
    return p


def test_rounds_of_tensors_arrive_exactly_empty_ones_included():
    ctx = mp.get_context("spawn")
    descriptions = ctx.Queue()
    address = free_address()
    p = _spawn(_echo, address, descriptions, 3)
    ch = TensorChannel(address, 0, timeout_s=30)
    gen = torch.Generator().manual_seed(0)
    for r in range(3):
        sent = [torch.randint(0, 50000, (16, 7), generator=gen),          # draft tokens
                torch.rand(16, generator=gen) > 0.5,                       # hit flags
                torch.randint(0, 2**15, (16, 7, 1000 * (r + 1)), generator=gen,
                              dtype=torch.int32).to(torch.int16),          # q counts
                torch.zeros(0, 7, dtype=torch.int64),                      # nobody sent
                torch.rand(3, 5, generator=gen).to(torch.bfloat16)]
        descriptions.put(ch.describe(sent))
        works = ch.send(sent)
        back = ch.recv(ch.describe(sent))
        ch.wait(works)
        for b, s in zip(back, sent):
            assert b.dtype == s.dtype and b.shape == s.shape
            assert torch.equal(b, s if s.dtype == torch.bool else s + 1)
    p.join(30)
    assert p.exitcode == 0


def test_a_peer_that_never_connects_raises_within_the_timeout():
    t0 = time.perf_counter()
    with pytest.raises(Exception):
        TensorChannel(free_address(), 0, timeout_s=2)
    assert time.perf_counter() - t0 < 30


def test_a_peer_that_dies_raises_instead_of_hanging():
    address = free_address()
    p = _spawn(_die_after_connecting, address)
    ch = TensorChannel(address, 0, timeout_s=5)
    t0 = time.perf_counter()
    with pytest.raises(Exception):
        ch.recv([((4,), "torch.int64")])
    assert time.perf_counter() - t0 < 30
    p.join(30)


def test_bad_rank_and_backend_are_named():
    with pytest.raises(ValueError, match="rank must be 0"):
        TensorChannel(free_address(), 2)
    with pytest.raises(ValueError, match="backend must be"):
        TensorChannel(free_address(), 0, backend="mpi")
