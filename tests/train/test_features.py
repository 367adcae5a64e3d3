"""The target on a packed training batch: the worked layout, and features/logits per sequence."""

from __future__ import annotations

import torch

from dspark.train.anchors import Sequence, build_blocks
from dspark.train.features import TargetRunner, logits_rows, pack
from tests.helpers import full_logits
from tests.test_dspark_drafter import target  # noqa: F401

TAPS = (0, 1)


def test_pack_worked_example():
    seqs = [Sequence([1, 2, 3, 4, 5], 2), Sequence([6, 7, 8], 1)]
    layout = pack(seqs, torch.device("cpu"), page_size=4)
    assert layout.cu_num_tokens == [0, 5, 8]
    assert layout.attn.block_table.tolist() == [[1, 2], [3, 0]]
    assert layout.attn.slot_mapping.tolist() == [4, 5, 6, 7, 8, 12, 13, 14]
    assert layout.positions.tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert layout.num_pages == 4


def test_features_and_logits_match_each_sequence_alone(target):  # noqa: F811
    seqs = [Sequence([5, 17, 3, 44, 9, 21, 60, 2, 33, 71, 12], 3), Sequence([8, 1, 90, 4, 13], 2)]
    blocks = build_blocks(seqs, 4, 3, torch.Generator().manual_seed(0))
    out = TargetRunner(target, TAPS).run(seqs, blocks)
    assert out.features.shape == (2, 11, 2 * 32) and out.logits.shape == (2, 4, 3, 96)
    for b, seq in enumerate(seqs):
        ref = full_logits(target, seq.token_ids, hidden_layers=TAPS)
        n = len(seq.token_ids)
        feats = torch.cat([ref.hidden_states[i] for i in TAPS], dim=-1)
        torch.testing.assert_close(out.features[b, :n], feats, atol=1e-5, rtol=1e-5)
        assert (out.features[b, n:] == 0).all()
        for a in range(4):
            for k in range(3):
                if not blocks.mask[b, a, k]:
                    continue
                # slot k of the block at anchor i is labelled x_{i+k+1}: judged by logits at i+k
                pos = int(blocks.anchor_positions[b, a]) + k
                assert blocks.labels[b, a, k] == seq.token_ids[pos + 1]
                torch.testing.assert_close(out.logits[b, a, k], ref.logits[pos], atol=1e-4,
                                           rtol=1e-4)  # fmt: skip


def test_logits_rows_clamp_inside_the_sequence():
    blocks = build_blocks([Sequence([1, 2, 3, 4], 1), Sequence([5, 6, 7], 1)], 2, 3,
                          torch.Generator().manual_seed(0))  # fmt: skip
    rows = logits_rows(blocks, [0, 4, 7], [4, 3])
    # sequence 0 anchors 1, 2: rows 1 2 3 | 2 3 3; sequence 1 anchors 1 (+ a pad at 0): 5 6 6
    assert rows[0].tolist() == [[1, 2, 3], [2, 3, 3]]
    assert rows[1, 0].tolist() == [5, 6, 6]
