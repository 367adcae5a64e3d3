"""Skinny linear layers: y = prologue(x) @ W^T for a few token rows (T <= 16), in one launch.

At decode batch sizes a decoder layer is latency bound: every eager op and every cuBLAS GEMM is
a launch of a few microseconds that moves little data. These kernels fold the elementwise op in
front of a projection into the GEMM's load of its input (this file), or the op after it into
its epilogue (skinny_qkv_rotary_triton.py, skinny_gate_up_silu_triton.py); all three are built
on skinny_gemm_triton.py (tiles, GEMV or tl.dot, split-K). The skinny decoder layer uses "none"
here for o_proj and down; the norms run as the prologues of the two epilogue kernels, and the
silu_mul prologue is the slower alternative to gate_up's epilogue (bench/kernels_skinny.py
compares them):

    prologue      input row of the GEMM                       extra output
    "none"        x                                           -
    "rmsnorm"     rmsnorm(x) * norm_weight                    -
    "add_rmsnorm" rmsnorm(x + residual) * norm_weight         new residual x + residual
    "silu_mul"    silu(gate) * up, x = [gate | up] [T, 2K]    -

W is [N, K] (nn.Linear's layout) with an optional bias [N]. Rounding follows the unfused kernels
step by step (rmsnorm_triton.py, silu_mul_triton.py): the residual sum is rounded to x's dtype,
row statistics are float32, the normed row is rounded to the dtype before the weight multiplies
it, silu is rounded before the product with up, and the GEMM input is rounded to the dtype. So
the result equals the unfused path up to the order of float32 additions (the GEMM and the sum of
squares).

Under TRITON_INTERPRET=1 (CPU tensors) it runs in Triton's interpreter; set the variable before
this module is imported.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from dspark.kernels.rmsnorm_triton import fused_add_rmsnorm_ref, rmsnorm_ref
from dspark.kernels.silu_mul_triton import silu_and_mul_ref
from dspark.kernels.skinny_gemm_triton import (
    SKINNY_MAX_ROWS,
    SkinnyConfig,
    _acc_total,
    _acc_zeros,
    _input_tile,
    _is_last_split,
    _load_w,
    _mac,
    _row_rstd,
    _store_partial,
    _sum_partials,
    default_config,
    dot_options,
    launch_plan,
    plan_constants,
    split_buffers,
)

# -- references ------------------------------------------------------------------------------


def skinny_linear_ref(
    x: torch.Tensor,  # [T, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [T, N]
    return F.linear(x, weight, bias)


def rmsnorm_linear_ref(
    x: torch.Tensor,  # [T, K]
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,
) -> torch.Tensor:  # [T, N]
    return F.linear(rmsnorm_ref(x, norm_weight, eps), weight, bias)


def add_rmsnorm_linear_ref(
    x: torch.Tensor,  # [T, K]
    residual: torch.Tensor,  # [T, K]
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # y [T, N], new residual [T, K]
    normed, new_residual = fused_add_rmsnorm_ref(x, residual, norm_weight, eps)
    return F.linear(normed, weight, bias), new_residual


def silu_mul_linear_ref(
    gate_up: torch.Tensor,  # [T, 2K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,
) -> torch.Tensor:  # [T, N]
    return F.linear(silu_and_mul_ref(gate_up), weight, bias)


# -- the kernel ------------------------------------------------------------------------------


@triton.jit
def _store_output(
    acc, bias_ptr, out_ptr, s_out, rows, row_mask, cols, col_mask, HAS_BIAS: tl.constexpr
):
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    mask = row_mask[:, None] & col_mask[None, :]
    dst = out_ptr + rows[:, None] * s_out + cols[None, :]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _skinny_linear_kernel(
    x_ptr, res_ptr, norm_w_ptr, w_ptr, bias_ptr, out_ptr, res_out_ptr, ws_ptr, counter_ptr,
    num_rows, s_x, s_res, s_w, s_out, s_res_out, eps,
    N: tl.constexpr, K: tl.constexpr, PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, SPLIT_PART: tl.constexpr, USE_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):  # fmt: skip
    pid_n, split = tl.program_id(0), tl.program_id(1)
    rows = tl.arange(0, BLOCK_T)
    row_mask = rows < num_rows
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # output columns = rows of W
    col_mask = cols < N
    rstd = tl.zeros([BLOCK_T], dtype=tl.float32)
    if PROLOGUE == "rmsnorm" or PROLOGUE == "add_rmsnorm":
        # one writer of the new residual: every other program still reads the old one
        is_writer = (pid_n == 0) & (split == 0)
        write_mask = rows < tl.where(is_writer, num_rows, 0)
        rstd = _row_rstd(
            x_ptr, res_ptr, res_out_ptr, rows, row_mask, s_x, s_res, s_res_out, eps, write_mask,
            K, BLOCK_T, BLOCK_K, PROLOGUE == "add_rmsnorm",
        )  # fmt: skip
    acc = _acc_zeros(BLOCK_T, BLOCK_N, BLOCK_K, USE_DOT)
    for i in tl.static_range(SPLIT_PART // BLOCK_K):  # unrolled: all loads can be in flight
        k0 = split * SPLIT_PART + i * BLOCK_K
        a = _input_tile(x_ptr, res_ptr, norm_w_ptr, rows, row_mask, s_x, s_res, k0, rstd,
                        K, BLOCK_K, PROLOGUE)  # fmt: skip
        w = _load_w(w_ptr, cols, col_mask, s_w, k0, K, BLOCK_K)
        acc = _mac(acc, a, w, USE_DOT, DOT_PRECISION, UPCAST_DOT)
    acc = _acc_total(acc, USE_DOT)  # [BT, BN]
    if SPLIT_K == 1:
        _store_output(acc, bias_ptr, out_ptr, s_out, rows, row_mask, cols, col_mask, HAS_BIAS)
    else:
        _store_partial(acc, ws_ptr, pid_n, split, BLOCK_T, BLOCK_N, SPLIT_K)
        if _is_last_split(counter_ptr, pid_n, SPLIT_K):
            acc = _sum_partials(ws_ptr, pid_n, BLOCK_T, BLOCK_N, SPLIT_K)
            _store_output(acc, bias_ptr, out_ptr, s_out, rows, row_mask, cols, col_mask, HAS_BIAS)
            tl.atomic_xchg(counter_ptr + pid_n, 0)  # zero again for the next launch


# -- launch ----------------------------------------------------------------------------------


def _launch(
    prologue: str,
    x: torch.Tensor,  # [T, K] ([T, 2K] for silu_mul)
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None,  # [N]
    residual: torch.Tensor | None,  # [T, K], add_rmsnorm only
    norm_weight: torch.Tensor | None,  # [K], the norms only
    eps: float,
    config: SkinnyConfig | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # y [T, N], new residual [T, K] or None
    T, (N, K) = x.shape[0], weight.shape
    assert x.dim() == 2 and x.shape[1] == (2 * K if prologue == "silu_mul" else K), (x.shape, K)
    assert T <= SKINNY_MAX_ROWS, f"{T} rows: the skinny path takes at most {SKINNY_MAX_ROWS}"
    assert x.stride(1) == 1 and weight.stride(1) == 1 and x.dtype == weight.dtype
    for t in (bias, norm_weight):
        assert t is None or (t.is_contiguous() and t.dtype == x.dtype), (t.shape, t.dtype)
    out = torch.empty(T, N, dtype=x.dtype, device=x.device)
    residual_out = None
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(1) == 1
        residual_out = torch.empty_like(x)
    if T == 0:
        return out, residual_out
    config = config or default_config(N, K, x.device.type)
    plan = launch_plan(config, T, K)
    num_tiles = triton.cdiv(N, config.block_n)
    dummy = x  # stands in for absent optional tensors (their loads are compiled out)
    res_out = dummy if residual_out is None else residual_out
    _skinny_linear_kernel[(num_tiles, plan.num_splits)](
        x, dummy if residual is None else residual, dummy if norm_weight is None else norm_weight,
        weight, dummy if bias is None else bias, out, res_out,
        *split_buffers(num_tiles, config.block_n, plan, x.device),
        T, x.stride(0), 0 if residual is None else residual.stride(0), weight.stride(0),
        out.stride(0), res_out.stride(0), eps,
        N=N, K=K, PROLOGUE=prologue, HAS_BIAS=bias is not None, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, **plan_constants(plan), **dot_options(x),
        num_warps=config.num_warps,
    )  # fmt: skip
    return out, residual_out


def skinny_linear(
    x: torch.Tensor,  # [T, K], T <= 16, rows may be strided
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    config: SkinnyConfig | None = None,  # None: default_config(N, K)
) -> torch.Tensor:  # [T, N]
    """`skinny_linear_ref` (F.linear) in one launch."""
    return _launch("none", x, weight, bias, None, None, 0.0, config)[0]


def skinny_rmsnorm_linear(
    x: torch.Tensor,  # [T, K]
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
) -> torch.Tensor:  # [T, N]
    """`rmsnorm_linear_ref` in one launch: the first layer's norm + projection."""
    return _launch("rmsnorm", x, weight, bias, None, norm_weight, eps, config)[0]


def skinny_add_rmsnorm_linear(
    x: torch.Tensor,  # [T, K], e.g. the attention output
    residual: torch.Tensor,  # [T, K]
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # y [T, N], new residual x + residual [T, K]
    """`add_rmsnorm_linear_ref` in one launch. The new residual is a new tensor (never written
    over `residual`: every program reads the old one)."""
    y, new_residual = _launch("add_rmsnorm", x, weight, bias, residual, norm_weight, eps, config)
    return y, new_residual


def skinny_silu_mul_linear(
    gate_up: torch.Tensor,  # [T, 2K], [gate | up]
    weight: torch.Tensor,  # [N, K], e.g. down_proj
    bias: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
) -> torch.Tensor:  # [T, N]
    """`silu_mul_linear_ref` in one launch: the MLP's activation + down projection."""
    return _launch("silu_mul", gate_up, weight, bias, None, None, 0.0, config)[0]
