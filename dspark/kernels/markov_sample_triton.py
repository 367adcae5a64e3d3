"""One sampled slot of the Markov head in three launches: the distribution
p = softmax((U[k] + W2 W1[x[k-1]]) / T) written for verification, and x[k] drawn from it by
inversion with the row's uniform u (sample/sampler.py, `inverse_cdf`). Greedy rows (T = 0) take
the first maximal token, as markov_greedy_triton.py does, and get the T = 1 distribution
written (verification never reads it).

In PyTorch a sampled slot is about 22 launches over the vocabulary (the bias, temperature, softmax,
an fp64 cumsum, searchsorted, the greedy rows' argmax, copies); at G = 1 a sampled full block costs
1.864 ms on the H200 against 1.293 greedy. Here, with S slices of BLOCK_V columns:

  1. stats, a program per slice: the slice's logits l = (base + bias) / T into `probs` (raw for
     now), and per row their max m_s, z_s = sum exp(l - m_s) and first argmax, into [R, S].
  2. pick, a program per row: M = max m_s, slice masses w_s = z_s exp(m_s - M), Z = sum w_s;
     the first slice j whose cumulative mass exceeds u Z, then inside it the first token whose
     cumulative exp(l - M) (from the mass before j) exceeds u Z. Sums in float64, as
     inverse_cdf's. Writes the token, M and Z.
  3. normalize, a program per slice: probs = exp(l - M) / Z.

    V = 6, BLOCK_V = 2, T = 1, l = [0 0 | ln2 0 | 0 0]
    m = [0 ln2 0], z = [2 1.5 2]  ->  M = ln2, w = [1 1.5 1], Z = 3.5
    u = 0.5: u Z = 1.75; cumulative w [1 2.5 3.5] -> slice 1, 1 before it;
    inside: 1 + [2 2.5] -> the first above 1.75 is column 2   (p = [1 1 2 1 1 1] / 7)

The same token as `markov_sample_ref` up to rounding (the sums run in another order), so a
draw may differ where u Z falls within rounding of a boundary between two tokens.

The stats and the pick without the Markov bias draw plain decoding's sampled rows
(`sample_rows`, no distribution kept), where sample/sampler.py's `sample` is about ten launches.

Both run wherever they apply (on the H200 the sampled speculative step cost 0.64-0.79x the
PyTorch slot's, and a sampled plain step 0.88-0.97x): the slot in spec/drafting.py (rows
without top-k and top-p, a Markov rank the greedy kernel takes) and the rows in
sample/sampler.py (on CUDA, without top-k and top-p); DSPARK_REFERENCE_OPS keeps PyTorch's.
Under TRITON_INTERPRET=1 (CPU tensors) it runs in Triton's interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dspark.kernels.inverse_cdf import inverse_cdf
from dspark.kernels.markov_greedy_triton import (
    BLOCK_R,
    BLOCK_V,
    dot_options,
    load_w2_slice,
    markov_bias_tile,
    supports_rank,
)


def markov_sample_ref(
    base: torch.Tensor,  # [R, V] slot k's base logits
    prev: torch.Tensor,  # [R] int64, x[k-1]
    w1: torch.Tensor,  # [V, r]
    w2: torch.Tensor,  # [V, r]
    temperature: torch.Tensor,  # [R] float32, 0 = greedy
    u: torch.Tensor,  # [R, 1] float32 uniforms
) -> tuple[torch.Tensor, torch.Tensor]:  # [R] int64 tokens, [R, V] float32 probs
    """draft_block's sampled slot without top-k / top-p, in PyTorch."""
    logits = base.float() + torch.nn.functional.linear(w1[prev], w2).float()
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    probs = (logits / t[:, None]).softmax(dim=-1)
    tokens = torch.where(temperature > 0, inverse_cdf(probs, u), logits.argmax(dim=-1))
    return tokens, probs


@triton.jit
def _stats_kernel(
    base_ptr, prev_ptr, temp_ptr, w1_ptr, w2_ptr, probs_ptr, ws_max_ptr, ws_sum_ptr, ws_idx_ptr,
    num_rows, V, s_base, s_prev, s_probs,
    RANK: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
    NUM_SLICES: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):  # fmt: skip
    s = tl.program_id(0)
    cols = s * BLOCK_V + tl.arange(0, BLOCK_V)
    col_mask = cols < V
    if HAS_BIAS:
        w2 = load_w2_slice(w2_ptr, cols, col_mask, RANK, UPCAST_DOT)  # [BV, r]
    for r0 in range(0, num_rows, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        row_mask = rows < num_rows
        mask = row_mask[:, None] & col_mask[None, :]
        base = tl.load(base_ptr + rows[:, None] * s_base + cols[None, :], mask=mask, other=0.0)
        logits = base.to(tl.float32)
        if HAS_BIAS:
            logits += markov_bias_tile(prev_ptr, w1_ptr, w2, rows, row_mask, s_prev, RANK,
                                       DOT_PRECISION, UPCAST_DOT)  # fmt: skip
        t = tl.load(temp_ptr + rows, mask=row_mask, other=1.0)
        t = tl.where(t > 0, t, 1.0)
        logits = tl.where(mask, logits / t[:, None], float("-inf"))
        tl.store(probs_ptr + rows[:, None] * s_probs + cols[None, :], logits, mask=mask)
        best, arg = tl.max(logits, axis=1, return_indices=True, return_indices_tie_break_left=True)
        shift = tl.where(row_mask, best, 0.0)  # (a pad row's max is -inf)
        z = tl.sum(tl.where(mask, tl.exp(logits - shift[:, None]), 0.0), axis=1)
        at = rows * NUM_SLICES + s
        tl.store(ws_max_ptr + at, best, mask=row_mask)
        tl.store(ws_sum_ptr + at, z, mask=row_mask)
        tl.store(ws_idx_ptr + at, s * BLOCK_V + arg, mask=row_mask)


@triton.jit
def _pick_kernel(
    probs_ptr, temp_ptr, u_ptr, ws_max_ptr, ws_sum_ptr, ws_idx_ptr, out_ptr, norm_ptr,
    V, s_probs, s_u, s_out,
    BLOCK_V: tl.constexpr, NUM_SLICES: tl.constexpr, SLICES_P2: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    slices = tl.arange(0, SLICES_P2)
    in_range = slices < NUM_SLICES
    m = tl.load(ws_max_ptr + r * NUM_SLICES + slices, mask=in_range, other=float("-inf"))
    z = tl.load(ws_sum_ptr + r * NUM_SLICES + slices, mask=in_range, other=0.0)
    top = tl.max(m, axis=0)
    mass = tl.where(in_range, z.to(tl.float64) * tl.exp(m - top).to(tl.float64), 0.0)
    total = tl.sum(mass, axis=0)
    target = tl.load(u_ptr + r * s_u).to(tl.float64) * total
    cum = tl.cumsum(mass, axis=0)
    j = tl.min(tl.where((cum > target) & in_range, slices, NUM_SLICES - 1), axis=0)
    before = tl.sum(tl.where(slices < j, mass, 0.0), axis=0)
    cols = j * BLOCK_V + tl.arange(0, BLOCK_V)
    col_mask = cols < V
    logits = tl.load(probs_ptr + r * s_probs + cols, mask=col_mask, other=float("-inf"))
    weights = tl.where(col_mask, tl.exp(logits - top).to(tl.float64), 0.0)
    inside = before + tl.cumsum(weights, axis=0)
    last = tl.minimum(V, (j + 1) * BLOCK_V) - 1  # (rounding past the slice's end: its last)
    drawn = tl.min(tl.where((inside > target) & col_mask, cols, last), axis=0)
    idx = tl.load(ws_idx_ptr + r * NUM_SLICES + slices, mask=in_range, other=0)
    first_max = tl.min(tl.where((m == top) & in_range, idx, V), axis=0)  # greedy rows
    t = tl.load(temp_ptr + r)
    tl.store(out_ptr + r * s_out, tl.where(t > 0, drawn, first_max).to(tl.int64))
    tl.store(norm_ptr + 2 * r, top)
    tl.store(norm_ptr + 2 * r + 1, total.to(tl.float32))


@triton.jit
def _normalize_kernel(
    probs_ptr, norm_ptr, num_rows, V, s_probs,
    BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    s = tl.program_id(0)
    cols = s * BLOCK_V + tl.arange(0, BLOCK_V)
    col_mask = cols < V
    for r0 in range(0, num_rows, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        row_mask = rows < num_rows
        mask = row_mask[:, None] & col_mask[None, :]
        top = tl.load(norm_ptr + 2 * rows, mask=row_mask, other=0.0)
        total = tl.load(norm_ptr + 2 * rows + 1, mask=row_mask, other=1.0)
        at = probs_ptr + rows[:, None] * s_probs + cols[None, :]
        logits = tl.load(at, mask=mask, other=0.0)
        tl.store(at, tl.exp(logits - top[:, None]) / total[:, None], mask=mask)


def markov_sample(
    base: torch.Tensor,  # [R, V] slot k's base logits, rows may be strided (base[:, k])
    prev: torch.Tensor,  # [R] int64, x[k-1], may be strided (tokens[:, k - 1])
    w1: torch.Tensor,  # [V, r] markov_in.weight, contiguous
    w2: torch.Tensor,  # [V, r] markov_out.weight, contiguous, w1's dtype
    temperature: torch.Tensor,  # [R] float32, 0 = greedy
    u: torch.Tensor,  # [R, 1] float32, the rows' uniforms
    out: torch.Tensor,  # [R] int64, may be strided (tokens[:, k]): x[k]
    probs: torch.Tensor,  # [R, V] float32, may be strided (probs[:, k]): p
) -> torch.Tensor:
    """`markov_sample_ref` in three launches, written into `out` and `probs` (module docstring)."""
    R, V = base.shape
    rank = w1.shape[1]
    assert w1.shape == w2.shape == (V, rank) and w1.dtype == w2.dtype, (w1.shape, w2.shape)
    assert w1.is_contiguous() and w2.is_contiguous() and base.stride(1) == 1
    assert supports_rank(rank), f"rank {rank}: a power of two >= 16"
    assert prev.shape == out.shape == temperature.shape == (R,) and out.dtype == torch.int64
    assert probs.shape == (R, V) and probs.dtype == torch.float32 and probs.stride(1) == 1
    assert u.shape == (R, 1) and temperature.is_contiguous()
    if R == 0:
        return out
    num_slices = triton.cdiv(V, BLOCK_V)
    dev = base.device
    ws_max = torch.empty(R * num_slices, dtype=torch.float32, device=dev)
    ws_sum = torch.empty(R * num_slices, dtype=torch.float32, device=dev)
    ws_idx = torch.empty(R * num_slices, dtype=torch.int32, device=dev)
    _stats_kernel[(num_slices,)](
        base, prev, temperature, w1, w2, probs, ws_max, ws_sum, ws_idx,
        R, V, base.stride(0), prev.stride(0), probs.stride(0),
        RANK=rank, BLOCK_V=BLOCK_V, BLOCK_R=BLOCK_R, NUM_SLICES=num_slices, **dot_options(w1),
        HAS_BIAS=True,
    )  # fmt: skip
    norm = _pick(probs, temperature, u, ws_max, ws_sum, ws_idx, out, num_slices)
    _normalize_kernel[(num_slices,)](
        probs, norm, R, V, probs.stride(0), BLOCK_V=BLOCK_V, BLOCK_R=BLOCK_R,
    )  # fmt: skip
    return out


def sample_rows(
    logits: torch.Tensor,  # [N, V] float32 (plain decoding's sampled rows), rows may be strided
    temperature: torch.Tensor,  # [N] float32, 0 = greedy
    u: torch.Tensor,  # [N, 1] float32, the rows' uniforms
    out: torch.Tensor,  # [N] int64
) -> torch.Tensor:
    """sample/sampler.py's `sample` without top-k / top-p, in two launches: the stats and the
    pick above without the Markov bias; no distribution is kept."""
    N, V = logits.shape
    assert logits.stride(1) == 1 and temperature.shape == out.shape == (N,) and u.shape == (N, 1)
    assert temperature.is_contiguous() and out.dtype == torch.int64
    if N == 0:
        return out
    num_slices = triton.cdiv(V, BLOCK_V)
    dev = logits.device
    scaled = torch.empty(N, V, dtype=torch.float32, device=dev)  # logits / T, for the pick
    ws_max = torch.empty(N * num_slices, dtype=torch.float32, device=dev)
    ws_sum = torch.empty(N * num_slices, dtype=torch.float32, device=dev)
    ws_idx = torch.empty(N * num_slices, dtype=torch.int32, device=dev)
    _stats_kernel[(num_slices,)](
        logits, out, temperature, logits, logits, scaled, ws_max, ws_sum, ws_idx,
        N, V, logits.stride(0), 0, scaled.stride(0),
        RANK=16, BLOCK_V=BLOCK_V, BLOCK_R=BLOCK_R, NUM_SLICES=num_slices, DOT_PRECISION="ieee",
        UPCAST_DOT=False, HAS_BIAS=False,
    )  # fmt: skip
    _pick(scaled, temperature, u, ws_max, ws_sum, ws_idx, out, num_slices)
    return out


def _pick(probs, temperature, u, ws_max, ws_sum, ws_idx, out, num_slices) -> torch.Tensor:
    """Launch the pick over the rows; returns each row's (M, Z) for the normalization."""
    R, V = probs.shape
    norm = torch.empty(2 * R, dtype=torch.float32, device=probs.device)
    _pick_kernel[(R,)](
        probs, temperature, u, ws_max, ws_sum, ws_idx, out, norm,
        V, probs.stride(0), u.stride(0), out.stride(0),
        BLOCK_V=BLOCK_V, NUM_SLICES=num_slices, SLICES_P2=triton.next_power_of_2(num_slices),
    )  # fmt: skip
    return norm
