"""The draft's linear layers: in the draft's dtype, or float16 weights on CPU (fbgemm).

At batch 1 a draft forward on a CPU core is bound by reading its weights: the reference
draft (7 layers and a 16k-token head, 34M parameters) reads 136 MB per forward in
float32, ~8.5 of its ~14 ms. Its pre-speculation (glue pass + K tree steps) must fit in
one verification of the target to be hidden, so the draft's forward time decides whether
SSD can hide the draft at all. fbgemm's fp16 GEMM keeps the weights in float16 (half the
bytes) and computes in float32 with float32 activations: the matmuls run 3.4-3.7x faster
at 1-4 rows, 1.7x at 16 rows on an AVX2 core (no AVX-512 bf16 here, so bfloat16 matmuls
are slower than float32). Only the weights are rounded, to float16, so the draft barely
changes (agreement is measured: benchmarks/reference_pair/agreement.py --quantization
fp16), and verification stays lossless because the verifier gets the q the draft sampled
from. int8 weights with fbgemm's dynamic (per-tensor) activation quantization were 3.5x
faster too, but wrecked the draft (agreement 0.51 -> 0.00 on MT-Bench): the activations'
outliers (the first token's, the MLP's) leave nothing for the other values.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

QUANTIZATIONS = ("none", "fp16")


def fp16_supported() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


class Linear:
    """y = x W^T + b for x [..., in], W [out, in]: as given, or float16 weights (CPU)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 quantization: str = "none"):
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"unknown quantization {quantization!r}; use one of {QUANTIZATIONS}")
        self.quantization = quantization
        self.out_features = weight.shape[0]
        if quantization == "fp16":
            if weight.device.type != "cpu" or not fp16_supported():
                raise ValueError("fp16 draft weights need a CPU with fbgemm (x86)")
            with warnings.catch_warnings():  # torch's quantized ops warn they are deprecated
                warnings.simplefilter("ignore")
                self._packed = torch.ops.quantized.linear_prepack_fp16(
                    weight.float(), None if bias is None else bias.float())
            self.weight, self.bias = None, None
        else:
            self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantization == "fp16":
            return torch.ops.quantized.linear_dynamic_fp16(x.float(), self._packed)
        return F.linear(x, self.weight, self.bias)


def fused(weights: list[torch.Tensor], biases: list[torch.Tensor | None],
          quantization: str) -> Linear:
    """One matmul for several projections of the same input (q/k/v, gate/up): fewer, larger
    calls; split the output along its last dim. Missing biases are zeros when any is given."""
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([b if b is not None else weights[i].new_zeros(weights[i].shape[0])
                          for i, b in enumerate(biases)])
    return Linear(torch.cat(weights, dim=0), bias, quantization)
