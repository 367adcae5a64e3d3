"""nn.Linear whose few-row calls run the GEMV kernel (triton backend on a GPU).

A small model's projections at a small decode batch are latency-bound cuBLAS launches;
kernels/gemv_triton.py does them in fewer microseconds and, launched with PDL, overlaps its
weight fetch with the kernel before it. A large weight is bandwidth-bound, and there cuBLAS
reads faster: the GEMV is taken only for weights up to GEMV_MAX_WEIGHT_ELEMENTS. The row count
is known on the host from x's shape (and fixed inside a CUDA graph), so each call takes one
path; parameters and state-dict names are nn.Linear's.

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
# (8-token windows) 1,790 against 1,292 (H200). The kernel shares each W tile over 2-8 rows in
# registers, and kernel by kernel (graph-replayed, H100, bench/results/kernels_gemv_h100/) 2
# rows beat cuBLAS at all four of SmolLM2's projections and 4 rows at three; a step at batch 2
# or 4 is still to time, so the default stays 1.
GEMV_ROWS = 1
GEMV_MAX_ROWS = 8  # gemv_triton.GEMV_MAX_ROWS (not imported: the CPU path needs no triton)
# The largest weight (elements, of this rank's shard) that takes the GEMV. On an H100, one row,
# graph-replayed over weights L2 does not hold (bench/results/kernels_gemv_h100/): at SmolLM2's
# projections (0.7-3.5 MB in bf16) the GEMV took 2.1-2.8 us against cuBLAS's 3.5-5.1; at
# Qwen3-8B's (34-201 MB) it lost every one, qkv 23.3 against 20.1 us, o 18.1 / 16.1, gate_up
# 81.5 / 68.5, down 52.3 / 37.9 (cuBLAS reading 2.1-2.9 TB/s): 1.2 ms of a 36-layer step. The
# bound, 4M elements (8 MiB in bf16), lies between the two; no size between was measured.
GEMV_MAX_WEIGHT_ELEMENTS = 4 << 20


def gemv_rows() -> int:
    """The rows up to which the GEMV is taken: GEMV_ROWS; 0 under DSPARK_REFERENCE_OPS."""
    return 0 if envs.ENVS.reference_ops else GEMV_ROWS


class Linear(nn.Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool, use_triton: bool) -> None:
        super().__init__(in_features, out_features, bias=bias)
        small = in_features * out_features <= GEMV_MAX_WEIGHT_ELEMENTS
        self.gemv_rows = gemv_rows() if use_triton and small else 0

    def takes_gemv(self, x: torch.Tensor) -> bool:
        return x.is_cuda and 0 < x.shape[0] <= self.gemv_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        if self.takes_gemv(x) and x.dim() == 2 and x.stride(1) == self.weight.stride(1) == 1:
            from dspark.kernels.gemv_triton import gemv

            return gemv(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)
