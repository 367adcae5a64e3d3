"""The training losses on hand-made tensors (docs/SPECULATION.md 3.1)."""

from __future__ import annotations

import math

import pytest
import torch

from dspark.train.losses import (
    LossWeights,
    drafter_losses,
    expected_block_tokens,
    position_weights,
    weighted_mean,
)

LOG = math.log


def _logits(*rows):  # probabilities -> logits (log), [K, V] rows of one block
    return torch.tensor([[LOG(p) if p > 0 else -1e9 for p in row] for row in rows])[None]


def test_position_weights():
    w = position_weights(7)
    expected = [math.exp(-(k - 1) / 4) for k in range(1, 8)]
    torch.testing.assert_close(w, torch.tensor(expected))
    assert w[0] == 1.0 and abs(float(w[4]) - math.exp(-1)) < 1e-7


def test_soft_label_is_one_minus_half_l1():
    # slot 1: draft (0.5, 0.5, 0), target (0.7, 0.3, 0): L1 0.4, soft label 0.8 = sum of minima
    # slot 2: identical distributions: L1 0, label 1; slot 3: disjoint supports: L1 2, label 0
    draft = _logits([0.5, 0.5, 0.0], [0.2, 0.3, 0.5], [1.0, 0.0, 0.0])
    target = _logits([0.7, 0.3, 0.0], [0.2, 0.3, 0.5], [0.0, 0.5, 0.5])
    labels = torch.tensor([[0, 2, 1]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    terms = drafter_losses(draft, target, labels, mask, torch.zeros(1, 3))
    torch.testing.assert_close(terms.soft_label, torch.tensor([[0.8, 1.0, 0.0]]))
    w = position_weights(3)
    torch.testing.assert_close(terms.l1, (w * torch.tensor([0.4, 0.0, 2.0])).sum() / w.sum())
    ce = torch.tensor([-LOG(0.5), -LOG(0.5), 1e9])  # slot 3's label has draft probability 0
    assert terms.ce > 1e6  # the label the draft rules out costs a huge CE
    torch.testing.assert_close(
        drafter_losses(draft[:, :2], target[:, :2], labels[:, :2], mask[:, :2], None).ce,
        (w[:2] * ce[:2]).sum() / w[:2].sum(),
    )
    # BCE with logit 0 (c = 0.5): -(y log 0.5 + (1 - y) log 0.5) = log 2 whatever the label
    torch.testing.assert_close(terms.confidence, torch.tensor(LOG(2.0)))


def test_confidence_bce_against_the_soft_label():
    draft = _logits([0.5, 0.5])
    target = _logits([0.7, 0.3])  # soft label 0.8
    conf = torch.tensor([[1.2]])
    terms = drafter_losses(draft, target, torch.tensor([[0]]), torch.ones(1, 1, dtype=bool), conf)
    c = torch.sigmoid(torch.tensor(1.2))
    torch.testing.assert_close(terms.confidence, -(0.8 * c.log() + 0.2 * (1 - c).log()))
    # minimised at c = the soft label
    best = drafter_losses(draft, target, torch.tensor([[0]]), torch.ones(1, 1, dtype=bool),
                          torch.tensor([[LOG(0.8 / 0.2)]]))  # fmt: skip
    for logit in (-1.0, 0.5, 2.0):
        other = drafter_losses(draft, target, torch.tensor([[0]]), torch.ones(1, 1, dtype=bool),
                               torch.tensor([[logit]]))  # fmt: skip
        assert other.confidence > best.confidence


def test_total_weights_and_masked_slots_contribute_nothing():
    torch.manual_seed(0)
    draft = torch.randn(2, 4, 5, requires_grad=True)
    target = torch.randn(2, 4, 5)
    conf = torch.randn(2, 4, requires_grad=True)
    labels = torch.randint(0, 5, (2, 4))
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    terms = drafter_losses(draft, target, labels, mask, conf)
    torch.testing.assert_close(terms.total, 0.1 * terms.ce + 0.9 * terms.l1 + terms.confidence)
    terms.total.backward()
    assert draft.grad[0, 2:].abs().sum() == 0 and conf.grad[0, 2:].abs().sum() == 0
    assert draft.grad[0, :2].abs().sum() > 0 and draft.grad[1].abs().sum() > 0
    # the soft label is detached: the confidence loss sends no gradient into the draft logits
    draft.grad = None
    drafter_losses(
        draft, target, labels, mask, conf.detach(), LossWeights(0, 0, 1)
    ).total.backward()
    assert draft.grad is None or draft.grad.abs().sum() == 0
    # without a confidence head the term is 0 and the total is CE + L1 only
    plain = drafter_losses(draft, target, labels, mask, None)
    assert plain.confidence == 0
    torch.testing.assert_close(plain.total, 0.1 * plain.ce + 0.9 * plain.l1)


def test_weighted_mean_and_tau_estimate():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 0, 0], [1, 1, 0]], dtype=torch.bool)
    w = torch.tensor([1.0, 0.5, 0.25])
    assert weighted_mean(values, mask, w) == pytest.approx((1 + 4 + 2.5) / 2.5)
    assert weighted_mean(values, torch.zeros_like(mask), w) == 0
    soft = torch.tensor([[0.5, 0.5], [1.0, 1.0], [0.0, 1.0]])
    full = torch.tensor([[1, 1], [1, 1], [1, 0]], dtype=torch.bool)
    # blocks 1 and 2 are fully supervised: 1 + (0.5 + 0.25) and 1 + (1 + 1)
    assert expected_block_tokens(soft, full) == pytest.approx((1.75 + 3.0) / 2)
    assert math.isnan(expected_block_tokens(soft, torch.zeros_like(full)))
