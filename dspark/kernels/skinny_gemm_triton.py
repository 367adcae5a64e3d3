"""The skinny GEMM core: tiles, the two inner products and split-K shared by the skinny kernels
(skinny_linear_triton.py, skinny_qkv_rotary_triton.py, skinny_gate_up_silu_triton.py), for
T <= 16 token rows of prologue(x) against W [N, K] (nn.Linear's layout).

Grid: (column blocks of BLOCK_N, K splits). A program owns output columns pid * BLOCK_N .. of
one K part; the norm's row statistics come from one pass over the row first (a few KB, read from
L2 by every program). The part's BLOCK_K chunks are unrolled (K is a compile-time constant), so
every chunk's weight loads can be in flight at once: at these sizes a program's whole W slice
is 4-24 KB, and one memory latency per program, not one per chunk, is the goal.

Two inner products:
- T = 1 (decode at batch 1; SkinnyConfig.use_gemv): a GEMV, a [BLOCK_N, BLOCK_K] tile of
  per-lane products accumulated in W's load layout and summed over K once at the end. Each
  program builds prologue(x) for its one row only. Padded to 16 rows for tl.dot, every
  column-block program would rebuild it 16 times over (the silu_mul prologue's loop then
  compiles to ~1,600 SASS instructions per 128-column chunk: an exp and an IEEE division per
  element of the 16 rows).
- T >= 2: tl.dot on the rows padded to 16 (tensor cores need M >= 16; the padding costs MACs,
  which are free here, and prologue work, which the rows fill as T grows).

SPLIT_K > 1 cuts K into BLOCK_K-aligned parts (none empty): every part writes its float32
partial sum to a workspace and counts itself in on a per-column-block arrival counter; the last
part to arrive adds the partials in split order (deterministic) and writes the output, then
resets its counter to zero for the next launch. Launches on one stream never overlap, so one
counter buffer per device serves all of them (split-K kernels running at once on two streams
would each need their own). default_config splits when there are too few column blocks to
occupy an H200 (N 576 -> 36 blocks): a guess until bench/kernels_skinny.py sweeps it.

Under TRITON_INTERPRET=1 (CPU tensors) the kernels run in Triton's interpreter; set the
variable before this module is imported.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

SKINNY_MAX_ROWS = 16  # token rows per launch: tl.dot's smallest M, the rows are padded to it
PROLOGUES = ("none", "rmsnorm", "add_rmsnorm", "silu_mul")


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int = 16  # output columns per program (a power of two >= 16)
    block_k: int = 64  # reduction chunk (a power of two >= 16)
    split_k: int = 1  # at most this many K parts per column block (fewer if parts are empty)
    num_warps: int = 4
    use_gemv: bool = True  # T = 1 runs the GEMV; False: tl.dot on 16 padded rows


def default_config(n: int, k: int, device_type: str = "cuda") -> SkinnyConfig:
    """Column blocks of 16 and enough K splits for ~128 programs (an H200 has 132 SMs):
    N 3072 -> 192 blocks, no split; N 960 -> 60 blocks, 3 splits; N 576 -> 36 blocks, 4 splits.
    The CPU never splits (the interpreter runs programs one after another). BLOCK_K: the largest
    power of two up to 128 that divides K (576 -> 64, 1536 -> 128), so no chunk is half masked.
    Untuned: bench/kernels_skinny.py sweeps the fields."""
    block_k = next((b for b in (128, 64, 32, 16) if k % b == 0), 128)
    split_k = max(1, min(8, triton.cdiv(128, triton.cdiv(n, 16))))
    return SkinnyConfig(block_k=block_k, split_k=split_k if device_type == "cuda" else 1)


@dataclass(frozen=True)
class LaunchPlan:
    """A config resolved for one call: the constexprs every skinny kernel takes."""

    block_t: int  # rows per program: 1 (GEMV) or T padded to 16 (tl.dot)
    use_dot: bool
    num_splits: int
    split_part: int  # K columns per split, a multiple of BLOCK_K


def launch_plan(config: SkinnyConfig, num_rows: int, k: int) -> LaunchPlan:
    """K 576, BLOCK_K 64, split_k 4: part cdiv(144, 64) * 64 = 192 -> 3 splits [0, 192)
    [192, 384) [384, 576). K 1536, BLOCK_K 128, split_k 4: part 384 -> 4 splits."""
    check_config(config)
    part = triton.cdiv(triton.cdiv(k, config.split_k), config.block_k) * config.block_k
    use_dot = not (config.use_gemv and num_rows == 1)
    return LaunchPlan(SKINNY_MAX_ROWS if use_dot else 1, use_dot, triton.cdiv(k, part), part)


# -- device pieces ---------------------------------------------------------------------------


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
    sum_sq = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)  # per-lane sums, reduced once
    for k0 in tl.static_range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        mask = row_mask[:, None] & (cols < K)[None, :]
        h = _stream_tile(x_ptr, res_ptr, rows, cols, mask, s_x, s_res, HAS_RESIDUAL)
        if HAS_RESIDUAL:
            dst = res_out_ptr + rows[:, None] * s_res_out + cols[None, :]
            tl.store(dst, h.to(res_out_ptr.dtype.element_ty), mask=write_mask[:, None] & mask)
        sum_sq += h * h
    return tl.rsqrt(tl.sum(sum_sq, axis=1) / K + eps)


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
def _load_w(w_ptr, cols, col_mask, s_w, k0, K: tl.constexpr, BLOCK_K: tl.constexpr):
    # Rows `cols` of W [N, K], columns k0 .. k0 + BLOCK_K: [BN, BK] in W's dtype.
    k = k0 + tl.arange(0, BLOCK_K)
    mask = col_mask[:, None] & (k < K)[None, :]
    return tl.load(w_ptr + cols[:, None].to(tl.int64) * s_w + k[None, :], mask=mask, other=0.0)


@triton.jit
def _acc_zeros(BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, USE_DOT: tl.constexpr):
    # tl.dot accumulates [BT, BN]; the GEMV (BT 1) keeps every lane's products apart,
    # [BN, BK] in W's load layout, and sums over K once at the end (_acc_total).
    if USE_DOT:
        acc = tl.zeros([BT, BN], dtype=tl.float32)
    else:
        acc = tl.zeros([BN, BK], dtype=tl.float32)
    return acc


@triton.jit
def _mac(acc, a, w, USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
         UPCAST_DOT: tl.constexpr):  # fmt: skip
    # acc += a [BT, BK] @ w [BN, BK]^T in float32 (products of bf16 values are exact).
    if USE_DOT:
        if UPCAST_DOT:  # the interpreter's tl.dot on bf16 computes on raw integers
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, tl.trans(w), acc, input_precision=DOT_PRECISION)
    else:  # a is one row: [1, BK] -> [BK], broadcast over W's rows
        acc += w.to(tl.float32) * tl.sum(a.to(tl.float32), axis=0)[None, :]
    return acc


@triton.jit
def _acc_total(acc, USE_DOT: tl.constexpr):  # -> [BT, BN]
    if not USE_DOT:
        acc = tl.sum(acc, axis=1)[None, :]
    return acc


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


@triton.jit
def _paired_gemm(
    x_ptr, res_ptr, norm_w_ptr, w_ptr, rows, row_mask, s_x, s_res, s_w, rstd, cols1, cols2,
    col_mask, split,
    K: tl.constexpr, PROLOGUE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SPLIT_PART: tl.constexpr, USE_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):  # fmt: skip
    # prologue(x) @ W[cols1]^T and @ W[cols2]^T over this split's part of K, two [BT, BN]: for
    # epilogues that combine two column blocks (rotary's head halves, SiLU's gate and up).
    acc1 = _acc_zeros(BLOCK_T, BLOCK_N, BLOCK_K, USE_DOT)
    acc2 = _acc_zeros(BLOCK_T, BLOCK_N, BLOCK_K, USE_DOT)
    for i in tl.static_range(SPLIT_PART // BLOCK_K):  # unrolled: all loads can be in flight
        k0 = split * SPLIT_PART + i * BLOCK_K
        a = _input_tile(x_ptr, res_ptr, norm_w_ptr, rows, row_mask, s_x, s_res, k0, rstd,
                        K, BLOCK_K, PROLOGUE)  # fmt: skip
        w1 = _load_w(w_ptr, cols1, col_mask, s_w, k0, K, BLOCK_K)
        w2 = _load_w(w_ptr, cols2, col_mask, s_w, k0, K, BLOCK_K)
        acc1 = _mac(acc1, a, w1, USE_DOT, DOT_PRECISION, UPCAST_DOT)
        acc2 = _mac(acc2, a, w2, USE_DOT, DOT_PRECISION, UPCAST_DOT)
    return _acc_total(acc1, USE_DOT), _acc_total(acc2, USE_DOT)


@triton.jit
def _reduce_pair(acc1, acc2, ws_ptr, counter_ptr, tile, split, BT: tl.constexpr,
                 BN: tl.constexpr, SPLIT_K: tl.constexpr):  # fmt: skip
    # Split-K of a pair: partial tiles 2 tile and 2 tile + 1, one arrival counter per pair.
    # Returns (is_last, acc1, acc2), the sums over all splits for the last one to arrive.
    _store_partial(acc1, ws_ptr, 2 * tile, split, BT, BN, SPLIT_K)
    _store_partial(acc2, ws_ptr, 2 * tile + 1, split, BT, BN, SPLIT_K)
    is_last = _is_last_split(counter_ptr, tile, SPLIT_K)
    if is_last:
        acc1 = _sum_partials(ws_ptr, 2 * tile, BT, BN, SPLIT_K)
        acc2 = _sum_partials(ws_ptr, 2 * tile + 1, BT, BN, SPLIT_K)
        tl.atomic_xchg(counter_ptr + tile, 0)  # zero again for the next launch
    return is_last, acc1, acc2


# -- host pieces -----------------------------------------------------------------------------

_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}  # per device, smallest first


def arrival_counters(device: torch.device, num_tiles: int) -> torch.Tensor:  # [>= tiles] int32
    """The device's split-K arrival counters, all zero between launches (each launch resets the
    ones it used). Allocated on first use, so a CUDA graph's warm-up run creates them outside
    the capture. A larger buffer is added when one is needed and the old ones are kept: a
    captured graph may still point at them."""
    buffers = _COUNTERS.setdefault(device, [])
    if not buffers or buffers[-1].numel() < num_tiles:
        buffers.append(torch.zeros(max(4096, num_tiles), dtype=torch.int32, device=device))
    return buffers[-1]


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


def plan_constants(plan: LaunchPlan) -> dict:
    return {"BLOCK_T": plan.block_t, "USE_DOT": plan.use_dot, "SPLIT_K": plan.num_splits,
            "SPLIT_PART": plan.split_part}  # fmt: skip


def split_buffers(
    num_tiles: int, block_n: int, plan: LaunchPlan, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(workspace [tiles, splits, BLOCK_T, block_n] float32 flat, arrival counters [>= tiles])
    for split-K; without it 1-element placeholders, which the kernel never touches."""
    if plan.num_splits == 1:
        placeholder = torch.empty(1, dtype=torch.float32, device=device)
        return placeholder, placeholder
    size = num_tiles * plan.num_splits * plan.block_t * block_n
    workspace = torch.empty(size, dtype=torch.float32, device=device)
    return workspace, arrival_counters(device, num_tiles)
