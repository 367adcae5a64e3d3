"""The MLP's first launch for T <= 16 rows: (add +) rmsnorm + gate_up projection + SiLU-and-mul,
in one Triton kernel.

    stream    = x + residual (or x alone)                      the new residual, written once
    [g | u]   = (rmsnorm(stream) * norm_weight) @ W_gate_up^T  (+ bias), W_gate_up [2I, d]
    act       = silu(g) * u                                    [T, I], down_proj's input

Program p computes act columns p * BLOCK_N .. as two accumulators, W rows j (gate) and I + j
(up): the paired GEMM of skinny_gemm_triton.py, with its prologue helpers and rounding. The
epilogue rounds both to the dtype, as gate_up_proj's output is, then follows silu_mul_triton.py
(silu in float32 rounded to the dtype, times up, rounded). So act equals the unfused sequence up
to the order of float32 additions, and the SiLU runs once per output element: as a prologue of
down_proj instead, every column-block program would recompute it over the whole row.

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
    _paired_gemm,
    _reduce_pair,
    _row_rstd,
    default_config,
    dot_options,
    launch_plan,
    plan_constants,
    split_buffers,
)


def gate_up_silu_ref(
    x: torch.Tensor,  # [T, d]
    residual: torch.Tensor | None,  # [T, d]; None: the stream is x
    norm_weight: torch.Tensor,  # [d]
    eps: float,
    weight: torch.Tensor,  # [2I, d], gate rows then up rows
    bias: torch.Tensor | None = None,  # [2I]
) -> tuple[torch.Tensor, torch.Tensor | None]:  # act [T, I], new residual [T, d] or None
    """The unfused sequence: (add +) rmsnorm, F.linear, silu_and_mul."""
    if residual is None:
        h, new_residual = rmsnorm_ref(x, norm_weight, eps), None
    else:
        h, new_residual = fused_add_rmsnorm_ref(x, residual, norm_weight, eps)
    return silu_and_mul_ref(F.linear(h, weight, bias)), new_residual


@triton.jit
def _silu_mul_store(acc_gate, acc_up, bias_ptr, out_ptr, s_out, rows, row_mask, cols, col_mask,
                    INTER: tl.constexpr, HAS_BIAS: tl.constexpr):  # fmt: skip
    # [BT, BN] accumulators of gate and up columns `cols`: round as gate_up_proj's output,
    # then silu_and_mul's arithmetic (IEEE division, as silu_mul_triton.py).
    dtype = out_ptr.dtype.element_ty
    if HAS_BIAS:
        acc_gate += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        acc_up += tl.load(bias_ptr + INTER + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    gate = acc_gate.to(dtype).to(tl.float32)
    up = acc_up.to(dtype).to(tl.float32)
    silu = tl.div_rn(gate, 1.0 + tl.exp(-gate)).to(dtype).to(tl.float32)
    mask = row_mask[:, None] & col_mask[None, :]
    tl.store(out_ptr + rows[:, None] * s_out + cols[None, :], (silu * up).to(dtype), mask=mask)


@triton.jit
def _skinny_gate_up_silu_kernel(
    x_ptr, res_ptr, norm_w_ptr, w_ptr, bias_ptr, out_ptr, res_out_ptr, ws_ptr, counter_ptr,
    num_rows, s_x, s_res, s_w, s_out, s_res_out, eps,
    INTER: tl.constexpr, K: tl.constexpr, PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, SPLIT_PART: tl.constexpr, USE_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):  # fmt: skip
    pid_n, split = tl.program_id(0), tl.program_id(1)
    rows = tl.arange(0, BLOCK_T)
    row_mask = rows < num_rows
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # act columns = gate rows of W
    col_mask = cols < INTER
    # one writer of the new residual: every other program still reads the old one
    write_mask = rows < tl.where((pid_n == 0) & (split == 0), num_rows, 0)
    rstd = _row_rstd(x_ptr, res_ptr, res_out_ptr, rows, row_mask, s_x, s_res, s_res_out, eps,
                     write_mask, K, BLOCK_T, BLOCK_K, PROLOGUE == "add_rmsnorm")  # fmt: skip
    acc_gate, acc_up = _paired_gemm(
        x_ptr, res_ptr, norm_w_ptr, w_ptr, rows, row_mask, s_x, s_res, s_w, rstd, cols,
        cols + INTER, col_mask, split, K, PROLOGUE, BLOCK_T, BLOCK_N, BLOCK_K, SPLIT_PART,
        USE_DOT, DOT_PRECISION, UPCAST_DOT,
    )  # fmt: skip
    is_last = True
    if SPLIT_K > 1:
        is_last, acc_gate, acc_up = _reduce_pair(acc_gate, acc_up, ws_ptr, counter_ptr, pid_n,
                                                 split, BLOCK_T, BLOCK_N, SPLIT_K)  # fmt: skip
    if is_last:
        _silu_mul_store(acc_gate, acc_up, bias_ptr, out_ptr, s_out, rows, row_mask, cols,
                        col_mask, INTER, HAS_BIAS)  # fmt: skip


def skinny_gate_up_silu(
    x: torch.Tensor,  # [T, d], T <= 16, rows may be strided; e.g. the attention output
    residual: torch.Tensor | None,  # [T, d]; None: the stream is x
    norm_weight: torch.Tensor,  # [d]
    eps: float,
    weight: torch.Tensor,  # [2I, d], gate_up_proj's (gate rows, then up rows)
    bias: torch.Tensor | None = None,  # [2I]
    config: SkinnyConfig | None = None,  # None: default_config(I, d)
) -> tuple[torch.Tensor, torch.Tensor | None]:  # act [T, I], new residual [T, d] or None
    """`gate_up_silu_ref` in one launch. The new residual is a new tensor (never written over
    `residual`: every program reads the old one)."""
    T, d = x.shape
    inter = weight.shape[0] // 2
    assert T <= SKINNY_MAX_ROWS, f"{T} rows: the skinny path takes at most {SKINNY_MAX_ROWS}"
    assert weight.shape == (2 * inter, d) and x.dtype == weight.dtype == norm_weight.dtype
    assert x.stride(1) == 1 and weight.stride(1) == 1 and norm_weight.is_contiguous()
    assert bias is None or (bias.shape == (2 * inter,) and bias.dtype == x.dtype)
    act = torch.empty(T, inter, dtype=x.dtype, device=x.device)
    new_residual = None
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(1) == 1
        new_residual = torch.empty_like(x)
    if T == 0:
        return act, new_residual
    config = config or default_config(inter, d, x.device.type)
    plan = launch_plan(config, T, d)
    num_tiles = triton.cdiv(inter, config.block_n)
    res_out = x if new_residual is None else new_residual
    # tiles 2 p and 2 p + 1: gate and up of column block p; counters: one per block
    ws, counters = split_buffers(2 * num_tiles, config.block_n, plan, x.device)
    _skinny_gate_up_silu_kernel[(num_tiles, plan.num_splits)](
        x, x if residual is None else residual, norm_weight, weight, x if bias is None else bias,
        act, res_out, ws, counters,
        T, x.stride(0), 0 if residual is None else residual.stride(0), weight.stride(0),
        act.stride(0), res_out.stride(0), eps,
        INTER=inter, K=d, PROLOGUE="rmsnorm" if residual is None else "add_rmsnorm",
        HAS_BIAS=bias is not None, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        **plan_constants(plan), **dot_options(x), num_warps=config.num_warps,
    )  # fmt: skip
    return act, new_residual
