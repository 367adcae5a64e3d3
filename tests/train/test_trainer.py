"""Training on the tiny model: the loss falls, a resumed run equals an uninterrupted one."""

from __future__ import annotations

import math
import pathlib

import pytest
import torch

from dspark.train.dataset import BatchOrder
from dspark.train.losses import LossWeights
from dspark.train.trainer import CHECKPOINT_FILE, TrainConfig, Trainer, build_drafter, lr_at


def _trainer(tiny, **overrides):
    target, h, seqs = tiny
    kw = dict(draft_len=4, markov_rank=16, batch_size=2, anchors_per_seq=8, lr=3e-3,
              warmup_steps=2, total_steps=20, min_lr_ratio=0.5)  # fmt: skip
    config = TrainConfig(**(kw | overrides))
    return Trainer(target, build_drafter(target, h, config), seqs, config)


@torch.no_grad()
def _loss(trainer, seqs):
    return trainer.losses(seqs, torch.Generator().manual_seed(123))


def test_a_few_steps_reduce_the_loss(tiny):
    trainer = _trainer(tiny)
    seqs = tiny[2]
    before = _loss(trainer, seqs)
    for _ in range(12):
        trainer.train_step()
    after = _loss(trainer, seqs)
    assert after.total < 0.9 * before.total, (before.total, after.total)
    assert after.ce < 0.8 * before.ce and after.l1 < before.l1
    # the untrained drafter's Markov bias is zero; training moves it
    assert trainer.drafter.markov_out.weight.abs().sum() > 0


def test_the_confidence_head_learns_the_soft_label(tiny):
    # the soft label moves with the draft distribution, so the BCE is trained on its own here
    trainer = _trainer(tiny, loss=LossWeights(ce=0.0, l1=0.0, confidence=1.0))
    before = _loss(trainer, tiny[2])
    for _ in range(8):
        trainer.train_step()
    assert _loss(trainer, tiny[2]).confidence < 0.95 * before.confidence


def test_dflash_ablation_trains_without_markov_or_confidence(tiny):
    trainer = _trainer(tiny, markov_rank=0)
    assert trainer.drafter.markov_in is None and trainer.drafter.confidence is None
    before = _loss(trainer, tiny[2])
    for _ in range(8):
        trainer.train_step()
    after = _loss(trainer, tiny[2])
    assert after.confidence == 0 and after.total < before.total


def test_resume_continues_exactly(tiny, tmp_path):
    straight = _trainer(tiny)
    for _ in range(4):
        straight.train_step()
    first = _trainer(tiny)
    for _ in range(2):
        first.train_step()
    first.save(tmp_path / CHECKPOINT_FILE)
    resumed = _trainer(tiny)
    resumed.resume(tmp_path / CHECKPOINT_FILE)
    assert resumed.step == 2
    for _ in range(2):
        resumed.train_step()
    for name, value in straight.drafter.state_dict().items():
        torch.testing.assert_close(resumed.drafter.state_dict()[name], value, msg=name)
    other = _trainer(tiny, markov_rank=8)
    with pytest.raises(ValueError, match="another drafter configuration"):
        other.resume(tmp_path / CHECKPOINT_FILE)


class _RunsCode:
    """Unpickled, it creates the file `marker`: what a planted checkpoint could do."""

    def __init__(self, marker) -> None:
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def test_resume_refuses_a_checkpoint_that_would_run_code(tiny, tmp_path):
    marker = tmp_path / "code_ran"
    torch.save({"step": 1, "payload": _RunsCode(marker)}, tmp_path / CHECKPOINT_FILE)
    with pytest.raises(ValueError, match="could not be loaded as plain tensors and values"):
        _trainer(tiny).resume(tmp_path / CHECKPOINT_FILE)
    assert not marker.exists()


def test_run_sizes_total_steps_from_the_time_budget_and_exports(tiny, tmp_path):
    trainer = _trainer(tiny, total_steps=0, measure_steps=4, warmup_steps=5,
                       train_minutes=1e-6, save_every=3)  # fmt: skip
    assert trainer.run(tmp_path, progress=False)
    assert trainer.total_steps == 6 and trainer.step == 6  # the budget is tiny: warm-up + 1
    # timed: the warm-up's last 4 steps (2-5), not its first (kernels compile on new shapes)
    assert len(trainer.window_seconds) == 4 and len(trainer.step_seconds) == 6
    assert (tmp_path / "drafter" / "config.json").is_file()
    assert (tmp_path / "train" / "train.json").is_file()
    again = _trainer(tiny, total_steps=0, measure_steps=4, warmup_steps=5, train_minutes=1e-6)
    assert again.run(tmp_path, progress=False) and again.step == 6  # resumed: nothing to do


def test_lr_schedule():
    cfg = TrainConfig(lr=1e-3, warmup_steps=10, min_lr_ratio=0.1, total_steps=110)
    assert lr_at(0, cfg, 110) == pytest.approx(1e-4)
    assert lr_at(9, cfg, 110) == pytest.approx(1e-3)
    assert lr_at(10, cfg, 110) == pytest.approx(1e-3)
    assert lr_at(60, cfg, 110) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))
    assert lr_at(110, cfg, 110) == pytest.approx(1e-4)
    lrs = [lr_at(s, cfg, 110) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:], strict=False))
    assert not math.isnan(lr_at(5, cfg, 0))


def test_batch_order_is_a_seeded_permutation_per_epoch():
    order = BatchOrder(5, 2, seed=0)
    epoch0 = order.indices(0) + order.indices(1) + order.indices(2)[:1]
    assert sorted(epoch0) == [0, 1, 2, 3, 4]
    assert BatchOrder(5, 2, seed=0).indices(7) == order.indices(7)
    assert order.indices(2)[1] == BatchOrder(5, 1, seed=0).indices(5)[0]  # epoch 1 starts
