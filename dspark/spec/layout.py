"""The ragged verify layout, computed on the device from per-row verify lengths.

Row r (a request, or a pad row at the tail) sends a window of 1 + verify_len[r] tokens: its
anchor at position anchor_pos[r], then drafts at anchor_pos[r] + 1 ... Everything a verify
forward reads per token is derived here with tensor ops only, so a captured graph can replay it
with lengths chosen on the device (no host sync, no data-dependent shapes: the token count V
is the captured cell's, and tokens past the last window belong to no row).

  verify_len:          [2, 0, 1]              windows [3, 1, 2], V = 6
  cu_num_tokens:       [0, 3, 4, 6]
  token owner row:     [0, 0, 0, 1, 2, 2]
  offset in window:    [0, 1, 2, 0, 0, 1]     0 is the anchor; k > 0 verifies draft k
  position:            anchor_pos[owner] + offset
  logits index of the bonus/recovered rows: cu_num_tokens[1:] - 1 = [2, 3, 5]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.step_plan import SCRATCH_PAGE


@dataclass(frozen=True)
class VerifyLayout:
    cu_num_tokens: torch.Tensor  # [R + 1] int32
    owner: torch.Tensor  # [V] int64, row of each token (R for tokens past the last window)
    offset: torch.Tensor  # [V] int64, index inside the window (0 = anchor)
    positions: torch.Tensor  # [V] int64
    slot_mapping: torch.Tensor  # [V] int64, the scratch page for tokens of no row
    seq_lens: torch.Tensor  # [R] int32, KV length each row sees after the window is written


@dataclass(frozen=True)
class WindowTokens:
    """Where each of V token slots falls in a ragged layout of windows 1 + verify_len wide."""

    cu_num_tokens: torch.Tensor  # [R + 1] int64
    owner: torch.Tensor  # [V] row of each token, R for tokens past the last window
    row: torch.Tensor  # [V] owner clamped to R - 1 (a valid index for gathers)
    offset: torch.Tensor  # [V] index inside the window (0 = anchor), clamped to the window
    is_live: torch.Tensor  # [V] bool, owner < R


def window_tokens(verify_len: torch.Tensor, num_tokens: int) -> WindowTokens:
    """The token-to-window map of the module docstring's example, by tensor ops only."""
    R = verify_len.shape[0]
    windows = verify_len + 1  # [R]
    cu = torch.zeros(R + 1, dtype=torch.int64, device=verify_len.device)
    cu[1:] = windows.cumsum(0)
    token = torch.arange(num_tokens, device=verify_len.device)  # [V]
    # owner = number of windows that end at or before the token: searchsorted over cu[1:]
    owner = torch.searchsorted(cu[1:], token, right=True)  # [V], R past the last window
    row = owner.clamp(max=R - 1)
    offset = torch.minimum(token - cu[row], verify_len[row])
    return WindowTokens(cu, owner, row, offset, owner < R)


def verify_layout(
    verify_len: torch.Tensor,  # [R] int64
    anchor_pos: torch.Tensor,  # [R] int64
    block_table: torch.Tensor,  # [R, max_pages] int32
    page_size: int,
    num_tokens: int,  # V, the captured token count (>= sum of windows)
) -> VerifyLayout:
    w = window_tokens(verify_len, num_tokens)
    positions = torch.where(w.is_live, anchor_pos[w.row] + w.offset, 0)
    page = block_table[w.row, positions // page_size].long()
    slots = torch.where(w.is_live, page * page_size + positions % page_size, SCRATCH_PAGE)
    return VerifyLayout(
        cu_num_tokens=w.cu_num_tokens.to(torch.int32),
        owner=w.owner,
        offset=torch.where(w.is_live, w.offset, 0),
        positions=positions,
        slot_mapping=slots,
        seq_lens=(anchor_pos + verify_len + 1).to(torch.int32),
    )
