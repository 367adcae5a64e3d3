"""The continuation-window kernel writes exactly what the torch reference writes
(continuations.write_continuations): the reference's worked example, and random windows over
page boundaries with rows out of order, and windows narrower than the drafter's block (fixed K
below the block: num_speculative_tokens 1 verifies windows of 2 while the block drafts 7)."""

from __future__ import annotations

import torch

from dspark.kernels.continuations_triton import write_continuations_triton
from dspark.runner.continuations import write_continuations
from dspark.runner.input_buffers import InputBuffers
from dspark.spec.spec_buffers import SpecBuffers

FIELDS = ("input_ids", "positions", "slot_mapping", "seq_lens")
SPEC_FIELDS = (
    "anchors",
    "anchor_pos",
    "block_positions",
    "block_slots",
    "block_seq_lens",
    "verify_len",
    "verify_cap",
)


def _buffers(device, rows=8, K=3, page_size=4):
    b = InputBuffers(max_num_tokens=rows * (K + 1), max_num_rows=rows, max_pages_per_row=8,
                     device=device)  # fmt: skip
    sb = SpecBuffers(max_rows=rows, draft_len=K, page_size=page_size, device=device)
    return b, sb


def _run_both(device, table, rows, src, next_pos, next_tok, K=3, page_size=4, width=None,
              limits=None):  # fmt: skip
    """limits: the rows' requests' token limits (default: none near)."""
    width = K + 1 if width is None else width
    limits = torch.full_like(rows, 10_000) if limits is None else limits
    ref, ref_sb = _buffers(torch.device("cpu"), K=K, page_size=page_size)
    got, got_sb = _buffers(device, K=K, page_size=page_size)
    for b in (ref, got):
        b.block_table.copy_(table.to(b.block_table.device))
    for sb in (ref_sb, got_sb):  # as staged: every window at its full width
        sb.verify_len.fill_(width - 1)
        sb.verify_cap.fill_(width - 1)
    write_continuations(ref, ref_sb, rows, next_pos[src], next_tok[src], limits, width)
    d = lambda t: t.to(device)  # noqa: E731
    write_continuations_triton(
        d(rows), d(src), d(next_pos), d(next_tok), got.block_table, got.input_ids,
        got.positions, got.slot_mapping, got.seq_lens, got_sb.anchors, got_sb.anchor_pos,
        got_sb.block_positions, got_sb.block_slots, got_sb.block_seq_lens, d(limits),
        got_sb.verify_len, got_sb.verify_cap, width, K, page_size,
    )  # fmt: skip
    for name in FIELDS:
        assert torch.equal(getattr(got, name).cpu(), getattr(ref, name)), name
    for name in SPEC_FIELDS:
        assert torch.equal(getattr(got_sb, name).cpu(), getattr(ref_sb, name)), name
    return got, got_sb


def test_worked_example(device):
    """write_continuations' docstring: width 4, row 1, anchor at 1, pages [7, 2]."""
    table = torch.zeros(8, 8, dtype=torch.int32)
    table[1, :2] = torch.tensor([7, 2])
    got, sb = _run_both(device, table, torch.tensor([1]), torch.tensor([0]), torch.tensor([1]),
                        torch.tensor([11]))  # fmt: skip
    assert got.slot_mapping[4:8].tolist() == [29, 30, 31, 8]
    assert sb.block_slots[3:6].tolist() == [29, 30, 31]
    assert sb.verify_len[1] == 3  # far from its limit: the staged length
    # limit 5: the request holds 2 tokens, so 2 drafts and one more token
    _, sb = _run_both(device, table, torch.tensor([1]), torch.tensor([0]), torch.tensor([1]),
                      torch.tensor([11]), limits=torch.tensor([5]))  # fmt: skip
    assert sb.verify_len[1] == sb.verify_cap[1] == 2


def test_windows_near_their_limits_are_shortened(device):
    """Room for 3, 2, 1, 0 drafts, and a request its previous window finished (room -1: an
    empty window, whose token the host drops)."""
    table = torch.randint(1, 64, (8, 8), generator=torch.Generator().manual_seed(2),
                          dtype=torch.int32)  # fmt: skip
    rows, src = torch.tensor([0, 1, 2, 3, 4]), torch.tensor([0, 1, 2, 3, 4])
    next_pos = torch.tensor([10, 10, 10, 10, 10])
    limits = torch.tensor([40, 14, 13, 12, 11])
    _, sb = _run_both(device, table, rows, src, next_pos, torch.arange(5), limits=limits)
    assert sb.verify_len[:5].tolist() == [3, 2, 1, 0, 0]


def test_random_rows_across_pages(device):
    g = torch.Generator().manual_seed(0)
    table = torch.randint(1, 64, (8, 8), generator=g, dtype=torch.int32)
    rows = torch.tensor([5, 0, 3, 7, 2])
    src = torch.tensor([2, 0, 4, 1, 3])  # the previous step's windows, in another order
    next_pos = torch.randint(0, 24, (5,), generator=g)
    next_tok = torch.randint(0, 1000, (5,), generator=g)
    _run_both(device, table, rows, src, next_pos, next_tok)
    _run_both(device, table, rows, src, next_pos, next_tok, K=7, page_size=16)


def test_windows_narrower_than_the_block(device):
    """num_speculative_tokens 1 and 3 with a block of 7: the block's positions and slots past
    the window are written too (their pages read from the block table)."""
    g = torch.Generator().manual_seed(1)
    table = torch.randint(1, 64, (8, 8), generator=g, dtype=torch.int32)
    rows, src = torch.tensor([4, 1, 6]), torch.tensor([0, 2, 1])
    next_pos = torch.tensor([13, 30, 2])  # blocks that cross a page where windows do not
    next_tok = torch.randint(0, 1000, (3,), generator=g)
    for width in (2, 4):
        _run_both(device, table, rows, src, next_pos, next_tok, K=7, page_size=16, width=width)
