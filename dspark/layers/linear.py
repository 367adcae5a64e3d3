"""nn.Linear whose few-row calls run the GEMV kernel (triton backend on a GPU).

A decoder layer's projections at a small decode batch are latency-bound cuBLAS launches;
kernels/gemv_triton.py does them in fewer microseconds and, launched with PDL, overlaps its
weight fetch with the kernel before it. The row count is known on the host from x's shape (and
fixed inside a CUDA graph), so each call takes one path; parameters and state-dict names are
nn.Linear's. DSPARK_GEMV=0 turns the GEMV off (for A/B runs).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

# Rows up to which the projections take the GEMV. At one row it beats cuBLAS; at T = 8 its
# first version (a [T, BLOCK_N, BLOCK_K] product tile) took 9-31 us a call where cuBLAS took
# 4-7 (bench/pdl_chain.py, H200, docs/PERFORMANCE.md fifteenth look); the version that takes
# one row at a time is not yet measured there. At most gemv_triton.GEMV_MAX_ROWS.
GEMV_FASTER_UP_TO = 1


class Linear(nn.Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool, use_triton: bool) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.use_gemv = use_triton and os.environ.get("DSPARK_GEMV", "1") != "0"

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        if self.use_gemv and x.is_cuda and x.dim() == 2:
            from dspark.kernels.gemv_triton import gemv

            if 0 < x.shape[0] <= GEMV_FASTER_UP_TO and x.stride(1) == 1:
                return gemv(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)
