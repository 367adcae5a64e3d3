"""Rotary position embedding (HF "rotate half" layout) in place, in one Triton launch for q and k.

The fast twin of dspark/layers/rotary.py's RotaryEmbedding.forward, which is about a dozen eager
kernels (outer product, cat, cos, sin, casts, two rotate_half, four multiplies, two adds).

Rounding follows the eager code step by step: angles positions * inv_freq and their cos/sin in
float32, cos/sin rounded to q's dtype, then q * cos and rotate_half(q) * sin each rounded to q's
dtype before they are added. With x1, x2 the first and second halves of a head (hd/2 each):

    out1 = x1 * cos - x2 * sin        out2 = x2 * cos + x1 * sin

One program rotates every q and k head of one token.

Under TRITON_INTERPRET=1 (CPU tensors) it runs in Triton's interpreter; set the variable before
this module is imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dspark.kernels.rmsnorm_triton import weighted_normed


def _rotate_half(x: torch.Tensor) -> torch.Tensor:  # [..., hd] -> [..., hd]
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary_ref(
    q: torch.Tensor,  # [T, nh, hd]
    k: torch.Tensor,  # [T, nkv, hd]
    positions: torch.Tensor,  # [T] int
    inv_freq: torch.Tensor,  # [hd/2] float32
) -> tuple[torch.Tensor, torch.Tensor]:  # new rotated q [T, nh, hd], k [T, nkv, hd]
    """RotaryEmbedding.forward's arithmetic, out of place."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, hd/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, hd]
    cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


@triton.jit
def _rounded(x, DTYPE: tl.constexpr):
    # Round a float32 intermediate to the tensor's dtype, as each eager op does.
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def _rotate(x1, x2, cos, sin, DTYPE: tl.constexpr):
    # The eager rounding: out1 = x1 cos - x2 sin, out2 = x2 cos + x1 sin, each product rounded
    # to DTYPE before the add (fp32 inputs; DTYPE outputs).
    out1 = (_rounded(x1 * cos, DTYPE) - _rounded(x2 * sin, DTYPE)).to(DTYPE)
    out2 = (_rounded(x2 * cos, DTYPE) + _rounded(x1 * sin, DTYPE)).to(DTYPE)
    return out1, out2


@triton.jit
def rotated_rows(ptr, row_off, valid, positions, inv_freq_ptr, norm_w_ptr, eps,
                 HALF: tl.constexpr, HEAD_DIM: tl.constexpr, NORM: tl.constexpr):  # fmt: skip
    """Heads at ptr + row_off[r] ([R] offsets, HEAD_DIM contiguous values each) rotated at
    positions[r], rounded as _rotary_kernel rounds them: [R, HEAD_DIM] in ptr's dtype, held in
    registers (nothing is written back). For kernels that rotate what they load (attention).

    With NORM each head is first RMS-normed with the weight at norm_w_ptr ([HEAD_DIM]; Qwen3's
    q_norm or k_norm), rounded as qk_norm_triton rounds it: what that kernel would have stored
    and this one loaded. (Its sum of squares adds the two halves' sums: the same value up to
    float32 rounding, not bit for bit.)"""
    dtype = ptr.dtype.element_ty
    j = tl.arange(0, HALF)
    freqs = positions.to(tl.float32)[:, None] * tl.load(inv_freq_ptr + j)[None, :]  # [R, HALF]
    cos = _rounded(tl.cos(freqs), dtype)
    sin = _rounded(tl.sin(freqs), dtype)
    first = ptr + row_off[:, None] + j[None, :]  # [R, HALF], dims 0 .. hd/2 of each head
    x1 = tl.load(first, mask=valid[:, None], other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=valid[:, None], other=0.0).to(tl.float32)
    if NORM:
        squares = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)  # [R]
        rstd = tl.rsqrt(squares / HEAD_DIM + eps)[:, None]
        w1 = tl.load(norm_w_ptr + j).to(tl.float32)[None, :]
        w2 = tl.load(norm_w_ptr + HALF + j).to(tl.float32)[None, :]
        x1 = _rounded(weighted_normed(x1, rstd, w1, dtype), dtype)
        x2 = _rounded(weighted_normed(x2, rstd, w2, dtype), dtype)
    out1, out2 = _rotate(x1, x2, cos, sin, dtype)
    # [R, HALF] x 2 -> [R, HALF, 2] -> [R, 2, HALF] -> [R, HEAD_DIM]: out1's dims, then out2's
    return tl.reshape(tl.permute(tl.join(out1, out2), (0, 2, 1)), (out1.shape[0], HEAD_DIM))


@triton.jit
def _rotate_heads(
    ptr, s_h, cos, sin,
    NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    # ptr: one token's first head; cos, sin: [1, BLOCK_HALF] float32 of values in ptr's dtype.
    # Returns both rotated halves (in ptr's dtype) so the caller can also write them elsewhere.
    dtype = ptr.dtype.element_ty
    h = tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
    j = tl.arange(0, BLOCK_HALF)[None, :]  # [1, BLOCK_HALF]
    mask = (h < NUM_HEADS) & (j < HALF)
    first = ptr + h * s_h + j  # [BLOCK_H, BLOCK_HALF], dims 0 .. hd/2 of each head
    x1 = tl.load(first, mask=mask).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask).to(tl.float32)
    out1, out2 = _rotate(x1, x2, cos, sin, dtype)
    tl.store(first, out1, mask=mask)
    tl.store(first + HALF, out2, mask=mask)
    return out1, out2


@triton.jit
def _store_kv_token(
    k1, k2, v_ptr, s_vh, k_cache_ptr, v_cache_ptr, slot,
    NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_KV: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    # Cache rows are [slot, kv_head, head_dim] contiguous: element (h, d) of a slot sits at
    # (slot * NUM_KV_HEADS + h) * 2 * HALF + d. k arrives rotated (k1, k2 halves); v is copied.
    h = tl.arange(0, BLOCK_KV)[:, None]
    j = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < NUM_KV_HEADS) & (j < HALF)
    row = (slot * NUM_KV_HEADS + h) * (2 * HALF) + j  # [BLOCK_KV, BLOCK_HALF]
    tl.store(k_cache_ptr + row, k1, mask=mask)
    tl.store(k_cache_ptr + row + HALF, k2, mask=mask)
    v = v_ptr + h * s_vh + j
    tl.store(v_cache_ptr + row, tl.load(v, mask=mask), mask=mask)
    tl.store(v_cache_ptr + row + HALF, tl.load(v + HALF, mask=mask), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, v_ptr, positions_ptr, inv_freq_ptr, slot_ptr, k_cache_ptr, v_cache_ptr,
    s_qt, s_qh, s_kt, s_kh, s_vt, s_vh,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr, BLOCK_HALF: tl.constexpr,
    STORE_KV: tl.constexpr,
):  # fmt: skip
    tok = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)
    pos = tl.load(positions_ptr + tok).to(tl.float32)
    freqs = pos * tl.load(inv_freq_ptr + j, mask=j < HALF, other=0.0)  # [BLOCK_HALF] float32
    dtype = q_ptr.dtype.element_ty
    cos = _rounded(tl.cos(freqs), dtype)[None, :]  # [1, BLOCK_HALF]
    sin = _rounded(tl.sin(freqs), dtype)[None, :]
    _rotate_heads(q_ptr + tok * s_qt, s_qh, cos, sin, NUM_HEADS, HALF, BLOCK_H, BLOCK_HALF)
    k1, k2 = _rotate_heads(
        k_ptr + tok * s_kt, s_kh, cos, sin, NUM_KV_HEADS, HALF, BLOCK_KV, BLOCK_HALF
    )
    if STORE_KV:
        slot = tl.load(slot_ptr + tok).to(tl.int64)
        _store_kv_token(k1, k2, v_ptr + tok * s_vt, s_vh, k_cache_ptr, v_cache_ptr, slot,
                        NUM_KV_HEADS, HALF, BLOCK_KV, BLOCK_HALF)  # fmt: skip


def apply_rotary(
    q: torch.Tensor,  # [T, nh, hd], any token/head strides, last dim contiguous
    k: torch.Tensor,  # [T, nkv, hd], same
    positions: torch.Tensor,  # [T] int32 or int64
    inv_freq: torch.Tensor,  # [hd/2] float32
    v: torch.Tensor | None = None,  # [T, nkv, hd]: with the next two, also store K/V
    kv_cache: torch.Tensor | None = None,  # [2, num_pages, page_size, nkv, hd] contiguous
    slot_mapping: torch.Tensor | None = None,  # [T] int64
) -> None:
    """Rotate q and k IN PLACE (views of a fused qkv output are fine: their storage is
    rewritten). Same values as `apply_rotary_ref(q, k, positions, inv_freq)`. Given v, kv_cache
    and slot_mapping it also writes the rotated k and v to the cache, as `store_kv_ref` would
    (one launch instead of two)."""
    T, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert k.shape == (T, num_kv_heads, head_dim) and positions.shape == (T,), (k.shape, q.shape)
    assert head_dim % 2 == 0 and inv_freq.shape == (head_dim // 2,), (head_dim, inv_freq.shape)
    assert q.dtype == k.dtype and inv_freq.dtype == torch.float32, (q.dtype, k.dtype)
    assert q.stride(2) == 1 and k.stride(2) == 1 and inv_freq.is_contiguous()
    store = kv_cache is not None
    if store:
        assert v is not None and slot_mapping is not None and v.shape == k.shape
        assert kv_cache.is_contiguous() and kv_cache.dtype == k.dtype and v.stride(2) == 1
        assert kv_cache.shape[3:] == (num_kv_heads, head_dim), kv_cache.shape
    if T == 0:
        return
    half = head_dim // 2
    v_arg = v if store else k  # unused without STORE_KV, but the kernel needs a pointer
    # One warp per token was the fastest on an H200 (1.7 us at T=1, 2.9 us at T=2048, graphed).
    # No fp fusion: NVPTX would otherwise contract a rounded product and the add after it into
    # one bf16 fma, skipping a rounding the eager code does (a fifth of bf16 outputs then differ
    # by an ulp from the reference on an H200).
    _rotary_kernel[(T,)](
        q, k, v_arg, positions, inv_freq,
        slot_mapping if store else positions,
        kv_cache[0] if store else k, kv_cache[1] if store else k,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v_arg.stride(0), v_arg.stride(1),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=half,
        BLOCK_H=triton.next_power_of_2(max(num_heads, 1)),
        BLOCK_KV=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(half), STORE_KV=store, num_warps=1,
        enable_fp_fusion=False,
    )  # fmt: skip


def rotary_qkv(
    qkv: torch.Tensor,  # [T, nh hd + 2 nkv hd], the fused projection output (rows may be strided)
    positions: torch.Tensor,  # [T] int32 or int64
    inv_freq: torch.Tensor,  # [hd/2] float32
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    kv_cache: torch.Tensor | None = None,  # given: also store the rotated k and v
    slot_mapping: torch.Tensor | None = None,
) -> None:
    """Rotate the q and k parts of a fused qkv tensor IN PLACE; v is left untouched (and, with
    kv_cache and slot_mapping, k and v are written to the cache in the same launch)."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    assert qkv.dim() == 2 and qkv.shape[1] == q_size + 2 * kv_size, (qkv.shape, q_size, kv_size)
    q = qkv[:, :q_size].unflatten(1, (num_heads, head_dim))  # [T, nh, hd] view
    k = qkv[:, q_size : q_size + kv_size].unflatten(1, (num_kv_heads, head_dim))  # [T, nkv, hd]
    v = qkv[:, q_size + kv_size :].unflatten(1, (num_kv_heads, head_dim))  # [T, nkv, hd]
    apply_rotary(q, k, positions, inv_freq, v, kv_cache, slot_mapping)


def rotary_kv(
    kv: torch.Tensor,  # [T, 2 nkv hd], a k/v projection's output (rows may be strided)
    positions: torch.Tensor,  # [T] int32 or int64
    inv_freq: torch.Tensor,  # [hd/2] float32
    num_kv_heads: int,
    head_dim: int,
    kv_cache: torch.Tensor,  # [2, num_pages, page_size, nkv, hd] contiguous
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    """Rotate k IN PLACE and write k and v to the cache, one launch: keys and values of tokens
    that are never queries (the DSpark drafter's context). rotary_qkv with no query heads."""
    kv_size = num_kv_heads * head_dim
    assert kv.dim() == 2 and kv.shape[1] == 2 * kv_size, (kv.shape, kv_size)
    k = kv[:, :kv_size].unflatten(1, (num_kv_heads, head_dim))  # [T, nkv, hd] view
    v = kv[:, kv_size:].unflatten(1, (num_kv_heads, head_dim))
    apply_rotary(k[:, :0], k, positions, inv_freq, v, kv_cache, slot_mapping)
