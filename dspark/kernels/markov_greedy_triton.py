"""One greedy slot of the Markov head in one launch: x[k] = argmax(U[k] + W2 W1[x[k-1]]).

The Markov head is the drafter's sequential stage (docs/SPECULATION.md 2.3; spec/drafting.py): slot
k's logits add a rank-r bias of the token drafted at slot k - 1 to the backbone's base logits, so
the K slots of a block are drawn one after the other. In PyTorch a greedy slot is six launches
(gather W1, the r -> V GEMM, its cast, the add, the argmax, the copy into the block), each latency-
bound at decode batch sizes; here it is one.

The vocabulary is cut into slices of BLOCK_V columns, one program each. A program loads its
slice of W2 once and, for every block of BLOCK_R rows, computes the slice's logits and their
max and first argmax into a workspace [R, slices]. The last program to count itself in (an
atomic arrival counter, as in paged_attention_triton.py) reduces the workspace row by row, the
first slice holding the row's max winning ties (torch.argmax's first maximal index):

    V = 6, BLOCK_V = 2, one row: logits [1 5 | 5 2 | 0 3]
    workspace max [5 5 3], argmax [1 2 5]  ->  max 5, slices 0 and 1 hold it  ->  token 1

Rounding follows `DSparkDrafter.markov_bias` + the add in `draft_block`: the bias is rounded
to the weights' dtype (the bf16 GEMM's output) and then added in float32 to the base logits
(exact in float32 from bf16). So the result equals the PyTorch path up to the order of the r
float32 additions of the bias.

Under TRITON_INTERPRET=1 (CPU tensors) it runs in Triton's interpreter; set the variable before
this module is imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 128  # vocabulary columns per program: 384 programs for SmolLM2's 49,152
BLOCK_R = 16  # rows per tile (tl.dot needs at least 16)


_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}  # per device, smallest first


def arrival_counters(device: torch.device, num_tiles: int) -> torch.Tensor:  # [>= tiles] int32
    """The device's arrival counters (the last program of a launch does the final pick), all
    zero between launches: each launch resets the ones it used. Allocated on first use, so a
    CUDA graph's warm-up run creates them outside the capture. A larger buffer is added when
    one is needed and the old ones are kept: a captured graph may still point at them."""
    buffers = _COUNTERS.setdefault(device, [])
    if not buffers or buffers[-1].numel() < num_tiles:
        buffers.append(torch.zeros(max(4096, num_tiles), dtype=torch.int32, device=device))
    return buffers[-1]


def dot_options(x: torch.Tensor) -> dict:
    """fp32 dots in full precision (not tf32). On the CPU, Triton's interpreter computes tl.dot
    on bf16 as raw integers, so there the tiles are upcast to float32 first."""
    is_fp32, is_interpreted = x.dtype == torch.float32, x.device.type == "cpu"
    return {"DOT_PRECISION": "ieee" if is_fp32 or is_interpreted else "tf32",
            "UPCAST_DOT": is_interpreted and not is_fp32}  # fmt: skip


def supports_rank(rank: int) -> bool:
    """The kernel's tl.dot over the rank needs a power of two >= 16 (64 in the shipped drafter)."""
    return rank >= 16 and rank & (rank - 1) == 0


def markov_greedy_ref(
    base: torch.Tensor,  # [R, V] slot k's base logits (any float dtype)
    prev: torch.Tensor,  # [R] int64, x[k-1]
    w1: torch.Tensor,  # [V, r] markov_in.weight
    w2: torch.Tensor,  # [V, r] markov_out.weight
) -> torch.Tensor:  # [R] int64
    bias = torch.nn.functional.linear(w1[prev], w2).float()  # [R, V]
    return (base.float() + bias).argmax(dim=-1)


@triton.jit
def load_w2_slice(w2_ptr, cols, col_mask, RANK: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """W2's rows for a slice of vocabulary columns: [BLOCK_V, r] (float32 in the interpreter,
    whose tl.dot on bf16 computes on raw integers)."""
    ranks = tl.arange(0, RANK)
    w2 = tl.load(w2_ptr + cols[:, None] * RANK + ranks[None, :], mask=col_mask[:, None],
                 other=0.0)  # fmt: skip
    if UPCAST_DOT:
        w2 = w2.to(tl.float32)
    return w2


@triton.jit
def markov_bias_tile(
    prev_ptr, w1_ptr, w2, rows, row_mask, s_prev,
    RANK: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):  # fmt: skip
    """The Markov bias W2 W1[x[k-1]] of a tile of rows over w2's columns: [BLOCK_R, BLOCK_V]
    float32, rounded to the weights' dtype as the PyTorch GEMM's output is."""
    ranks = tl.arange(0, RANK)
    prev = tl.load(prev_ptr + rows * s_prev, mask=row_mask, other=0)
    e = tl.load(w1_ptr + prev[:, None] * RANK + ranks[None, :], mask=row_mask[:, None],
                other=0.0)  # [BR, r]  # fmt: skip
    if UPCAST_DOT:
        e = e.to(tl.float32)
    bias = tl.dot(e, tl.trans(w2), input_precision=DOT_PRECISION)  # [BR, BV] float32
    return bias.to(w1_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _markov_greedy_kernel(
    base_ptr, prev_ptr, w1_ptr, w2_ptr, out_ptr, ws_max_ptr, ws_idx_ptr, counter_ptr,
    num_rows, V, s_base, s_prev, s_out,
    RANK: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
    NUM_SLICES: tl.constexpr, SLICES_P2: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):  # fmt: skip
    s = tl.program_id(0)
    cols = s * BLOCK_V + tl.arange(0, BLOCK_V)
    col_mask = cols < V
    w2 = load_w2_slice(w2_ptr, cols, col_mask, RANK, UPCAST_DOT)  # [BV, r]
    for r0 in range(0, num_rows, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        row_mask = rows < num_rows
        bias = markov_bias_tile(prev_ptr, w1_ptr, w2, rows, row_mask, s_prev, RANK,
                                DOT_PRECISION, UPCAST_DOT)  # fmt: skip
        mask = row_mask[:, None] & col_mask[None, :]
        base = tl.load(base_ptr + rows[:, None] * s_base + cols[None, :], mask=mask, other=0.0)
        logits = tl.where(mask, base.to(tl.float32) + bias, float("-inf"))
        best, arg = tl.max(logits, axis=1, return_indices=True, return_indices_tie_break_left=True)
        tl.store(ws_max_ptr + rows * NUM_SLICES + s, best, mask=row_mask)
        tl.store(ws_idx_ptr + rows * NUM_SLICES + s, s * BLOCK_V + arg, mask=row_mask)
    # Count this slice in; the last one reduces. The barrier puts every thread's stores before
    # the atomic, whose release publishes them device-wide; the reads bypass L1 (".cg").
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == NUM_SLICES - 1:
        tl.store(counter_ptr, 0)  # ready for the next launch (stream-ordered)
        slices = tl.arange(0, SLICES_P2)
        for r0 in range(0, num_rows, BLOCK_R):
            rows = r0 + tl.arange(0, BLOCK_R)
            row_mask = rows < num_rows
            mask = row_mask[:, None] & (slices[None, :] < NUM_SLICES)
            at = rows[:, None] * NUM_SLICES + slices[None, :]
            maxes = tl.load(ws_max_ptr + at, mask=mask, other=float("-inf"), cache_modifier=".cg")
            idx = tl.load(ws_idx_ptr + at, mask=mask, other=0, cache_modifier=".cg")
            best = tl.max(maxes, axis=1)
            first = tl.min(tl.where(maxes == best[:, None], idx, V), axis=1)  # earliest slice
            tl.store(out_ptr + rows * s_out, first.to(tl.int64), mask=row_mask)


def markov_greedy(
    base: torch.Tensor,  # [R, V] slot k's base logits, rows may be strided (base[:, k])
    prev: torch.Tensor,  # [R] int64, x[k-1], may be strided (tokens[:, k - 1])
    w1: torch.Tensor,  # [V, r] markov_in.weight, contiguous
    w2: torch.Tensor,  # [V, r] markov_out.weight, contiguous, w1's dtype
    out: torch.Tensor,  # [R] int64, may be strided (tokens[:, k]): x[k]
) -> torch.Tensor:
    """`markov_greedy_ref` in one launch, written into `out` (see the module docstring)."""
    R, V = base.shape
    rank = w1.shape[1]
    assert w1.shape == w2.shape == (V, rank) and w1.dtype == w2.dtype, (w1.shape, w2.shape)
    assert w1.is_contiguous() and w2.is_contiguous() and base.stride(1) == 1
    assert supports_rank(rank), f"rank {rank}: a power of two >= 16"
    assert prev.shape == out.shape == (R,) and out.dtype == torch.int64
    if R == 0:
        return out
    num_slices = triton.cdiv(V, BLOCK_V)
    ws_max = torch.empty(R * num_slices, dtype=torch.float32, device=base.device)
    ws_idx = torch.empty(R * num_slices, dtype=torch.int32, device=base.device)
    _markov_greedy_kernel[(num_slices,)](
        base, prev, w1, w2, out, ws_max, ws_idx, arrival_counters(base.device, 1),
        R, V, base.stride(0), prev.stride(0), out.stride(0),
        RANK=rank, BLOCK_V=BLOCK_V, BLOCK_R=BLOCK_R, NUM_SLICES=num_slices,
        SLICES_P2=triton.next_power_of_2(num_slices),
        **dot_options(w1),
    )  # fmt: skip
    return out
