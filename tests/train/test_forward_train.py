"""The drafter's training forward equals its inference path (paged context + block_hidden)."""

from __future__ import annotations

import torch

from dspark.train.anchors import Sequence, build_blocks
from tests.test_dspark_drafter import K, _drafter, _features, _paged_block, target  # noqa: F401


def test_forward_train_equals_the_paged_inference_block(target):  # noqa: F811
    drafter = _drafter(target)
    seqs = [[5, 17, 3, 44, 9, 21, 60, 2, 33, 71, 12], [8, 1, 90, 4, 4, 13, 7]]
    anchors = [[2, 6, 10], [1, 5, 3]]  # any order; the second sequence is shorter (padded)
    L = max(len(s) for s in seqs)
    features = torch.zeros(2, L, 2 * 32)
    for b, s in enumerate(seqs):
        features[b, : len(s)] = _features(target, s)
    pos = torch.tensor(anchors)
    ids = torch.tensor([[s[i] for i in a] for s, a in zip(seqs, anchors, strict=True)])
    with torch.no_grad():
        hidden = drafter.forward_train(features, ids, pos)  # [2, 3, K, d]
    assert hidden.shape == (2, 3, K, 32)
    for b, s in enumerate(seqs):
        feats = _features(target, s)
        for a, i in enumerate(anchors[b]):
            paged = _paged_block(drafter, feats, anchor=s[i], anchor_pos=i)
            torch.testing.assert_close(hidden[b, a], paged, atol=1e-5, rtol=1e-5)


def test_forward_train_is_differentiable_and_blocks_do_not_see_each_other(target):  # noqa: F811
    drafter = _drafter(target).train()
    s = [5, 17, 3, 44, 9, 21, 60, 2, 33, 71, 12]
    feats = _features(target, s)[None]
    pos = torch.tensor([[3, 7]])
    ids = torch.tensor([[s[3], s[7]]])
    hidden = drafter.forward_train(feats, ids, pos)
    hidden[0, 0].sum().backward()
    assert drafter.fc.weight.grad is not None and drafter.fc.weight.grad.abs().sum() > 0
    with torch.no_grad():  # changing block 1's anchor leaves block 0 unchanged
        other = drafter.forward_train(feats, torch.tensor([[s[3], 0]]), pos)
        torch.testing.assert_close(other[0, 0], hidden[0, 0])
        # and the context at or after block 0's anchor is invisible to it
        later = feats.clone()
        later[0, 3:] = 7.0
        torch.testing.assert_close(drafter.forward_train(later, ids, pos)[0, 0], hidden[0, 0])


def test_build_blocks_feed_forward_train(target):  # noqa: F811
    drafter = _drafter(target)
    s = Sequence([5, 17, 3, 44, 9, 21, 60, 2, 33, 71, 12], response_start=4)
    blocks = build_blocks([s], 3, K, torch.Generator().manual_seed(0))
    feats = _features(target, s.token_ids)[None]
    with torch.no_grad():
        hidden = drafter.forward_train(feats, blocks.anchors, blocks.anchor_positions)
    i = int(blocks.anchor_positions[0, 0])
    paged = _paged_block(drafter, feats[0], anchor=s.token_ids[i], anchor_pos=i)
    torch.testing.assert_close(hidden[0, 0], paged, atol=1e-5, rtol=1e-5)
