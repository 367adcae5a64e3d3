"""The chunked loss (vocab_loss.py) gives drafter_losses' terms and gradients exactly."""

from __future__ import annotations

import pytest
import torch

from dspark.train.losses import LossWeights, chunked_drafter_losses, drafter_losses
from tests.train.test_trainer import _trainer

N, K, D, R, V = 6, 4, 16, 5, 50
TOL = dict(rtol=1e-5, atol=1e-6)  # both compute the softmax terms in fp32


def _inputs(markov: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, K, D, generator=g, dtype=torch.float64, requires_grad=True)
    w1 = torch.randn(V, R, generator=g, dtype=torch.float64, requires_grad=True)
    w2 = torch.randn(V, R, generator=g, dtype=torch.float64, requires_grad=True)
    head = torch.randn(V, D, generator=g, dtype=torch.float64)
    target_hidden = torch.randn(N, K, D, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (N, K), generator=g)
    prev = torch.randint(0, V, (N, K), generator=g)
    lengths = torch.tensor([4, 4, 2, 0, 1, 3])  # a contiguous prefix per block, one empty
    mask = torch.arange(K)[None, :] < lengths[:, None]
    conf = torch.randn(N, K, generator=g, dtype=torch.float64, requires_grad=True)
    return dict(hidden=hidden, w1=w1 if markov else None, w2=w2 if markov else None, head=head,
                target_hidden=target_hidden, labels=labels, prev=prev, mask=mask,
                conf=conf)  # fmt: skip


def _reference(x, weights):
    logits = x["hidden"] @ x["head"].T
    if x["w1"] is not None:
        logits = logits + x["w1"][x["prev"]] @ x["w2"].T
    target_logits = x["target_hidden"] @ x["head"].T
    return drafter_losses(logits, target_logits, x["labels"], x["mask"], x["conf"], weights)


def _chunked(x, weights, chunk_slots):
    u = None if x["w1"] is None else x["w1"][x["prev"]]
    return chunked_drafter_losses(
        x["hidden"], u, x["w2"], x["head"], x["target_hidden"], x["labels"], x["mask"],
        x["conf"], weights, chunk_slots,
    )  # fmt: skip


def _grads(x, total):
    params = [x[k] for k in ("hidden", "w1", "w2", "conf") if x[k] is not None]
    return torch.autograd.grad(total, params)


@pytest.mark.parametrize("markov", [True, False], ids=["markov", "dflash"])
@pytest.mark.parametrize("chunk_slots", [1, 5, 1000])
def test_terms_and_gradients_equal_the_reference(markov: bool, chunk_slots: int):
    weights = LossWeights(ce=0.3, l1=0.7, confidence=1.5)
    x = _inputs(markov)
    ref, got = _reference(x, weights), _chunked(x, weights, chunk_slots)
    for name in ("total", "ce", "l1", "confidence"):
        torch.testing.assert_close(getattr(got, name).double(), getattr(ref, name).double(), **TOL)
    m = x["mask"]
    torch.testing.assert_close(got.soft_label[m].double(), ref.soft_label[m].double(), **TOL)
    assert (got.soft_label[~m] == 0).all()  # unsupervised slots are never computed
    for g_got, g_ref in zip(_grads(x, got.total), _grads(x, ref.total), strict=True):
        torch.testing.assert_close(g_got, g_ref, **TOL)


def test_nothing_supervised_gives_zero_loss_and_gradients():
    x = _inputs(True)
    x["mask"] = torch.zeros_like(x["mask"])
    got = _chunked(x, LossWeights(), 4)
    assert float(got.total.detach()) == 0.0
    assert all(float(g.abs().sum()) == 0.0 for g in _grads(x, got.total))


def test_trainer_chunked_loss_equals_the_reference_path(tiny):
    # the same drafter, batch and anchors through both paths of Trainer.losses
    chunked, reference = _trainer(tiny, chunk_slots=3), _trainer(tiny, chunk_slots=0)
    seqs = tiny[2]
    a = chunked.losses(seqs, torch.Generator().manual_seed(5))
    b = reference.losses(seqs, torch.Generator().manual_seed(5))
    for name in ("total", "ce", "l1", "confidence"):
        torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=1e-5, atol=1e-6)
    ga = torch.autograd.grad(a.total, list(chunked.drafter.parameters()), allow_unused=True)
    gb = torch.autograd.grad(b.total, list(reference.drafter.parameters()), allow_unused=True)
    for x, y in zip(ga, gb, strict=True):
        assert (x is None) == (y is None)
        if x is not None:
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-6)
