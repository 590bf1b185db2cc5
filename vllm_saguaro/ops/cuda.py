"""The CUDA ops from csrc/ (the extension `vllm_saguaro._C`), where they were built.

setup.py builds the extension only where a CUDA toolkit and a CUDA torch are both present;
everywhere else (the CPU install, a GPU box installed without nvcc) it is absent and the
ops run in Triton on CUDA and in torch on CPU (ops/backend.py). `available()` says which:
it tries the import once, never raises, and registers the fake (meta) implementations
that torch.compile and meta tensors need only when the library loaded.

The wrappers take the arguments of the torch references (ops/saguaro_sampling.py,
ops/cache_lookup.py) and return what they return; they convert the dtypes the kernels
take (float32 logits with unit column stride, float32 temperature/top_p, int32
top_k/fanout, int64 seeds, int64 keys and queries) and move the per-row arguments to the
logits' (queries') device.
"""
from __future__ import annotations

import functools
import importlib
import logging

import torch

log = logging.getLogger(__name__)

EXTENSION = "vllm_saguaro._C"


def _fake_cache_lookup(keys: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    return queries.new_empty((queries.shape[0],), dtype=torch.long)


def _fake_saguaro_sample(logits, temperature, top_k, top_p, fanout, c, seeds):
    R, V = logits.shape
    return (logits.new_empty((R,), dtype=torch.long),
            logits.new_empty((R, V), dtype=torch.float32))


def _register_fakes() -> None:
    torch.library.register_fake("saguaro::cache_lookup")(_fake_cache_lookup)
    torch.library.register_fake("saguaro::saguaro_sample")(_fake_saguaro_sample)


def _load_extension() -> None:
    importlib.import_module(EXTENSION)  # its static initialisers register torch.ops.saguaro


@functools.cache
def available() -> bool:
    """True where the extension was built and loads (its ops are then torch.ops.saguaro.*)."""
    try:
        _load_extension()
    except Exception as e:  # ImportError on CPU installs; OSError for a broken build
        log.debug("saguaro CUDA ops not available: %s", e)
        return False
    try:
        _register_fakes()
    except Exception as e:  # the ops still run eagerly; only tracing needs the fakes
        log.warning("saguaro CUDA ops: registering fake implementations failed: %s", e)
    return True


def _require() -> None:
    if not available():
        raise RuntimeError(f"saguaro CUDA ops: {EXTENSION} is not built (setup.py builds it "
                           "only with a CUDA toolkit and a CUDA torch); use the Triton ops")


def cache_lookup_cuda(keys: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """keys [N, 3], queries [B, 3] int64 (row, k, token) -> [B] int64 first index or -1."""
    _require()
    dev = queries.device
    keys = keys.to(dev, torch.long).reshape(-1, 3).contiguous()
    return torch.ops.saguaro.cache_lookup(keys, queries.long().contiguous())


def saguaro_sample_cuda(logits: torch.Tensor, temperature: torch.Tensor,
                        top_k: torch.Tensor, top_p: torch.Tensor, fanout: torch.Tensor,
                        c: float, seeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, V]; temperature, top_p, top_k (<= 0: off), fanout, seeds [R]
    -> tokens [R] int64, q [R, V] float32 (= counts / Q_SCALE)."""
    _require()
    dev = logits.device
    x = logits.float()
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        x = x.contiguous()
    return torch.ops.saguaro.saguaro_sample(
        x, temperature.to(dev, torch.float32).contiguous(),
        top_k.to(dev, torch.int32).contiguous(), top_p.to(dev, torch.float32).contiguous(),
        fanout.to(dev, torch.int32).contiguous(), float(c), seeds.to(dev, torch.long).contiguous())
