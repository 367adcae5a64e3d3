"""Skinny linear layers: y = prologue(x) @ W^T for a few token rows (T <= 16), in one launch.

At decode batch sizes a decoder layer is latency bound: every eager op and every cuBLAS GEMM is
a launch of a few microseconds that moves little data. These kernels fold the elementwise op in
front of each projection into the GEMM's load of its input, so a layer's norm + qkv, norm +
gate_up and silu_mul + down are one launch each:

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

Grid: (column blocks of BLOCK_N, SPLIT_K). A program owns output columns pid * BLOCK_N ..; it
walks K in BLOCK_K chunks, building each chunk of the GEMM input on the fly (the norm's row
statistics come from one pass over the row first: the rows are a few KB, read from L2 by every
program). The rows are padded to 16 and multiplied with tl.dot: tensor cores need M >= 16, and
the padding is free since the kernel is bound by reading W, not by MACs. A broadcast-multiply-sum
would be as good at T = 1, but at T = 16 it needs a [T, BLOCK_N, BLOCK_K] product in registers
(or re-reads W once per row); tl.dot reuses each W tile across all rows with one code path for
every T <= 16. Padding rows are masked on load (zeros) and never stored.

SPLIT_K > 1 cuts each column block's K range into parts: every part writes its float32 partial
sum to a workspace and counts itself in on a per-column-block arrival counter; the last part to
arrive adds the partials in split order (deterministic) and writes the output, then resets its
counter to zero for the next launch. Launches on one stream never overlap, so one counter
buffer per device serves all of them (split-K kernels running at once on two streams would each
need their own). The defaults keep SPLIT_K 1 until a sweep on the GPU shows it pays.

Under TRITON_INTERPRET=1 (CPU tensors) it runs in Triton's interpreter; set the variable before
this module is imported.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from dspark.kernels.rmsnorm_triton import fused_add_rmsnorm_ref, rmsnorm_ref
from dspark.kernels.silu_mul_triton import silu_and_mul_ref

SKINNY_MAX_ROWS = 16  # token rows per launch: tl.dot's smallest M, the rows are padded to it
PROLOGUES = ("none", "rmsnorm", "add_rmsnorm", "silu_mul")


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int = 16  # output columns per program (a power of two >= 16)
    block_k: int = 128  # reduction chunk (a power of two >= 16)
    split_k: int = 1  # programs sharing one column block's reduction
    num_warps: int = 4
    num_stages: int = 3  # software pipelining of the K loop (compiled only)


def default_config(n: int, k: int) -> SkinnyConfig:
    """Enough programs to keep an H200's 132 SMs reading W: N 3072 -> BLOCK_N 32, 96 programs;
    N 960 -> 16, 60 programs; N 576 -> 16, 36 programs. Untuned beyond that (see
    bench/kernels_skinny.py for the sweep)."""
    block_n = 32 if triton.cdiv(n, 32) >= 64 else 16
    return SkinnyConfig(block_n=block_n, block_k=min(128, max(16, triton.next_power_of_2(k))))


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


# -- kernel pieces (shared with skinny_qkv_rotary_triton.py) ---------------------------------


@triton.jit
def _stream_tile(x_ptr, res_ptr, rows, cols, mask, s_x, s_res, HAS_RESIDUAL: tl.constexpr):
    # The residual stream x (+ residual) as float32 values rounded to x's dtype: [BT, BK].
    h = tl.load(x_ptr + rows[:, None] * s_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + rows[:, None] * s_res + cols[None, :], mask=mask, other=0.0)
        h = (h.to(tl.float32) + res.to(tl.float32)).to(x_ptr.dtype.element_ty)
    return h.to(tl.float32)


@triton.jit
def _row_rstd(
    x_ptr, res_ptr, res_out_ptr, rows, row_mask, s_x, s_res, s_res_out, eps, write_mask,
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):  # fmt: skip
    # 1 / rms of each row of the stream, float32 [BT], summed chunk by chunk then divided (as
    # rmsnorm_triton does, up to summation order). It also stores the stream (the new residual)
    # to res_out in the rows of write_mask [BT]: all rows in one program, none in the others.
    sum_sq = tl.zeros([BLOCK_T], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        mask = row_mask[:, None] & (cols < K)[None, :]
        h = _stream_tile(x_ptr, res_ptr, rows, cols, mask, s_x, s_res, HAS_RESIDUAL)
        if HAS_RESIDUAL:
            dst = res_out_ptr + rows[:, None] * s_res_out + cols[None, :]
            tl.store(dst, h.to(res_out_ptr.dtype.element_ty), mask=write_mask[:, None] & mask)
        sum_sq += tl.sum(h * h, axis=1)
    return tl.rsqrt(sum_sq / K + eps)


@triton.jit
def _input_tile(
    x_ptr, res_ptr, norm_w_ptr, rows, row_mask, s_x, s_res, k0, rstd,
    K: tl.constexpr, BLOCK_K: tl.constexpr, PROLOGUE: tl.constexpr,
):  # fmt: skip
    # Columns k0 .. k0 + BLOCK_K of the GEMM input prologue(x), in x's dtype: [BT, BK].
    dtype = x_ptr.dtype.element_ty
    cols = k0 + tl.arange(0, BLOCK_K)
    mask = row_mask[:, None] & (cols < K)[None, :]
    if PROLOGUE == "none":
        a = tl.load(x_ptr + rows[:, None] * s_x + cols[None, :], mask=mask, other=0.0)
    elif PROLOGUE == "silu_mul":  # x row = [gate (K) | up (K)]
        gate_ptr = x_ptr + rows[:, None] * s_x + cols[None, :]
        gate = tl.load(gate_ptr, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gate_ptr + K, mask=mask, other=0.0).to(tl.float32)
        silu = tl.div_rn(gate, 1.0 + tl.exp(-gate)).to(dtype).to(tl.float32)
        a = (silu * up).to(dtype)
    else:  # the norms: rmsnorm(stream) * norm_weight
        h = _stream_tile(x_ptr, res_ptr, rows, cols, mask, s_x, s_res, PROLOGUE == "add_rmsnorm")
        w = tl.load(norm_w_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
        a = (w[None, :] * (h * rstd[:, None]).to(dtype).to(tl.float32)).to(dtype)
    return a


@triton.jit
def _split_range(split, K: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    # Split s reduces columns [lo, hi) of K, cut in BLOCK_K-aligned parts.
    # K 1536, BLOCK_K 128, SPLIT_K 4: part 384 -> [0, 384) [384, 768) [768, 1152) [1152, 1536)
    # K 576, BLOCK_K 128, SPLIT_K 4: part 256 -> [0, 256) [256, 512) [512, 576) [768, 576)
    # (the last split is empty: it adds a zero partial but still counts itself in)
    part = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    lo = split * part
    return lo, tl.minimum(lo + part, K)


@triton.jit
def _store_partial(acc, ws_ptr, tile, split, BT: tl.constexpr, BN: tl.constexpr,
                   SPLIT_K: tl.constexpr):  # fmt: skip
    # This split's float32 partial [BT, BN] of output tile `tile`; workspace [tiles, SPLIT_K,
    # BT, BN]. Tile 2, split 1, SPLIT_K 4: partial index 2 * 4 + 1 = 9.
    idx = tl.arange(0, BT)[:, None] * BN + tl.arange(0, BN)[None, :]
    tl.store(ws_ptr + (tile * SPLIT_K + split) * BT * BN + idx, acc)


@triton.jit
def _is_last_split(counter_ptr, counter, SPLIT_K: tl.constexpr):
    # Count this split in after its partials; True for the last of the SPLIT_K to arrive. The
    # barrier orders every thread's partial stores before the (one-thread, release) increment.
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr + counter, 1, sem="acq_rel")
    return arrived == SPLIT_K - 1


@triton.jit
def _sum_partials(ws_ptr, tile, BT: tl.constexpr, BN: tl.constexpr, SPLIT_K: tl.constexpr):
    # The last split: the tile's partials added in split order (deterministic). .cg loads read
    # L2, where the other SMs' stores landed (never a stale L1 line).
    idx = tl.arange(0, BT)[:, None] * BN + tl.arange(0, BN)[None, :]
    total = tl.zeros([BT, BN], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        total += tl.load(ws_ptr + (tile * SPLIT_K + s) * BT * BN + idx, cache_modifier=".cg")
    return total


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
    SPLIT_K: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
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
    lo, hi = _split_range(split, K, BLOCK_K, SPLIT_K)
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    for k0 in range(lo, hi, BLOCK_K):
        a = _input_tile(x_ptr, res_ptr, norm_w_ptr, rows, row_mask, s_x, s_res, k0, rstd,
                        K, BLOCK_K, PROLOGUE)  # fmt: skip
        k = k0 + tl.arange(0, BLOCK_K)
        w_mask = col_mask[:, None] & (k < K)[None, :]
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * s_w + k[None, :], mask=w_mask, other=0.0)
        if UPCAST_DOT:  # exact: float32 holds bf16 products; same float32 accumulation
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, tl.trans(w), acc, input_precision=DOT_PRECISION)  # [BT, BN]
    if SPLIT_K == 1:
        _store_output(acc, bias_ptr, out_ptr, s_out, rows, row_mask, cols, col_mask, HAS_BIAS)
    else:
        _store_partial(acc, ws_ptr, pid_n, split, BLOCK_T, BLOCK_N, SPLIT_K)
        if _is_last_split(counter_ptr, pid_n, SPLIT_K):
            acc = _sum_partials(ws_ptr, pid_n, BLOCK_T, BLOCK_N, SPLIT_K)
            _store_output(acc, bias_ptr, out_ptr, s_out, rows, row_mask, cols, col_mask, HAS_BIAS)
            tl.atomic_xchg(counter_ptr + pid_n, 0)  # zero again for the next launch


# -- launch ----------------------------------------------------------------------------------

_COUNTERS: dict[torch.device, torch.Tensor] = {}


def arrival_counters(device: torch.device, num_tiles: int) -> torch.Tensor:  # [>= tiles] int32
    """The device's split-K arrival counters, all zero between launches (each launch resets the
    ones it used). Allocated on first use, so a CUDA graph's warm-up run creates them outside
    the capture."""
    counters = _COUNTERS.get(device)
    if counters is None or counters.numel() < num_tiles:
        counters = torch.zeros(max(4096, num_tiles), dtype=torch.int32, device=device)
        _COUNTERS[device] = counters
    return counters


def check_config(config: SkinnyConfig) -> None:
    for name in ("block_n", "block_k"):
        value = getattr(config, name)
        if value < 16 or value != triton.next_power_of_2(value):
            raise ValueError(f"{name} {value} must be a power of two >= 16 (tl.dot's minimum)")
    if config.split_k < 1:
        raise ValueError(f"split_k {config.split_k} must be >= 1")


def dot_options(x: torch.Tensor) -> dict:
    """fp32 dots in full precision (not tf32). On the CPU, Triton's interpreter computes tl.dot
    on bf16 as raw integers, so there the tiles are upcast to float32 first."""
    is_fp32, is_interpreted = x.dtype == torch.float32, x.device.type == "cpu"
    return {"DOT_PRECISION": "ieee" if is_fp32 or is_interpreted else "tf32",
            "UPCAST_DOT": is_interpreted and not is_fp32}  # fmt: skip


def split_buffers(
    num_tiles: int, block_n: int, split_k: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(workspace [tiles, split_k, 16, block_n] float32 flat, arrival counters [>= tiles]) for
    split-K; without it 1-element placeholders, which the kernel never touches."""
    if split_k == 1:
        placeholder = torch.empty(1, dtype=torch.float32, device=device)
        return placeholder, placeholder
    size = num_tiles * split_k * SKINNY_MAX_ROWS * block_n
    workspace = torch.empty(size, dtype=torch.float32, device=device)
    return workspace, arrival_counters(device, num_tiles)


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
    config = config or default_config(N, K)
    check_config(config)
    num_tiles = triton.cdiv(N, config.block_n)
    dummy = x  # stands in for absent optional tensors (their loads are compiled out)
    res_out = dummy if residual_out is None else residual_out
    _skinny_linear_kernel[(num_tiles, config.split_k)](
        x, dummy if residual is None else residual, dummy if norm_weight is None else norm_weight,
        weight, dummy if bias is None else bias, out, res_out,
        *split_buffers(num_tiles, config.block_n, config.split_k, x.device),
        T, x.stride(0), 0 if residual is None else residual.stride(0), weight.stride(0),
        out.stride(0), res_out.stride(0), eps,
        N=N, K=K, PROLOGUE=prologue, HAS_BIAS=bias is not None,
        BLOCK_T=SKINNY_MAX_ROWS, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        SPLIT_K=config.split_k, **dot_options(x),
        num_warps=config.num_warps, num_stages=config.num_stages,
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
