"""The draft device's hot per-round ops, each a torch reference beside a Triton kernel
(and, built where a CUDA toolkit is, a CUDA op from csrc/):

- `saguaro_sample`: draft logits -> the sampled token and the exact q sent to the verifier;
- `fork_candidates`: the top-F bonus candidates per position, the drafted token excluded;
- `cache_lookup`: verified outcomes (row, k, t*) -> cached branch index or -1.

`backend.backend(device)` picks the implementation; all of them agree exactly on tokens
and indices, and on q to float tolerance (tests/ops/).
"""
from __future__ import annotations

import torch

from vllm_saguaro.ops import cuda
from vllm_saguaro.ops.backend import backend
from vllm_saguaro.ops.cache_lookup import cache_lookup_reference, cache_lookup_triton
from vllm_saguaro.ops.fork import fork_candidates_reference, fork_candidates_triton
from vllm_saguaro.ops.saguaro_sampling import (saguaro_sample_reference,
                                               saguaro_sample_triton)


def saguaro_sample(logits, temperature, top_k, top_p, fanout, c: float, seeds):
    fn = {"torch": saguaro_sample_reference, "triton": saguaro_sample_triton,
          "cuda": cuda.saguaro_sample_cuda}[backend(logits.device)]
    return fn(logits, temperature, top_k, top_p, fanout, c, seeds)


def fork_candidates(logits, drafted, fanout, width: int):
    fn = {"torch": fork_candidates_reference, "triton": fork_candidates_triton,
          "cuda": fork_candidates_triton}[backend(logits.device)]
    return fn(logits, drafted, fanout, width)


def cache_lookup(keys: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    fn = {"torch": cache_lookup_reference, "triton": cache_lookup_triton,
          "cuda": cuda.cache_lookup_cuda}[backend(queries.device)]
    return fn(keys, queries)


__all__ = ["saguaro_sample", "fork_candidates", "cache_lookup", "backend"]
