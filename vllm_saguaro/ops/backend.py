"""Which implementation of the ops runs where.

torch (the references) on CPU; on CUDA the csrc/ ops where they were built (ops/cuda.py),
else Triton. `SAGUARO_OPS_BACKEND=torch|triton|cuda` overrides it (tests, and a GPU without
a working Triton). The fork has no CUDA op: it runs in Triton under "cuda". Kernels are built on first use:
importing Triton costs a second and is not needed on CPU. Under `TRITON_INTERPRET=1` they
run on CPU tensors (tests/ops/kernel_checks.py), which only works if the variable is set
before Triton is first imported, hence the tests run them in a process of their own.
"""
from __future__ import annotations

import functools
import os

import torch

BACKENDS = ("torch", "triton", "cuda")


def backend(device: torch.device | str) -> str:
    forced = os.environ.get("SAGUARO_OPS_BACKEND", "")
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"SAGUARO_OPS_BACKEND={forced!r}: use one of {BACKENDS}")
        return forced
    if torch.device(device).type != "cuda":
        return "torch"
    from vllm_saguaro.ops import cuda

    return "cuda" if cuda.available() else "triton"


@functools.cache
def kernels():
    """The Triton kernels module, imported on first use."""
    from vllm_saguaro.ops import triton_kernels
    return triton_kernels


def next_power_of_2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()
