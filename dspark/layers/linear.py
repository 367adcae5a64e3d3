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


class Linear(nn.Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool, use_triton: bool) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.use_gemv = use_triton and os.environ.get("DSPARK_GEMV", "1") != "0"

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        if self.use_gemv and x.is_cuda and x.dim() == 2:
            from dspark.kernels.gemv_triton import GEMV_FASTER_UP_TO, gemv

            if 0 < x.shape[0] <= GEMV_FASTER_UP_TO and x.stride(1) == 1:
                return gemv(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)
