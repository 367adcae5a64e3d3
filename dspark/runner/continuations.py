"""Continuation windows: how a window launched behind an in-flight step gets its anchor on the
device.

A step of uniform windows can have a step launched behind it before its results reach the host
(async scheduling of drafting steps): a continuation row's anchor is the last token its
request's window emitted, so after each such step the runner keeps every window's next anchor
(position and token) on the device (`next_anchors`), and the next step writes them into its
inputs there (`write_continuations`) before its graph replays or its eager step runs. On the
GPU that write is one Triton launch (dspark/kernels/continuations_triton.py); these torch ops
are its reference and the CPU path.

The window's length is finished there too. The host stages the most drafts the row may verify
(its budget's); near the request's end, max_tokens or max_model_len allows fewer, and how many
depends on what the window before emitted. With the anchor at position p the request holds
p + 1 tokens, so a window may verify limit - p - 2 drafts and still emit within `limit`
(Request.max_num_tokens): its accepted drafts and one more token. That is the length the
synchronous engine gives the same window (Scheduler.num_draft), so outputs do not change.
"""

from __future__ import annotations

import torch

from dspark.runner.input_buffers import InputBuffers
from dspark.spec.spec_buffers import SpecBuffers


def next_anchors(
    anchor_pos: torch.Tensor,  # [R] the windows' anchor positions
    tokens: torch.Tensor,  # [R, K + 1] emitted: accepted drafts, then the recovered/bonus token
    num_accepted: torch.Tensor,  # [R]
) -> tuple[torch.Tensor, torch.Tensor]:  # [R] positions, [R] tokens
    """Where each window leaves its request: the position and token of its next anchor (the
    recovered or bonus token, one past the accepted drafts). Device ops only, no host sync.

      K = 3, anchor_pos [9, 4], num_accepted [2, 0], tokens [[a b c .], [e . . .]]
      next_pos = anchor_pos + num_accepted + 1 = [12, 5]
      next_tok = tokens[j, num_accepted[j]]    = [c, e]
    """
    next_pos = anchor_pos + num_accepted + 1
    next_tok = tokens.gather(1, num_accepted[:, None])[:, 0]
    return next_pos, next_tok


def _slots(block_table: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """KV slot of each position [C, n] in its row's pages (block_table [C, W])."""
    pages = block_table.gather(1, positions // page_size).long()
    return pages * page_size + positions % page_size


def write_continuations(
    buffers: InputBuffers,
    spec_buffers: SpecBuffers,
    rows: torch.Tensor,  # [C] window rows of the step (the step is all windows)
    anchor_pos: torch.Tensor,  # [C] each row's anchor position
    anchors: torch.Tensor,  # [C] each row's anchor token
    limits: torch.Tensor,  # [C] each row's request's token limit (Request.max_num_tokens)
    width: int,  # K + 1: window row i has tokens i * width .. (i + 1) * width - 1
) -> None:
    """Everything staging derives from a window's anchor, written on the device for windows
    whose anchor came out of the previous step's verification (capturable ops, no host sync):
    the anchor token, the window's positions, KV slots and length, the drafter block's anchor,
    positions, slots and length (SpecBuffers.write's anchor-derived fields), and the drafts it
    verifies, lowered where the request's limit allows fewer than staged (module docstring).

      width 4, draft_len 3, page_size 4, rows [1], anchor_pos [1], block_table[1] = [7, 2, ..]
      input_ids[4] = anchor             positions[4:8] = [1 2 3 4]
      slot_mapping[4:8] = [29 30 31 8]  seq_lens[1] = 5      (page 7 offsets 1..3, page 2 offset 0)
      anchor_pos[1] = 1  block_positions[3:6] = [1 2 3]  block_slots[3:6] = [29 30 31]
      block_seq_lens[1] = 4
      limits [5], staged verify_len[1] = 3: the request holds 2 tokens and may reach 5, so
      verify_len[1] = verify_cap[1] = min(3, 5 - 1 - 2) = 2 (two drafts, then one more token)
    """
    b, sb, ps, K = buffers, spec_buffers, spec_buffers.page_size, spec_buffers.K
    dev = rows.device
    table = b.block_table[rows]  # [C, max_pages]
    first = rows * width  # [C] the anchors' token indices
    window_pos = anchor_pos[:, None] + torch.arange(width, device=dev)  # [C, width]
    window_tok = first[:, None] + torch.arange(width, device=dev)  # [C, width]
    b.input_ids[first] = anchors
    b.positions[window_tok] = window_pos
    b.slot_mapping[window_tok] = _slots(table, window_pos, ps)
    b.seq_lens[rows] = (anchor_pos + width).to(b.seq_lens.dtype)
    block_pos = anchor_pos[:, None] + torch.arange(K, device=dev)  # [C, K]
    block_slot = rows[:, None] * K + torch.arange(K, device=dev)  # [C, K] index into the block
    sb.anchors[rows] = anchors
    sb.anchor_pos[rows] = anchor_pos
    sb.block_positions[block_slot] = block_pos
    sb.block_slots[block_slot] = _slots(table, block_pos, ps)
    sb.block_seq_lens[rows] = (anchor_pos + K).to(sb.block_seq_lens.dtype)
    room = (limits - anchor_pos - 2).clamp(min=0)  # drafts it may verify within its limit
    verify_len = torch.minimum(sb.verify_len[rows], room)
    sb.verify_len[rows] = verify_len
    sb.verify_cap[rows] = verify_len
