"""RMSNorm, computed in float32 and cast back, as the HF Llama reference does.

`forward(x, residual)` also performs the residual add first (new_residual = x + residual) and
returns both, so the triton backend can do add + norm in one kernel.
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, use_triton: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.use_triton = use_triton

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        residual_out: torch.Tensor | None = None,  # [T, d]: where the new residual goes
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # [T, d] (and the new residual)
        if self.use_triton:
            from dspark.kernels.rmsnorm_triton import fused_add_rmsnorm, rmsnorm

            if residual is None:
                return rmsnorm(x, self.weight, self.eps)
            return fused_add_rmsnorm(x, residual, self.weight, self.eps,
                                     residual_out=residual_out)  # fmt: skip
        if residual is None:
            return self._norm(x)
        x = torch.add(x, residual, out=residual_out)
        return self._norm(x), x

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)
