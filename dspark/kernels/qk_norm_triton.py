"""Per-head RMSNorm of the query and key heads (Qwen3's q_norm and k_norm) in place, one launch.

The fast twin of two `RMSNorm(head_dim)` calls on the q and k views of the fused qkv
projection. It runs before whatever rotates those heads (the fused rotary launch, or the paged
attention kernel's in-kernel rotation on decode steps), so every rotated key in the cache is a
normed one, whichever path stored it.

Rounding follows dspark/layers/norm.py: each head is reduced in float32, normalised, rounded to
the tensor's dtype, multiplied by the weight and rounded again. One program normalises every
q and k head of one token.

Under TRITON_INTERPRET=1 (CPU tensors) it runs in Triton's interpreter; set the variable before
this module is imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dspark.kernels.rmsnorm_triton import rmsnorm_ref, weighted_normed


def qk_norm_ref(
    q: torch.Tensor,  # [T, nh, hd]
    k: torch.Tensor,  # [T, nkv, hd]
    q_weight: torch.Tensor,  # [hd]
    k_weight: torch.Tensor,  # [hd]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # new normed q [T, nh, hd], k [T, nkv, hd]
    return rmsnorm_ref(q, q_weight, eps), rmsnorm_ref(k, k_weight, eps)


@triton.jit
def _norm_heads(ptr, s_h, w_ptr, eps, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                BLOCK_H: tl.constexpr):  # fmt: skip
    # ptr: one token's first head; heads s_h apart, HEAD_DIM (a power of two) contiguous each
    h = tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
    j = tl.arange(0, HEAD_DIM)[None, :]  # [1, HEAD_DIM]
    mask = h < NUM_HEADS
    x = tl.load(ptr + h * s_h + j, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_H, HEAD_DIM]
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)[:, None]  # [BLOCK_H, 1]
    w = tl.load(w_ptr + j).to(tl.float32)  # [1, HEAD_DIM]
    y = weighted_normed(x, rstd, w, ptr.dtype.element_ty)
    tl.store(ptr + h * s_h + j, y.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _qk_norm_kernel(
    q_ptr, k_ptr, qw_ptr, kw_ptr, s_qt, s_qh, s_kt, s_kh, eps,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr,
):  # fmt: skip
    tok = tl.program_id(0).to(tl.int64)
    if NUM_HEADS > 0:
        _norm_heads(q_ptr + tok * s_qt, s_qh, qw_ptr, eps, NUM_HEADS, HEAD_DIM, BLOCK_H)
    _norm_heads(k_ptr + tok * s_kt, s_kh, kw_ptr, eps, NUM_KV_HEADS, HEAD_DIM, BLOCK_KV)


def qk_norm(
    q: torch.Tensor,  # [T, nh, hd], any token/head strides, last dim contiguous (nh may be 0)
    k: torch.Tensor,  # [T, nkv, hd], same
    q_weight: torch.Tensor,  # [hd]
    k_weight: torch.Tensor,  # [hd]
    eps: float,
) -> None:
    """Normalise q's and k's heads IN PLACE (views of a fused qkv output are fine). Same values
    as `qk_norm_ref`."""
    T, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert k.shape == (T, num_kv_heads, head_dim), (q.shape, k.shape)
    assert q_weight.shape == k_weight.shape == (head_dim,), (q_weight.shape, k_weight.shape)
    assert head_dim == triton.next_power_of_2(head_dim), f"head_dim {head_dim} not a power of 2"
    assert q.stride(2) == 1 and k.stride(2) == 1 and q.dtype == k.dtype
    if T == 0:
        return
    _qk_norm_kernel[(T,)](
        q, k, q_weight, k_weight, q.stride(0), q.stride(1), k.stride(0), k.stride(1), eps,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(max(num_heads, 1)),
        BLOCK_KV=triton.next_power_of_2(num_kv_heads), num_warps=4,
    )  # fmt: skip
