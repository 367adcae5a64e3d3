"""Triton write of continuation windows' anchor-derived inputs: the one-launch twin of
`dspark.runner.continuations.write_continuations` (two dozen small torch ops, each a launch and
several microseconds of host time, on every step launched ahead).

Program c handles continuation c: window row r = rows[c], whose anchor is the previous step's
window src[c] left its request at (next_pos[src[c]], next_tok[src[c]]). It writes the same
values as the torch version (its docstring has the worked example):

  input_ids[r * W] = tok                    positions[r * W + w] = pos + w       (w < W)
  slot_mapping[r * W + w] = slot(pos + w)   seq_lens[r] = pos + W
  anchors[r] = tok   anchor_pos[r] = pos    block_positions[r * K + k] = pos + k (k < K)
  block_slots[r * K + k] = slot(pos + k)    block_seq_lens[r] = pos + K
  verify_len[r] = verify_cap[r] = min(verify_len[r], max(0, limits[c] - pos - 2))

with slot(p) = block_table[r, p // page_size] * page_size + p % page_size. Every value is read
on the device: nothing waits for the previous step's verification to reach the host.

Under TRITON_INTERPRET=1 (CPU tensors) it runs in Triton's interpreter; set the variable before
this module is imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _continuations_kernel(
    rows_ptr, src_ptr, next_pos_ptr, next_tok_ptr, block_table_ptr, bt_stride,
    input_ids_ptr, positions_ptr, slot_mapping_ptr, seq_lens_ptr,
    anchors_ptr, anchor_pos_ptr, block_positions_ptr, block_slots_ptr, block_seq_lens_ptr,
    limits_ptr, verify_len_ptr, verify_cap_ptr,
    WIDTH: tl.constexpr, K: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    c = tl.program_id(0)
    row = tl.load(rows_ptr + c)
    src = tl.load(src_ptr + c)
    pos = tl.load(next_pos_ptr + src)
    tok = tl.load(next_tok_ptr + src)
    w = tl.arange(0, BLOCK)
    p = pos + w  # the window's positions are its first WIDTH, the block's its first K
    in_window = w < WIDTH
    in_block = w < K
    page = tl.load(
        block_table_ptr + row * bt_stride + p // PAGE_SIZE, mask=in_window | in_block, other=0
    )
    slot = page.to(tl.int64) * PAGE_SIZE + p % PAGE_SIZE
    first = row * WIDTH
    tl.store(input_ids_ptr + first, tok)
    tl.store(positions_ptr + first + w, p, mask=in_window)
    tl.store(slot_mapping_ptr + first + w, slot, mask=in_window)
    tl.store(seq_lens_ptr + row, (pos + WIDTH).to(tl.int32))
    tl.store(anchors_ptr + row, tok)
    tl.store(anchor_pos_ptr + row, pos)
    tl.store(block_positions_ptr + row * K + w, p, mask=in_block)
    tl.store(block_slots_ptr + row * K + w, slot, mask=in_block)
    tl.store(block_seq_lens_ptr + row, (pos + K).to(tl.int32))
    room = tl.maximum(tl.load(limits_ptr + c) - pos - 2, 0)
    verify_len = tl.minimum(tl.load(verify_len_ptr + row), room)
    tl.store(verify_len_ptr + row, verify_len)
    tl.store(verify_cap_ptr + row, verify_len)


def write_continuations_triton(
    rows: torch.Tensor,  # [C] int64 window rows of the step
    src: torch.Tensor,  # [C] int64 each row's window in the previous step
    next_pos: torch.Tensor,  # [R] int64 the previous step's next anchor positions
    next_tok: torch.Tensor,  # [R] int64 and tokens
    block_table: torch.Tensor,  # [rows, W] int32
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    seq_lens: torch.Tensor,  # int32
    anchors: torch.Tensor,
    anchor_pos: torch.Tensor,
    block_positions: torch.Tensor,
    block_slots: torch.Tensor,
    block_seq_lens: torch.Tensor,  # int32
    limits: torch.Tensor,  # [C] int64 each row's request's token limit
    verify_len: torch.Tensor,  # [rows] int64, staged: lowered to what the limit allows
    verify_cap: torch.Tensor,  # [rows] int64, set to the same
    width: int,  # the windows' width: num_speculative_tokens + 1
    draft_len: int,  # K, the drafter's block (wider than a window when fewer are verified)
    page_size: int,
) -> None:
    assert block_table.stride(1) == 1, block_table.stride()
    if rows.shape[0] == 0:
        return
    _continuations_kernel[(rows.shape[0],)](
        rows, src, next_pos, next_tok, block_table, block_table.stride(0),
        input_ids, positions, slot_mapping, seq_lens,
        anchors, anchor_pos, block_positions, block_slots, block_seq_lens,
        limits, verify_len, verify_cap,
        WIDTH=width, K=draft_len, PAGE_SIZE=page_size,
        BLOCK=triton.next_power_of_2(max(width, draft_len)),
    )  # fmt: skip
