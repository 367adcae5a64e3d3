"""y = x @ W^T (+ bias) for a few token rows (T <= GEMV_MAX_ROWS): the decoder layer's
projections at small decode batches.

At T = 1 a SmolLM2 projection moves 1-4 MB of weights and is latency bound: cuBLAS took 4.2 us
a call in a chain of the layer's projections, where this kernel takes 2.1 us launched with PDL.
Each program owns BLOCK_N output
columns (rows of W) and walks all of K, so there is no split-K workspace and no second pass.
Before it waits for the kernel ahead of it (kernels/pdl.py) it prefetches its W rows into L2:
the weights do not depend on that kernel, so their first HBM round trip overlaps it.

    W [N, K] (nn.Linear's layout), x [T, K]; program p computes out[:, p*BN : (p+1)*BN]:
        out[t, n] = sum over k-blocks of sum_k x[t, k] * W[n, k]     (float32)
    At T > 1 each W tile is loaded once and every row is taken over it in registers
    (`_rows_with_w_in_registers`). A version that summed each thread's products over all of K
    before one reduction lost to it at every batch on the H200 and was removed, and so were
    the prologues that folded the norms and SiLU-and-mul into the load of x (models/llama.py
    says why).

Under TRITON_INTERPRET=1 (CPU tensors) it runs in Triton's interpreter; set the variable before
this module is imported.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dspark.kernels.pdl import gdc_enter, pdl_options

GEMV_MAX_ROWS = 8  # token rows the kernel takes (the model's projections: layers/linear.py)
L2_LINE_BYTES = 128


@triton.jit
def _prefetch_rows_l2(w_ptr, cols, s_w, N: tl.constexpr, LINES: tl.constexpr,
                      LINES_P2: tl.constexpr, LINE_ELEMS: tl.constexpr):  # fmt: skip
    # one address per 128-byte line of this program's W rows (clamped: duplicates are harmless)
    line = tl.minimum(tl.arange(0, LINES_P2), LINES - 1)
    row = tl.minimum(cols, N - 1)
    addr = w_ptr + row[:, None] * s_w + line[None, :] * LINE_ELEMS  # [BLOCK_N, LINES_P2]
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [addr], dtype=tl.int32,
        is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def _x_block(x_ptr, row, ks, k_mask, s_x):
    """x[row, ks] in float32, zero past K."""
    return tl.load(x_ptr + row * s_x + ks, mask=k_mask, other=0.0).to(tl.float32)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, s_x, s_w, s_out,
    ROWS: tl.constexpr, N: tl.constexpr, K: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LINES: tl.constexpr, LINES_P2: tl.constexpr,
    LINE_ELEMS: tl.constexpr, PDL: tl.constexpr, ROWS_P2: tl.constexpr,
):  # fmt: skip
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # output columns = rows of W
    col_mask = cols < N
    if PDL:  # the weights do not depend on the kernel ahead: fetch them while it runs
        _prefetch_rows_l2(w_ptr, cols, s_w, N, LINES, LINES_P2, LINE_ELEMS)
    gdc_enter(PDL)
    if ROWS == 1:  # (the kernel measured on the H200)
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in tl.static_range(0, K, BLOCK_K):  # unrolled: all loads can be in flight
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < K
            x = _x_block(x_ptr, 0, ks, k_mask, s_x)  # [BK]
            w = _w_tile(w_ptr, cols, col_mask, ks, k_mask, s_w)  # [BN, BK]
            acc += tl.sum(w * x[None, :], axis=1)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + cols, acc.to(out_ptr.dtype.element_ty), mask=col_mask)
    else:
        _rows_with_w_in_registers(x_ptr, w_ptr, bias_ptr, out_ptr, s_x, s_w, s_out, cols,
                                  col_mask, ROWS, ROWS_P2, K, HAS_BIAS, BLOCK_N,
                                  BLOCK_K)  # fmt: skip


@triton.jit
def _rows_with_w_in_registers(
    x_ptr, w_ptr, bias_ptr, out_ptr, s_x, s_w, s_out, cols, col_mask,
    ROWS: tl.constexpr, ROWS_P2: tl.constexpr, K: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The program's columns for ROWS > 1 rows, each W tile loaded once: the row loop runs
    inside the K loop, over the tile held in registers, where the one-row loop above would
    load it again for every row (from L1 at best: 1,474 against 1,001 us a step at batch 8
    on the H200). The rows' sums gather in acc [ROWS_P2, BLOCK_N], row t's in acc[t]:

      ROWS 3, BLOCK_N 4, one K block: w = W[cols, :] loaded once;
      t = 0, 1, 2: part = sum_k w[:, k] * x[t, k] (4 sums), acc[t] = part"""
    rows = tl.arange(0, ROWS_P2)
    acc = tl.zeros([ROWS_P2, BLOCK_N], dtype=tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        w = _w_tile(w_ptr, cols, col_mask, ks, k_mask, s_w)  # [BN, BK], once for every row
        for row in tl.static_range(ROWS):
            x = _x_block(x_ptr, row, ks, k_mask, s_x)  # [BK]
            part = tl.sum(w * x[None, :], axis=1)  # [BN]
            acc = tl.where(rows[:, None] == row, acc + part[None, :], acc)
    _store_rows(acc, bias_ptr, out_ptr, s_out, rows, cols, col_mask, ROWS, HAS_BIAS)


@triton.jit
def _w_tile(w_ptr, cols, col_mask, ks, k_mask, s_w):
    """W[cols, ks] [BLOCK_N, BLOCK_K] in float32, zero past N and K."""
    w = tl.load(
        w_ptr + cols[:, None] * s_w + ks[None, :],
        mask=col_mask[:, None] & k_mask[None, :],
        other=0.0,
    )
    return w.to(tl.float32)


@triton.jit
def _store_rows(acc, bias_ptr, out_ptr, s_out, rows, cols, col_mask, ROWS: tl.constexpr,
                HAS_BIAS: tl.constexpr):  # fmt: skip
    """out[rows, cols] = acc (+ bias), acc [ROWS_P2, BLOCK_N] float32."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + rows[:, None] * s_out + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=(rows[:, None] < ROWS) & col_mask[None, :],
    )


@dataclass(frozen=True)
class GemvConfig:
    block_n: int  # output columns a program
    block_k: int  # the K block of one step of a program's unrolled walk
    num_warps: int


def default_config(N: int, K: int) -> GemvConfig:
    """From the H200 sweep at T = 1 (a chain of 120 of one shape's launches with PDL, by
    bench/pdl_chain.py, which left the tree at 04a7e3c): all of K in one unrolled step up to
    1,024 (576 -> one block of 1,024: qkv 1.68 us against 2.37 in blocks of 256; fewer, wider
    steps beat less padding), 4 columns a program, 2 where K is longer (down, K 1,536: 2.21
    us), two warps. The same at T > 1 (the rows kernel's best tiles at 8 rows on the H200 were
    2-4 columns, all of K, one warp: 6.1 us a layer's chain where cuBLAS took 4.1)."""
    block_n = 2 if K > 1024 else 4
    return GemvConfig(block_n, min(triton.next_power_of_2(K), 1024), 2)


def gemv(
    x: torch.Tensor,  # [T, K], T <= GEMV_MAX_ROWS, rows may be strided, last dim contiguous
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    *,
    out: torch.Tensor | None = None,  # [T, N], rows may be strided; None: a new tensor
    config: GemvConfig | None = None,  # None: default_config (the tests take others)
) -> torch.Tensor:  # [T, N], x's dtype
    """F.linear(x, weight, bias) in one launch for a few token rows."""
    T, (N, K) = x.shape[0], weight.shape
    assert x.dim() == 2 and x.shape[1] == K, (x.shape, K)
    assert T <= GEMV_MAX_ROWS, f"{T} rows: the GEMV takes at most {GEMV_MAX_ROWS}"
    assert x.stride(1) == 1 and weight.stride(1) == 1 and x.dtype == weight.dtype
    assert bias is None or (bias.is_contiguous() and bias.dtype == x.dtype), bias.shape
    if out is None:
        out = torch.empty(T, N, dtype=x.dtype, device=x.device)
    assert out.shape == (T, N) and out.dtype == x.dtype and out.stride(1) == 1, out.shape
    if T == 0:
        return out
    cfg = config or default_config(N, K)
    line_elems = L2_LINE_BYTES // weight.element_size()
    lines = triton.cdiv(K, line_elems)
    _gemv_kernel[(triton.cdiv(N, cfg.block_n),)](
        x, weight, x if bias is None else bias, out,  # (x stands in for no bias: never read)
        x.stride(0), weight.stride(0), out.stride(0),
        ROWS=T, N=N, K=K, HAS_BIAS=bias is not None, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        LINES=lines, LINES_P2=triton.next_power_of_2(lines), LINE_ELEMS=line_elems,
        ROWS_P2=triton.next_power_of_2(T), num_warps=cfg.num_warps,
        **pdl_options(x.device),
    )  # fmt: skip
    return out
