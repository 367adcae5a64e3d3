"""The counter-based uniforms of sample/random.py in one launch, bit for bit.

`uniform(seeds, positions, stream, num)` hashes each row's (seed, position, stream) into a key
and each (key, index) into 24 random bits. In PyTorch that is about forty elementwise launches,
however small the tensors: on a decode step of one request the hash costs more host time than
the GPU spends on it, and a speculative step draws uniforms for every draft slot, the
acceptance coins and the final token. Here one program computes a block of rows x columns.

The mixer is random.py's "lowbias32" on uint32 values: a product wraps mod 2^32, which is what
the int64 product masked to 32 bits computes there, and shifts of unsigned values are logical.
The row key takes the low and high 32 bits of the int64 seed (an arithmetic shift, as there)
and the low 32 bits of the position. So the bits equal `random.uniform`'s on every input.

Under TRITON_INTERPRET=1 (CPU tensors) it runs in Triton's interpreter; set the variable before
this module is imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_ROWS = 16
BLOCK_COLS = 256


@triton.jit
def _mix32(x):  # x: uint32
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _uniform_kernel(
    seeds_ptr, positions_ptr, out_ptr, num_rows, num_cols, s_seed, s_pos,
    STREAM: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    row_mask = rows < num_rows
    seed = tl.load(seeds_ptr + rows * s_seed, mask=row_mask, other=0)  # int64
    position = tl.load(positions_ptr + rows * s_pos, mask=row_mask, other=0)  # int64
    lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    key = _mix32(lo ^ _mix32(hi ^ 0x9E3779B9))
    key = _mix32(key ^ (position & 0xFFFFFFFF).to(tl.uint32))
    key = _mix32(key ^ tl.full([BLOCK_ROWS], STREAM, tl.uint32))
    bits = _mix32(_mix32(key[:, None] ^ cols[None, :].to(tl.uint32)) ^ 0x5BD1E995)
    u = ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / (1 << 24))
    mask = row_mask[:, None] & (cols[None, :] < num_cols)
    tl.store(out_ptr + rows[:, None] * num_cols + cols[None, :], u, mask=mask)


def uniform_triton(
    seeds: torch.Tensor,  # [N] int64
    positions: torch.Tensor,  # [N] int64
    stream: int,
    num: int = 1,
) -> torch.Tensor:  # [N, num] float32 in (0, 1)
    """random.uniform in one launch (see the module docstring)."""
    assert seeds.dtype == positions.dtype == torch.int64 and seeds.shape == positions.shape
    n = seeds.shape[0]
    out = torch.empty(n, num, dtype=torch.float32, device=seeds.device)
    if n == 0 or num == 0:
        return out
    grid = (triton.cdiv(n, BLOCK_ROWS), triton.cdiv(num, BLOCK_COLS))
    _uniform_kernel[grid](
        seeds, positions, out, n, num, seeds.stride(0), positions.stride(0),
        STREAM=stream, BLOCK_ROWS=BLOCK_ROWS, BLOCK_COLS=BLOCK_COLS,
    )  # fmt: skip
    return out
