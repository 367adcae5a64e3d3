"""The drafter's context upkeep in two launches: one GEMM and kernels/context_kv_triton.py.

Every step appends each target token's tap features to the drafter's cache, drafting or not.
Written plainly (DSparkDrafter.append_context with the torch backend) that is fc, the context
norm, and per drafter layer a k/v projection and the rotary store: seven launches for the
shipped two-layer drafter, a few microseconds each at a decode batch, in every step of a
speculative engine including its plain ones.

RMSNorm scales each row by one number, so the norm's weight and each layer's k/v projection
fold into fc (context_kv_triton.py's docstring has the algebra). The folded matrix stacks

    [ Wfc ; Wkv_0 diag(w) Wfc ; Wkv_1 diag(w) Wfc ; ... ]      [D + L 2 KV, m D]

so one projection (the GEMV at a few rows, layers/linear.py) gives fc's output, which only
the norm statistic still needs, next to every layer's unscaled k and v; the kernel scales,
adds the biases, rotates and stores. The products are taken in float32 once, when the drafter
is loaded, and rounded to the model's dtype: the drafter's weights are frozen from then on.

It is a plain object, not a submodule, so the drafter's state dict (its checkpoint) is
unchanged. DSPARK_REFERENCE_OPS keeps the seven launches.
"""

from __future__ import annotations

import torch
from torch import nn

from dspark import envs
from dspark.layers.linear import Linear


def folded_context_enabled() -> bool:
    return not envs.ENVS.reference_ops


class FoldedContext:
    def __init__(
        self,
        fc: nn.Linear,  # m D -> D
        norm_weight: torch.Tensor,  # [D], the context norm's
        eps: float,
        kv_projections: list[tuple[torch.Tensor, torch.Tensor | None]],  # per layer [2 KV, D]
        inv_freq: torch.Tensor,  # [hd/2] float32
    ) -> None:
        d = fc.out_features
        wfc = fc.weight.detach().float()  # [D, m D]
        scaled = norm_weight.detach().float()[None, :]  # [1, D]
        rows = [wfc] + [(w.detach().float() * scaled) @ wfc for w, _ in kv_projections]
        weight = torch.cat(rows)  # [D + L 2 KV, m D]
        self.proj = Linear(fc.in_features, weight.shape[0], False, use_triton=True)
        self.proj.to(device=wfc.device, dtype=fc.weight.dtype)
        self.proj.weight.data.copy_(weight)
        self.proj.requires_grad_(False)
        biases = [b for _, b in kv_projections]
        self.bias = None if biases[0] is None else torch.cat(biases).detach()  # [L 2 KV]
        self.hidden_size, self.eps, self.inv_freq = d, eps, inv_freq

    def __call__(
        self,
        features: torch.Tensor,  # [T, m D]
        positions: torch.Tensor,  # [T]
        slot_mapping: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],  # the drafter's, one per layer
    ) -> None:
        from dspark.kernels.context_kv_triton import context_kv_store

        context_kv_store(self.proj(features), self.bias, self.hidden_size, self.eps, positions,
                         self.inv_freq, kv_caches, slot_mapping)  # fmt: skip
