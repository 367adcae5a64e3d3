"""nn.Linear whose few-row calls run the GEMV kernel (triton backend on a GPU).

A decoder layer's projections at a small decode batch are latency-bound cuBLAS launches;
kernels/gemv_triton.py does them in fewer microseconds and, launched with PDL, overlaps its
weight fetch with the kernel before it. The row count is known on the host from x's shape (and
fixed inside a CUDA graph), so each call takes one path; parameters and state-dict names are
nn.Linear's.

DSPARK_REFERENCE_OPS turns the GEMV off (F.linear everywhere).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dspark import envs

# Rows up to which the projections take the GEMV. At one row it beats cuBLAS (a random-weight
# SmolLM2 step at batch 1: 670 us against 867). Up to 8 rows its version that loaded W again for
# every row lost: a step at batch 8 took 1,474 us against 1,001, and the speculative step at G = 1
# (8-token windows) 1,790 against 1,292 (H200). Since, 2-8 rows share each W tile in registers; not
# yet measured, so the default stays 1.
GEMV_ROWS = 1
GEMV_MAX_ROWS = 8  # gemv_triton.GEMV_MAX_ROWS (not imported: the CPU path needs no triton)


def gemv_rows() -> int:
    """The rows up to which the GEMV is taken: GEMV_ROWS; 0 under DSPARK_REFERENCE_OPS."""
    return 0 if envs.ENVS.reference_ops else GEMV_ROWS


class Linear(nn.Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool, use_triton: bool) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.gemv_rows = gemv_rows() if use_triton else 0

    def takes_gemv(self, x: torch.Tensor) -> bool:
        return x.is_cuda and 0 < x.shape[0] <= self.gemv_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        if self.takes_gemv(x) and x.dim() == 2 and x.stride(1) == self.weight.stride(1) == 1:
            from dspark.kernels.gemv_triton import gemv

            return gemv(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)
