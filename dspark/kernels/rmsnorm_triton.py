"""RMSNorm, alone or fused with the residual add before it, in one Triton launch per call.

The fast twin of dspark/layers/norm.py. A decoder layer's `x + attn(...)` followed by
`post_attention_layernorm` is two to six eager kernels; `fused_add_rmsnorm` is one.

Rounding follows the eager code step by step: the row is reduced in float32, normalised, rounded
to x's dtype, and only then multiplied by the weight (the product rounded once more, to the
promoted dtype of weight and x). The residual sum is rounded to x's dtype before it is
normalised, as `x = x + attn(...)` is. One program normalises one row.

Under TRITON_INTERPRET=1 (CPU tensors) it runs in Triton's interpreter; set the variable before
this module is imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dspark.kernels.pdl import gdc_enter, pdl_options


def rmsnorm_ref(
    x: torch.Tensor,  # [T, d]
    weight: torch.Tensor,  # [d]
    eps: float,
) -> torch.Tensor:  # [T, d], dtype promote(weight, x)
    """RMSNorm exactly as dspark.layers.norm.RMSNorm computes it."""
    x32 = x.float()  # [T, d]
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def fused_add_rmsnorm_ref(
    x: torch.Tensor,  # [T, d]
    residual: torch.Tensor,  # [T, d]
    weight: torch.Tensor,  # [d]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # normed [T, d], new residual [T, d]
    new_residual = x + residual  # [T, d], rounded to x's dtype
    return rmsnorm_ref(new_residual, weight, eps), new_residual


@triton.jit
def weighted_normed(x, rstd, w, X_DTYPE: tl.constexpr):
    # x, w float32 (x holding x-dtype values): the normed values are rounded to x's dtype before
    # the weight multiplies them, as `weight * x32.to(dtype)` does.
    return w * (x * rstd).to(X_DTYPE).to(tl.float32)


@triton.jit
def _scale_normed(x, w, eps, D: tl.constexpr, X_DTYPE: tl.constexpr):
    # x: [BLOCK] float32 holding x-dtype values, zero past D; w: [BLOCK] float32.
    # Sum then divide, as torch's mean does.
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    return weighted_normed(x, rstd, w, X_DTYPE)


@triton.jit
def _rmsnorm_kernel(
    x_ptr, w_ptr, out_ptr, s_x, s_out, eps,
    D: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    mask = i < D
    gdc_enter(PDL)
    x = tl.load(x_ptr + row * s_x + i, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + i, mask=mask, other=0.0).to(tl.float32)
    y = _scale_normed(x, w, eps, D, x_ptr.dtype.element_ty)
    tl.store(out_ptr + row * s_out + i, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fused_add_rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    s_x, s_res, s_out, s_res_out, eps,
    D: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    mask = i < D
    gdc_enter(PDL)
    x = tl.load(x_ptr + row * s_x + i, mask=mask, other=0.0).to(tl.float32)
    res = tl.load(res_ptr + row * s_res + i, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + i, mask=mask, other=0.0).to(tl.float32)
    total = (x + res).to(x_ptr.dtype.element_ty)  # the new residual, in x's dtype
    y = _scale_normed(total.to(tl.float32), w, eps, D, x_ptr.dtype.element_ty)
    # Both stores come after the row's reduction, so out may alias x and res_out residual.
    tl.store(res_out_ptr + row * s_res_out + i, total, mask=mask)
    tl.store(out_ptr + row * s_out + i, y.to(out_ptr.dtype.element_ty), mask=mask)


def _launch_config(d: int) -> tuple[int, int]:
    """One block covers the whole row: (BLOCK, num_warps); d 576 -> (1024, 4)."""
    block = triton.next_power_of_2(d)
    return block, max(1, min(16, block // 256))


def _check_rows(x: torch.Tensor, weight: torch.Tensor) -> None:
    assert x.dim() == 2 and weight.shape == (x.shape[1],), (x.shape, weight.shape)
    assert x.stride(1) == 1 and weight.is_contiguous(), (x.stride(), weight.stride())


def _new_or_checked(
    out: torch.Tensor | None, like: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:  # [T, d]
    if out is None:
        return torch.empty(like.shape, dtype=dtype, device=like.device)
    assert out.shape == like.shape and out.dtype == dtype, (out.shape, out.dtype, dtype)
    assert out.stride(1) == 1, out.stride()
    return out


def rmsnorm(
    x: torch.Tensor,  # [T, d], rows may be strided, last dim contiguous
    weight: torch.Tensor,  # [d]
    eps: float,
    out: torch.Tensor | None = None,  # [T, d]; may be x itself
) -> torch.Tensor:  # [T, d], dtype promote(weight, x)
    """`rmsnorm_ref` in one launch. Writes `out` (a new tensor when None) and returns it."""
    _check_rows(x, weight)
    out = _new_or_checked(out, x, torch.promote_types(weight.dtype, x.dtype))
    if x.shape[0] == 0:
        return out
    block, num_warps = _launch_config(x.shape[1])
    _rmsnorm_kernel[(x.shape[0],)](
        x, weight, out, x.stride(0), out.stride(0), eps,
        D=x.shape[1], BLOCK=block, num_warps=num_warps, **pdl_options(x.device),
    )  # fmt: skip
    return out


def fused_add_rmsnorm(
    x: torch.Tensor,  # [T, d], e.g. the attention output
    residual: torch.Tensor,  # [T, d], the residual stream
    weight: torch.Tensor,  # [d]
    eps: float,
    out: torch.Tensor | None = None,  # [T, d]; may be x itself
    residual_out: torch.Tensor | None = None,  # [T, d]; may be residual itself
) -> tuple[torch.Tensor, torch.Tensor]:  # normed [T, d], new residual [T, d]
    """`fused_add_rmsnorm_ref` in one launch: new_residual = x + residual (in x's dtype),
    normed = rmsnorm(new_residual). Writes `out` and `residual_out` (new tensors when None)."""
    _check_rows(x, weight)
    assert residual.shape == x.shape and residual.dtype == x.dtype, (residual.shape, x.shape)
    assert residual.stride(1) == 1, residual.stride()
    out = _new_or_checked(out, x, torch.promote_types(weight.dtype, x.dtype))
    residual_out = _new_or_checked(residual_out, x, x.dtype)
    if x.shape[0] == 0:
        return out, residual_out
    block, num_warps = _launch_config(x.shape[1])
    _fused_add_rmsnorm_kernel[(x.shape[0],)](
        x, residual, weight, out, residual_out,
        x.stride(0), residual.stride(0), out.stride(0), residual_out.stride(0), eps,
        D=x.shape[1], BLOCK=block, num_warps=num_warps, **pdl_options(x.device),
    )  # fmt: skip
    return out, residual_out
