"""Grouped-query self-attention over the paged KV cache, driven by one AttentionMetadata.

With `use_qk_norm` (Qwen3) each query and key head is RMS-normed after the projection and
before rotary. The norm is the first thing `attend` and `store_kv_only` do to the projection's
output, in place on the triton backend, so every path that rotates keys afterwards (the
reference rotary, the fused rotary launch, the drafter's context keys) sees normed heads
without a variant of its own; a triton decode step's paged-attention launch norms q and the new
key itself as it loads them, before its in-kernel rotation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dspark.attention_metadata import AttentionMetadata
from dspark.distributed.parallel_state import TensorParallel
from dspark.kernels.paged_attention_ref import paged_attention_ref, store_kv_ref
from dspark.layers.linear import Linear
from dspark.layers.norm import RMSNorm
from dspark.layers.parallel_linear import RowParallelLinear
from dspark.layers.rotary import RotaryEmbedding
from dspark.models.model_config import ModelConfig


def attention_ops(backend: str):
    """(store_kv, paged_attention) for a backend: "torch" (reference) or "triton"."""
    if backend == "torch":
        return store_kv_ref, paged_attention_ref
    if backend == "triton":  # imported only when asked for: the CPU path needs no triton
        from dspark.kernels.paged_attention_triton import paged_attention_triton
        from dspark.kernels.store_kv_triton import store_kv_triton

        return store_kv_triton, paged_attention_triton
    raise ValueError(f"unknown attention backend {backend!r}; expected 'torch' or 'triton'")


class Attention(nn.Module):
    """With tensor parallelism `config` is the rank's shard's (its heads only): qkv is
    column-parallel, o row-parallel with its all-reduce (layers/parallel_linear.py)."""

    def __init__(
        self,
        config: ModelConfig,
        rotary: RotaryEmbedding,
        backend: str = "torch",
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        self._store_kv, self._attend = attention_ops(backend)
        self.use_triton = backend == "triton"
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size,
                               config.attention_bias, self.use_triton)  # fmt: skip
        if tp is None:
            self.o_proj = Linear(self.q_size, config.hidden_size, False, self.use_triton)
        else:
            self.o_proj = RowParallelLinear(self.q_size, config.hidden_size, self.use_triton, tp)
        self.rotary = rotary
        self.scale = self.head_dim**-0.5
        self.q_norm = self.k_norm = None
        if config.use_qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def norm_heads(
        self,
        q: torch.Tensor,  # [T, nh, hd] (nh may be 0: keys only)
        k: torch.Tensor,  # [T, nkv, hd]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q/k norm where the architecture has it: in place (views of the projection) on the
        triton backend, out of place on the reference one; unchanged without it."""
        if self.q_norm is None:
            return q, k
        if self.use_triton:
            from dspark.kernels.qk_norm_triton import qk_norm

            qk_norm(q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
            return q, k
        return self.q_norm(q) if q.shape[1] else q, self.k_norm(k)

    def store_kv_only(
        self,
        x: torch.Tensor,  # [T, d]
        positions: torch.Tensor,  # [T]
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [T]
    ) -> None:
        """Keys/values of x (rotated at `positions`) into the cache, no attention: the DSpark
        drafter's context tokens, which are never queries."""
        T = x.shape[0]
        w = self.qkv_proj.weight[self.q_size :]
        b = None if self.qkv_proj.bias is None else self.qkv_proj.bias[self.q_size :]
        kv = F.linear(x, w, b)  # [T, 2 kv_size]
        if self.use_triton:  # rotates k in place and stores k, v: one launch
            from dspark.kernels.rotary_triton import rotary_kv

            k = kv[:, : self.kv_size].view(T, self.num_kv_heads, self.head_dim)
            self.norm_heads(k[:, :0], k)

            rotary_kv(kv, positions, self.rotary.inv_freq, self.num_kv_heads, self.head_dim,
                      kv_cache, slot_mapping)  # fmt: skip
            return
        k, v = kv.split([self.kv_size, self.kv_size], dim=-1)
        k = k.reshape(T, self.num_kv_heads, self.head_dim)
        v = v.reshape(T, self.num_kv_heads, self.head_dim)
        _, k = self.norm_heads(k[:, :0], k)
        _, k = self.rotary(positions, k, k)
        self._store_kv(k.contiguous(), v.contiguous(), kv_cache, slot_mapping)

    def forward(
        self,
        x: torch.Tensor,  # [T, d]
        positions: torch.Tensor,  # [T]
        kv_cache: torch.Tensor,  # [2, num_pages, page_size, nkv, hd]
        attn: AttentionMetadata,
    ) -> torch.Tensor:  # [T, d]
        return self.o_proj(self.attend(self.qkv_proj(x), positions, kv_cache, attn))

    def attend(
        self,
        qkv: torch.Tensor,  # [T, q_size + 2 * kv_size], qkv_proj's output (triton rotates it)
        positions: torch.Tensor,  # [T]
        kv_cache: torch.Tensor,  # [2, num_pages, page_size, nkv, hd]
        attn: AttentionMetadata,
    ) -> torch.Tensor:  # [T, q_size], before o_proj
        """Rotary, the K/V store and attention, between the two projections."""
        T = qkv.shape[0]
        if self.use_triton and _is_decode(attn):  # q/k norm, rotary, K/V store in attention
            return self._attend_decode(qkv, positions, kv_cache, attn)
        if self.q_norm is not None and self.use_triton:  # in place, before any rotation
            q, k, _ = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            self.norm_heads(q.view(T, self.num_heads, self.head_dim),
                             k.view(T, self.num_kv_heads, self.head_dim))  # fmt: skip
        if self.use_triton:  # rotates q and k in place and stores k, v: one launch
            from dspark.kernels.rotary_triton import rotary_qkv

            rotary_qkv(qkv, positions, self.rotary.inv_freq, self.num_heads, self.num_kv_heads,
                       self.head_dim, kv_cache, attn.slot_mapping)  # fmt: skip
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if not self.use_triton:
            q, k = self.norm_heads(q, k)
            q, k = self.rotary(positions, q, k)
            self._store_kv(k, v, kv_cache, attn.slot_mapping)
        o = self._attend(q, kv_cache, attn, self.scale)  # [T, nh, hd]
        return o.reshape(T, self.q_size)

    def _attend_decode(
        self,
        qkv: torch.Tensor,  # [T, q_size + 2 * kv_size], unrotated
        positions: torch.Tensor,  # [T]
        kv_cache: torch.Tensor,
        attn: AttentionMetadata,
    ) -> torch.Tensor:  # [T, q_size]
        """A decode step's attention in one launch: the kernel norms (Qwen3) and rotates q and
        the new key as it loads them and stores k, v (kernels/paged_attention_triton.py)."""
        from dspark.kernels.paged_attention_triton import NewKV, paged_attention_triton

        T = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        norms = {}
        if self.q_norm is not None:
            norms = dict(q_norm=self.q_norm.weight, k_norm=self.k_norm.weight,
                         norm_eps=self.q_norm.eps)  # fmt: skip
        new_kv = NewKV(k.view(T, self.num_kv_heads, self.head_dim),
                       v.view(T, self.num_kv_heads, self.head_dim), positions,
                       self.rotary.inv_freq, attn.slot_mapping, **norms)  # fmt: skip
        o = paged_attention_triton(
            q.view(T, self.num_heads, self.head_dim), kv_cache, attn, self.scale, new_kv=new_kv
        )  # [T, nh, hd]
        return o.reshape(T, self.q_size)


def _is_decode(attn: AttentionMetadata) -> bool:
    from dspark.kernels.paged_attention_triton import is_decode

    return is_decode(attn)
