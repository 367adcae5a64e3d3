"""Training blocks: anchors sampled per sequence, their labels and the contiguous-prefix mask.

A sequence is prompt + response tokens; the drafter trains on the response only. An anchor is a
position i with response tokens at i and i + 1 (docs/SPECULATION.md 3.1): the block input is
[x_i, MASK x (K-1)], slot k (0-based) is labelled with x_{i+k+1}, and the context is the target's
features at positions < i. A slot is supervised only while every slot before it is (the block
is verified left to right, so a label past the first missing one teaches nothing):

  sequence (prompt 3, response 5):  p p p r r r r r      length 8, response_start 3
  anchors i:                        3 .. 6 (i + 1 <= 7 must be a response token)
  K = 4, anchor 5: labels x6 x7 -- --,  mask [1, 1, 0, 0]

Blocks of one batch are padded to A anchors per sequence; a padding anchor sits at position 0
with an all-false mask, so it costs compute but contributes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PAD_ANCHOR_POSITION = 0  # where padding anchors sit; their label mask is all false


@dataclass(frozen=True)
class Sequence:
    token_ids: list[int]  # prompt + response
    response_start: int  # index of the first response token


@dataclass(frozen=True)
class Blocks:
    anchor_positions: torch.Tensor  # [B, A] int64
    anchors: torch.Tensor  # [B, A] int64, token at each anchor position
    labels: torch.Tensor  # [B, A, K] int64, x_{i+1 .. i+K} (0 where the mask is false)
    mask: torch.Tensor  # [B, A, K] bool, the contiguous valid prefix of each block

    @property
    def num_supervised(self) -> int:
        return int(self.mask.sum())  # sync: training statistics only


def valid_anchors(seq: Sequence) -> range:
    """Positions i with response tokens at i and i + 1."""
    return range(seq.response_start, len(seq.token_ids) - 1)


def sample_anchor_positions(
    seq: Sequence, num_anchors: int, generator: torch.Generator
) -> list[int]:
    """Up to num_anchors distinct valid anchors, uniformly without replacement, sorted."""
    valid = valid_anchors(seq)
    if len(valid) <= num_anchors:
        return list(valid)
    pick = torch.randperm(len(valid), generator=generator)[:num_anchors]
    return sorted(valid[i] for i in pick.tolist())


def prefix_mask(is_valid: torch.Tensor) -> torch.Tensor:  # [..., K] bool -> [..., K] bool
    """True up to (not including) the first invalid slot: [1, 1, 0, 1] -> [1, 1, 0, 0]."""
    return is_valid.long().cumprod(dim=-1).bool()


def build_blocks(
    seqs: list[Sequence], num_anchors: int, draft_len: int, generator: torch.Generator
) -> Blocks:
    """Blocks for a batch: anchors sampled per sequence, labels, prefix masks (on the CPU)."""
    B, A, K = len(seqs), num_anchors, draft_len
    positions = torch.full((B, A), PAD_ANCHOR_POSITION, dtype=torch.int64)
    is_anchor = torch.zeros(B, A, dtype=torch.bool)
    for b, seq in enumerate(seqs):
        picked = sample_anchor_positions(seq, A, generator)
        positions[b, : len(picked)] = torch.tensor(picked, dtype=torch.int64)
        is_anchor[b, : len(picked)] = True
    length = max(len(s.token_ids) for s in seqs)
    tokens = torch.zeros(B, length + K, dtype=torch.int64)  # K of slack: labels never overrun
    lengths = torch.tensor([len(s.token_ids) for s in seqs])
    for b, seq in enumerate(seqs):
        tokens[b, : len(seq.token_ids)] = torch.tensor(seq.token_ids)
    label_pos = positions[..., None] + 1 + torch.arange(K)  # [B, A, K]
    labels = tokens.gather(1, label_pos.view(B, -1)).view(B, A, K)
    # every label position of a real anchor is past response_start; it needs to exist
    is_valid = (label_pos < lengths[:, None, None]) & is_anchor[..., None]
    mask = prefix_mask(is_valid)
    return Blocks(
        anchor_positions=positions,
        anchors=tokens.gather(1, positions),
        labels=torch.where(mask, labels, 0),
        mask=mask,
    )
