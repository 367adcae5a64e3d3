"""The DSpark drafter's context upkeep after its one projection: norm scale, bias, rotary and
the K/V store of every drafter layer, in one launch.

The context path is ctx = w * rmsnorm(fc(f)), then per drafter layer l: k_l, v_l = Wkv_l ctx
(+ b_l), k rotated, both stored. RMSNorm only scales a row, so with y = fc(f) and
rstd = 1 / sqrt(mean(y^2) + eps):

    Wkv_l ctx = (Wkv_l diag(w) Wfc) f * rstd

models/folded_context.py multiplies the three matrices once and stacks them under fc's own
rows, so a single GEMM gives proj = [y | kv_0 | kv_1 | ...] per token, unscaled. This kernel
then takes one token per program:

    proj row  [ y: D | k_0: KV | v_0: KV | k_1: KV | v_1: KV ]      KV = nkv * hd
    rstd from y; for each layer: k = round(k * rstd + b_k), v = round(v * rstd + b_v),
    k rotated at the token's position (rotary_triton's rounding), k and v written to the
    layer's cache at slot_mapping[token].

    Worked example (D = 4, nkv = 1, hd = 2, two layers): a row has 4 + 2 * (2 + 2) = 12
    columns; layer 1's k is columns 8-9 and its v columns 10-11.

The layers' caches are separate tensors of one shape; the kernel reaches layer l's at
`cache_0 + l * layer_stride` (elements), so the caches must be evenly spaced in memory (two
always are; allocate_kv_caches' usually are). Otherwise `context_kv_store` launches once per
layer.

Under TRITON_INTERPRET=1 (CPU tensors) it runs in Triton's interpreter; set the variable before
this module is imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dspark.kernels.pdl import gdc_enter, pdl_options
from dspark.kernels.rotary_triton import _rotate, _rounded


@triton.jit
def _scaled_half(ptr, off, bias_ptr, bias_off, rstd, valid, HAS_BIAS: tl.constexpr,
                 DTYPE: tl.constexpr):  # fmt: skip
    # One half of every head of a k or v slice: [BLOCK_KV, BLOCK_HALF] values * rstd (+ bias),
    # rounded to DTYPE as F.linear's output would be, returned in float32.
    x = tl.load(ptr + off, mask=valid, other=0.0).to(tl.float32) * rstd
    if HAS_BIAS:
        x += tl.load(bias_ptr + bias_off, mask=valid, other=0.0).to(tl.float32)
    return _rounded(x, DTYPE)


@triton.jit
def _context_kv_kernel(
    proj_ptr, bias_ptr, positions_ptr, inv_freq_ptr, slot_ptr, cache_ptr,
    s_proj, s_layer, s_kv, eps,
    D: tl.constexpr, BLOCK_D: tl.constexpr, COL0: tl.constexpr, NUM_LAYERS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_KV: tl.constexpr,
    BLOCK_HALF: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    tok = tl.program_id(0).to(tl.int64)
    dtype = cache_ptr.dtype.element_ty
    gdc_enter(PDL)
    row = proj_ptr + tok * s_proj
    i = tl.arange(0, BLOCK_D)
    y = tl.load(row + i, mask=i < D, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(y * y, axis=0) / D + eps)

    j1 = tl.arange(0, BLOCK_HALF)
    freqs = tl.load(positions_ptr + tok).to(tl.float32) * tl.load(
        inv_freq_ptr + j1, mask=j1 < HALF, other=0.0
    )  # [BLOCK_HALF] float32
    cos = _rounded(tl.cos(freqs), dtype)[None, :]  # [1, BLOCK_HALF]
    sin = _rounded(tl.sin(freqs), dtype)[None, :]
    slot = tl.load(slot_ptr + tok).to(tl.int64)

    h = tl.arange(0, BLOCK_KV)[:, None]
    j = tl.arange(0, BLOCK_HALF)[None, :]
    valid = (h < NUM_KV_HEADS) & (j < HALF)
    head = h * (2 * HALF) + j  # [BLOCK_KV, BLOCK_HALF]: the first half of each head
    dst = slot * (NUM_KV_HEADS * 2 * HALF) + head  # the same element in a cache slot
    KV: tl.constexpr = NUM_KV_HEADS * 2 * HALF
    for layer in tl.static_range(NUM_LAYERS):
        k_col = COL0 + layer * 2 * KV  # this layer's k in proj's row; its v follows
        b_col = layer * 2 * KV
        k1 = _scaled_half(row, k_col + head, bias_ptr, b_col + head, rstd, valid, HAS_BIAS,
                          dtype)  # fmt: skip
        k2 = _scaled_half(row, k_col + head + HALF, bias_ptr, b_col + head + HALF, rstd, valid,
                          HAS_BIAS, dtype)  # fmt: skip
        v1 = _scaled_half(row, k_col + KV + head, bias_ptr, b_col + KV + head, rstd, valid,
                          HAS_BIAS, dtype)  # fmt: skip
        v2 = _scaled_half(row, k_col + KV + head + HALF, bias_ptr, b_col + KV + head + HALF,
                          rstd, valid, HAS_BIAS, dtype)  # fmt: skip
        out1, out2 = _rotate(k1, k2, cos, sin, dtype)
        k_cache = cache_ptr + layer * s_layer
        tl.store(k_cache + dst, out1, mask=valid)
        tl.store(k_cache + dst + HALF, out2, mask=valid)
        tl.store(k_cache + s_kv + dst, v1.to(dtype), mask=valid)
        tl.store(k_cache + s_kv + dst + HALF, v2.to(dtype), mask=valid)


def _even_spacing(kv_caches: list[torch.Tensor]) -> int | None:
    """Elements from one layer's cache to the next, when all are evenly spaced (else None)."""
    if len(kv_caches) == 1:
        return 0
    elem = kv_caches[0].element_size()
    ptrs = [c.data_ptr() for c in kv_caches]
    step = ptrs[1] - ptrs[0]
    if step % elem or any(b - a != step for a, b in zip(ptrs, ptrs[1:], strict=False)):
        return None
    return step // elem


def context_kv_store(
    proj: torch.Tensor,  # [T, D + L 2 KV], the folded projection's output (rows may be strided)
    bias: torch.Tensor | None,  # [L 2 KV], the layers' k/v biases side by side, or None
    hidden_size: int,  # D
    eps: float,  # the context norm's
    positions: torch.Tensor,  # [T] int
    inv_freq: torch.Tensor,  # [hd/2] float32
    kv_caches: list[torch.Tensor],  # L x [2, num_pages, page_size, nkv, hd], contiguous
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    """Scale, bias, rotate and store every drafter layer's context K/V (the module docstring)."""
    T = proj.shape[0]
    cache = kv_caches[0]
    _, _, _, num_kv_heads, head_dim = cache.shape
    kv = num_kv_heads * head_dim
    num_layers = len(kv_caches)
    assert proj.dim() == 2 and proj.shape[1] == hidden_size + num_layers * 2 * kv, proj.shape
    assert proj.stride(1) == 1 and proj.dtype == cache.dtype, (proj.stride(), proj.dtype)
    assert bias is None or (bias.shape == (num_layers * 2 * kv,) and bias.is_contiguous())
    assert all(c.shape == cache.shape and c.is_contiguous() for c in kv_caches)
    assert positions.shape == slot_mapping.shape == (T,), (positions.shape, slot_mapping.shape)
    assert inv_freq.shape == (head_dim // 2,) and inv_freq.dtype == torch.float32
    if T == 0:
        return
    spacing = _even_spacing(kv_caches)
    if spacing is not None:  # one launch for every layer
        groups = [(0, kv_caches)]
    else:  # one launch a layer
        groups = [(layer, [cache]) for layer, cache in enumerate(kv_caches)]
    half = head_dim // 2
    for first, caches in groups:
        _context_kv_kernel[(T,)](
            proj, proj if bias is None else bias[first * 2 * kv :], positions, inv_freq,
            slot_mapping, caches[0], proj.stride(0), spacing or 0, cache.stride(0), eps,
            D=hidden_size, BLOCK_D=triton.next_power_of_2(hidden_size),
            COL0=hidden_size + first * 2 * kv, NUM_LAYERS=len(caches),
            NUM_KV_HEADS=num_kv_heads, HALF=half, BLOCK_KV=triton.next_power_of_2(num_kv_heads),
            BLOCK_HALF=triton.next_power_of_2(half), HAS_BIAS=bias is not None,
            num_warps=1, enable_fp_fusion=False, **pdl_options(proj.device),
        )  # fmt: skip
