"""The attention block's first launch for T <= 16 rows: norm + qkv projection + rotary + K/V
store, in one Triton kernel.

    stream = x + residual (or x alone in the first layer)      the new residual, written once
    qkv    = (rmsnorm(stream) * norm_weight) @ W_qkv^T (+ bias)
    q      = rotary(q part)            -> q_out [T, nh * hd]
    k      = rotary(k part), v part    -> the paged KV cache at slot_mapping

The add_rmsnorm prologue and paired GEMM of skinny_gemm_triton.py (same rounding) with rotary
and the K/V store as the epilogue. One program computes one head of the qkv output (nh q heads, then
nkv k heads, then nkv v heads), as two accumulators: the head's first and second halves, the
pair rotary mixes. Each half is rounded to the dtype as the qkv tensor is, then rotated with the
rounding steps of rotary_triton.py (cos/sin rounded to the dtype, each product rounded before
the sum or difference):

    out1 = x1 * cos - x2 * sin        out2 = x2 * cos + x1 * sin

so q and the cached k, v equal qkv_proj + rotary_qkv up to the order of float32 additions.
SPLIT_K > 1 splits the reduction as skinny_gemm_triton.py does (both halves' partials, one
arrival counter per head); the last split to arrive runs the epilogue. T = 1 takes the GEMV.

Under TRITON_INTERPRET=1 (CPU tensors) it runs in Triton's interpreter; set the variable before
this module is imported.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from dspark.kernels.paged_attention_ref import store_kv_ref
from dspark.kernels.rmsnorm_triton import fused_add_rmsnorm_ref, rmsnorm_ref
from dspark.kernels.rotary_triton import apply_rotary_ref
from dspark.kernels.skinny_gemm_triton import (
    SKINNY_MAX_ROWS,
    SkinnyConfig,
    _paired_gemm,
    _reduce_pair,
    _row_rstd,
    default_config,
    dot_options,
    launch_plan,
    plan_constants,
    split_buffers,
)


def qkv_rotary_ref(
    x: torch.Tensor,  # [T, d]
    residual: torch.Tensor | None,  # [T, d]; None: the stream is x (first layer)
    norm_weight: torch.Tensor,  # [d]
    eps: float,
    weight: torch.Tensor,  # [(nh + 2 nkv) hd, d]
    bias: torch.Tensor | None,  # [(nh + 2 nkv) hd]
    positions: torch.Tensor,  # [T]
    inv_freq: torch.Tensor,  # [hd/2] float32
    num_heads: int,
    num_kv_heads: int,
    kv_cache: torch.Tensor,  # [2, num_pages, page_size, nkv, hd], written
    slot_mapping: torch.Tensor,  # [T]
) -> tuple[torch.Tensor, torch.Tensor | None]:  # q [T, nh * hd], new residual [T, d] or None
    """The unfused sequence: (add +) rmsnorm, F.linear, rotary, store_kv."""
    if residual is None:
        h, new_residual = rmsnorm_ref(x, norm_weight, eps), None
    else:
        h, new_residual = fused_add_rmsnorm_ref(x, residual, norm_weight, eps)
    T, head_dim = x.shape[0], kv_cache.shape[-1]
    q, k, v = F.linear(h, weight, bias).split(
        [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1
    )
    q, k = apply_rotary_ref(q.reshape(T, num_heads, head_dim),
                            k.reshape(T, num_kv_heads, head_dim), positions, inv_freq)  # fmt: skip
    store_kv_ref(k, v.reshape(T, num_kv_heads, head_dim).contiguous(), kv_cache, slot_mapping)
    return q.flatten(1), new_residual


@triton.jit
def _rounded(x, DTYPE: tl.constexpr):
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def _rotate_and_store(
    x1, x2, head, rows, row_mask, positions_ptr, inv_freq_ptr, slot_ptr, q_ptr, kv_ptr,
    s_q, s_kv,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    # x1, x2 [BT, BLOCK_HALF]: the two halves of qkv head `head`, float32 holding dtype values.
    # q and k heads are rotated; q heads go to q_out, k and v heads to the cache.
    dtype = q_ptr.dtype.element_ty
    j = tl.arange(0, BLOCK_HALF)
    mask = row_mask[:, None] & (j < HALF)[None, :]
    pos = tl.load(positions_ptr + rows, mask=row_mask, other=0).to(tl.float32)
    freqs = pos[:, None] * tl.load(inv_freq_ptr + j, mask=j < HALF, other=0.0)[None, :]
    cos, sin = _rounded(tl.cos(freqs), dtype), _rounded(tl.sin(freqs), dtype)
    is_rotated = head < NUM_HEADS + NUM_KV_HEADS  # v heads are stored as they are
    out1 = tl.where(is_rotated, _rounded(x1 * cos, dtype) - _rounded(x2 * sin, dtype), x1)
    out2 = tl.where(is_rotated, _rounded(x2 * cos, dtype) + _rounded(x1 * sin, dtype), x2)
    if head < NUM_HEADS:
        dst = q_ptr + rows[:, None] * s_q + head * 2 * HALF + j[None, :]
    else:
        # The cache is [2, pages, page_size, nkv, hd], contiguous below its first dim: element
        # (slot, kv head, d) of K (which 0) or V (which 1) sits at which * s_kv + (slot * nkv +
        # kv head) * hd + d. nh 9, nkv 3: head 10 -> K, kv head 1; head 13 -> V, kv head 1.
        which = (head - NUM_HEADS) // NUM_KV_HEADS
        kv_head = (head - NUM_HEADS) % NUM_KV_HEADS
        slot = tl.load(slot_ptr + rows, mask=row_mask, other=0).to(tl.int64)
        row = (slot * NUM_KV_HEADS + kv_head) * (2 * HALF)  # [BT]
        dst = kv_ptr + which * s_kv + row[:, None] + j[None, :]
    tl.store(dst, out1.to(dtype), mask=mask)
    tl.store(dst + HALF, out2.to(dtype), mask=mask)


@triton.jit
def _add_bias_and_round(acc, bias_ptr, cols, col_mask, HAS_BIAS: tl.constexpr, DTYPE):
    # The projection's output: accumulator (+ bias) rounded to the dtype, as qkv_proj's is.
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    return _rounded(acc, DTYPE)


@triton.jit
def _skinny_qkv_rotary_kernel(
    x_ptr, res_ptr, norm_w_ptr, w_ptr, bias_ptr, res_out_ptr, positions_ptr, inv_freq_ptr,
    slot_ptr, q_ptr, kv_ptr, ws_ptr, counter_ptr,
    num_rows, s_x, s_res, s_w, s_res_out, s_q, s_kv, eps,
    K: tl.constexpr, PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, SPLIT_PART: tl.constexpr, USE_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):  # fmt: skip
    head, split = tl.program_id(0), tl.program_id(1)
    rows = tl.arange(0, BLOCK_T)
    row_mask = rows < num_rows
    j = tl.arange(0, BLOCK_HALF)
    half_mask = j < HALF
    cols1 = head * 2 * HALF + j  # qkv columns (= W rows) of the head's first half
    cols2 = cols1 + HALF  # and of its second half
    # one writer of the new residual: every other program still reads the old one
    write_mask = rows < tl.where((head == 0) & (split == 0), num_rows, 0)
    rstd = _row_rstd(x_ptr, res_ptr, res_out_ptr, rows, row_mask, s_x, s_res, s_res_out, eps,
                     write_mask, K, BLOCK_T, BLOCK_K, PROLOGUE == "add_rmsnorm")  # fmt: skip
    acc1, acc2 = _paired_gemm(
        x_ptr, res_ptr, norm_w_ptr, w_ptr, rows, row_mask, s_x, s_res, s_w, rstd, cols1, cols2,
        half_mask, split, K, PROLOGUE, BLOCK_T, BLOCK_HALF, BLOCK_K, SPLIT_PART, USE_DOT,
        DOT_PRECISION, UPCAST_DOT,
    )  # fmt: skip
    is_last = True
    if SPLIT_K > 1:
        is_last, acc1, acc2 = _reduce_pair(acc1, acc2, ws_ptr, counter_ptr, head, split,
                                           BLOCK_T, BLOCK_HALF, SPLIT_K)  # fmt: skip
    if is_last:
        dtype = q_ptr.dtype.element_ty
        x1 = _add_bias_and_round(acc1, bias_ptr, cols1, half_mask, HAS_BIAS, dtype)
        x2 = _add_bias_and_round(acc2, bias_ptr, cols2, half_mask, HAS_BIAS, dtype)
        _rotate_and_store(x1, x2, head, rows, row_mask, positions_ptr, inv_freq_ptr, slot_ptr,
                          q_ptr, kv_ptr, s_q, s_kv, NUM_HEADS, NUM_KV_HEADS, HALF,
                          BLOCK_HALF)  # fmt: skip


def default_qkv_config(num_qkv_heads: int, k: int, device_type: str = "cuda") -> SkinnyConfig:
    """One program per head (block_n unused), K split for ~128 programs: SmolLM2's 15 heads
    and K 576 -> split_k 8, BLOCK_K 64 -> 5 parts of 128 columns, 75 programs. The CPU never
    splits."""
    split_k = min(8, triton.cdiv(128, num_qkv_heads)) if device_type == "cuda" else 1
    return SkinnyConfig(block_k=default_config(16, k).block_k, split_k=split_k)


def skinny_qkv_rotary(
    x: torch.Tensor,  # [T, d], T <= 16, rows may be strided
    residual: torch.Tensor | None,  # [T, d]; None: the stream is x (first layer)
    norm_weight: torch.Tensor,  # [d]
    eps: float,
    weight: torch.Tensor,  # [(nh + 2 nkv) hd, d], qkv_proj's
    bias: torch.Tensor | None,  # [(nh + 2 nkv) hd]
    positions: torch.Tensor,  # [T] int32 or int64
    inv_freq: torch.Tensor,  # [hd/2] float32
    num_heads: int,
    num_kv_heads: int,
    kv_cache: torch.Tensor,  # [2, num_pages, page_size, nkv, hd] contiguous, written
    slot_mapping: torch.Tensor,  # [T] int64, real slots only (pad rows: the scratch page)
    config: SkinnyConfig | None = None,  # None: default_qkv_config
) -> tuple[torch.Tensor, torch.Tensor | None]:  # q [T, nh * hd], new residual [T, d] or None
    """`qkv_rotary_ref` in one launch: the rotated q comes back, k and v go to the cache."""
    T, d = x.shape
    head_dim = kv_cache.shape[-1]
    num_qkv_heads = num_heads + 2 * num_kv_heads
    assert T <= SKINNY_MAX_ROWS, f"{T} rows: the skinny path takes at most {SKINNY_MAX_ROWS}"
    assert weight.shape == (num_qkv_heads * head_dim, d) and x.dtype == weight.dtype
    assert x.stride(1) == 1 and weight.stride(1) == 1 and norm_weight.dtype == x.dtype
    assert kv_cache.is_contiguous() and kv_cache.dtype == x.dtype and head_dim % 2 == 0
    assert kv_cache.shape[3] == num_kv_heads and inv_freq.shape == (head_dim // 2,)
    assert positions.shape == (T,) and slot_mapping.shape == (T,), (positions.shape, T)
    q = torch.empty(T, num_heads * head_dim, dtype=x.dtype, device=x.device)
    new_residual = None if residual is None else torch.empty_like(x)
    if T == 0:
        return q, new_residual
    config = config or default_qkv_config(num_qkv_heads, d, x.device.type)
    plan = launch_plan(config, T, d)
    half = head_dim // 2
    block_half = max(16, triton.next_power_of_2(half))  # tl.dot's smallest N
    # tiles 2 h and 2 h + 1: the halves of head h; counters: one per head (the first ones)
    ws, counters = split_buffers(2 * num_qkv_heads, block_half, plan, x.device)
    res_out = x if new_residual is None else new_residual
    _skinny_qkv_rotary_kernel[(num_qkv_heads, plan.num_splits)](
        x, x if residual is None else residual, norm_weight, weight,
        x if bias is None else bias, res_out, positions, inv_freq, slot_mapping, q, kv_cache, ws,
        counters,
        T, x.stride(0), 0 if residual is None else residual.stride(0), weight.stride(0),
        res_out.stride(0), q.stride(0), kv_cache.stride(0), eps,
        K=d, PROLOGUE="rmsnorm" if residual is None else "add_rmsnorm", HAS_BIAS=bias is not None,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=half,
        BLOCK_HALF=block_half, BLOCK_K=config.block_k, **plan_constants(plan), **dot_options(x),
        num_warps=config.num_warps,
        enable_fp_fusion=False,  # as rotary_triton.py: keep each rounded product's rounding
    )  # fmt: skip
    return q, new_residual
