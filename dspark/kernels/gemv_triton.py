"""y = x @ W^T (+ bias) for a few token rows (T <= GEMV_MAX_ROWS): the decoder layer's
projections at small decode batches.

At T = 1 a SmolLM2 projection moves 1-4 MB of weights and is latency bound: cuBLAS took 3.9 us
a call in the decode step and 5.6 us in a chain of projections with cold weights, where this
kernel takes 3.3 us, and 2.4 us launched with PDL (bench/pdl_chain.py, docs/PERFORMANCE.md,
fifteenth look). Each program owns BLOCK_N output columns (rows of W) and walks all of K, so
there is no split-K workspace and no second pass. Before it waits for the kernel ahead of it
(kernels/pdl.py) it prefetches its W rows into L2: the weights do not depend on that kernel,
so their first HBM round trip overlaps it.

    W [N, K] (nn.Linear's layout), x [T, K]; program p computes out[:, p*BN : (p+1)*BN]:
        acc[t, n] = sum over k-blocks of sum_k x[t, k] * W[n, k]     (float32)

The sum runs in float32 over BLOCK_K-wide blocks, so the result equals F.linear's up to the
order of float32 additions.

Under TRITON_INTERPRET=1 (CPU tensors) it runs in Triton's interpreter; set the variable before
this module is imported.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dspark.kernels.pdl import gdc_enter, pdl_options

GEMV_MAX_ROWS = 8  # token rows the kernel takes
# Rows up to which it beats cuBLAS, and so the rows at which the model's projections take it:
# at T = 8 it took 9-31 us a call where cuBLAS took 4-7 (bench/pdl_chain.py, H200), because
# its [T, BLOCK_N, BLOCK_K] product tile reduces one row at a time.
GEMV_FASTER_UP_TO = 1
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
def _gemv_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, num_rows, s_x, s_w, s_out,
    N: tl.constexpr, K: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    LINES: tl.constexpr, LINES_P2: tl.constexpr, LINE_ELEMS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # output columns = rows of W
    col_mask = cols < N
    if PDL:  # the weights do not depend on the kernel ahead: fetch them while it runs
        _prefetch_rows_l2(w_ptr, cols, s_w, N, LINES, LINES_P2, LINE_ELEMS)
    gdc_enter(PDL)
    rows = tl.arange(0, BLOCK_T)
    row_mask = rows < num_rows
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):  # unrolled: all loads can be in flight
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = tl.load(x_ptr + rows[:, None] * s_x + ks[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)  # [BT, BK]
        w = tl.load(w_ptr + cols[:, None] * s_w + ks[None, :],
                    mask=col_mask[:, None] & k_mask[None, :], other=0.0)  # [BN, BK]
        prod = x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]  # [BT, BN, BK]
        acc += tl.sum(prod, axis=2)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    dst = out_ptr + rows[:, None] * s_out + cols[None, :]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@dataclass(frozen=True)
class GemvConfig:
    block_n: int  # output columns a program
    block_k: int  # the K block of one step of a program's unrolled walk
    num_warps: int


def default_config(N: int, K: int, block_t: int) -> GemvConfig:
    """From the H200 sweep at T = 1 (bench/pdl_chain.py, launched with PDL, one shape's chain
    of 120): all of K in one unrolled step up to 1,024 (576 -> one block of 1,024: qkv 1.68 us
    against 2.37 in blocks of 256; fewer, wider steps beat less padding), 4 columns a program,
    2 where K is longer (down, K 1,536: 2.21 us), two warps."""
    block_n = 2 if K > 1024 else 4
    block_k = min(triton.next_power_of_2(K), max(32, 1024 // block_t))
    return GemvConfig(block_n, block_k, 2)


def gemv(
    x: torch.Tensor,  # [T, K], T <= GEMV_MAX_ROWS, rows may be strided, last dim contiguous
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    *,
    out: torch.Tensor | None = None,  # [T, N], rows may be strided; None: a new tensor
    config: GemvConfig | None = None,  # None: default_config (benchmarks sweep others)
) -> torch.Tensor:  # [T, N], x's dtype
    """F.linear(x, weight, bias) in one launch for a few token rows."""
    T, (N, K) = x.shape[0], weight.shape
    assert x.dim() == 2 and x.shape[1] == K, (x.shape, weight.shape)
    assert T <= GEMV_MAX_ROWS, f"{T} rows: the GEMV takes at most {GEMV_MAX_ROWS}"
    assert x.stride(1) == 1 and weight.stride(1) == 1 and x.dtype == weight.dtype
    assert bias is None or (bias.is_contiguous() and bias.shape == (N,)), bias
    if out is None:
        out = torch.empty(T, N, dtype=x.dtype, device=x.device)
    assert out.shape == (T, N) and out.dtype == x.dtype and out.stride(1) == 1, out.shape
    if T == 0:
        return out
    block_t = triton.next_power_of_2(T)
    cfg = config or default_config(N, K, block_t)
    line_elems = L2_LINE_BYTES // weight.element_size()
    lines = triton.cdiv(K, line_elems)
    _gemv_kernel[(triton.cdiv(N, cfg.block_n),)](
        x, weight, weight if bias is None else bias, out, T,
        x.stride(0), weight.stride(0), out.stride(0),
        N=N, K=K, HAS_BIAS=bias is not None, BLOCK_T=block_t, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, LINES=lines, LINES_P2=triton.next_power_of_2(lines),
        LINE_ELEMS=line_elems, num_warps=cfg.num_warps, **pdl_options(x.device),
    )  # fmt: skip
    return out
