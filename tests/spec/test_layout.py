"""The ragged verify layout: the worked example, rows with verify_len 0, tokens of no row."""

from __future__ import annotations

import torch

from dspark.spec.layout import verify_layout
from dspark.step_plan import SCRATCH_PAGE


def test_worked_example():
    # windows [3, 1, 2]; anchors at positions 5, 9, 0; page_size 4
    block_table = torch.tensor([[3, 4, 0], [7, 8, 9], [2, 0, 0]], dtype=torch.int32)
    lay = verify_layout(torch.tensor([2, 0, 1]), torch.tensor([5, 9, 0]), block_table, 4, 6)
    assert lay.cu_num_tokens.tolist() == [0, 3, 4, 6]
    assert lay.owner.tolist() == [0, 0, 0, 1, 2, 2]
    assert lay.offset.tolist() == [0, 1, 2, 0, 0, 1]
    assert lay.positions.tolist() == [5, 6, 7, 9, 0, 1]
    # position 5 -> page index 1 (page 4), offset 1 -> slot 17; 9 -> page index 2 (page 9) -> 37
    assert lay.slot_mapping.tolist() == [17, 18, 19, 37, 8, 9]
    assert lay.seq_lens.tolist() == [8, 10, 2]
    assert (lay.cu_num_tokens[1:] - 1).tolist() == [2, 3, 5]  # bonus / recovered rows


def test_tokens_past_the_last_window_write_only_the_scratch_page():
    block_table = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)
    lay = verify_layout(torch.tensor([0, 1]), torch.tensor([4, 2]), block_table, 4, 6)
    assert lay.owner.tolist() == [0, 1, 1, 2, 2, 2]  # 2 = no row
    live_pages = {1, 2, 3, 4}
    pad_slots = lay.slot_mapping[3:].tolist()
    assert all(s // 4 == SCRATCH_PAGE and s // 4 not in live_pages for s in pad_slots)
