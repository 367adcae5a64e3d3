"""Anchor sampling, block labels and the contiguous-prefix mask."""

from __future__ import annotations

import torch

from dspark.train.anchors import (
    PAD_ANCHOR_POSITION,
    Sequence,
    build_blocks,
    prefix_mask,
    sample_anchor_positions,
    valid_anchors,
)


def test_prefix_mask_stops_at_the_first_gap():
    valid = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    expected = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(prefix_mask(valid), expected)


def test_valid_anchors_need_response_tokens_at_i_and_i_plus_1():
    seq = Sequence(list(range(10, 18)), response_start=3)  # the docstring's example
    assert list(valid_anchors(seq)) == [3, 4, 5, 6]
    assert list(valid_anchors(Sequence([1, 2, 3], response_start=2))) == []


def test_sampler_is_uniform_distinct_and_seeded():
    seq = Sequence(list(range(40)), response_start=10)  # valid anchors 10 .. 38
    picks = sample_anchor_positions(seq, 5, torch.Generator().manual_seed(3))
    assert len(set(picks)) == 5 and picks == sorted(picks)
    assert all(10 <= p <= 38 for p in picks)
    assert picks == sample_anchor_positions(seq, 5, torch.Generator().manual_seed(3))
    assert sample_anchor_positions(seq, 100, torch.Generator()) == list(range(10, 39))
    counts = torch.zeros(40)
    g = torch.Generator().manual_seed(0)
    for _ in range(2000):
        counts[sample_anchor_positions(seq, 5, g)] += 1
    # each of the 29 anchors is drawn with probability 5/29: 345 of 2000 (sd ~17)
    assert counts[:10].sum() == 0 and counts[39] == 0
    assert (counts[10:39] - 2000 * 5 / 29).abs().max() < 80


def test_blocks_labels_and_masks():
    seq = Sequence(list(range(100, 108)), response_start=3)  # tokens 100..107, anchors 3..6
    short = Sequence([7, 8, 9], response_start=2)  # no anchor at all
    blocks = build_blocks([seq, short], 6, 4, torch.Generator().manual_seed(0))
    assert blocks.anchor_positions[0, :4].tolist() == [3, 4, 5, 6]
    assert blocks.anchors[0, :4].tolist() == [103, 104, 105, 106]
    # anchor 5 (the docstring's example): labels x6 x7, then the sequence ends
    assert blocks.labels[0, 2].tolist() == [106, 107, 0, 0]
    assert blocks.mask[0, 2].tolist() == [True, True, False, False]
    assert blocks.labels[0, 0].tolist() == [104, 105, 106, 107]
    assert blocks.mask[0, 0].all() and blocks.mask[0, 3].tolist() == [True, False, False, False]
    # padding anchors (row 0 slots 4, 5 and all of the short sequence) supervise nothing
    assert not blocks.mask[0, 4:].any() and not blocks.mask[1].any()
    assert (blocks.anchor_positions[1] == PAD_ANCHOR_POSITION).all()
    assert blocks.num_supervised == 4 + 3 + 2 + 1
