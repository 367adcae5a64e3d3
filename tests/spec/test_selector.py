"""The device's fixed-budget fill of a step's cell (spec/selector.py): the D candidates of
highest fresh survival, ties by position then row, never past a row's cap."""

from __future__ import annotations

import torch

from dspark.spec.selector import select_verify_lengths


def test_device_selection_worked_example_and_ties():
    a = torch.tensor([[0.9, 0.5], [0.9, 0.2]])
    assert select_verify_lengths(a, 3).tolist() == [2, 1]
    assert select_verify_lengths(a, 0).tolist() == [0, 0]
    assert select_verify_lengths(a, 99).tolist() == [2, 2]
    ties = torch.full((3, 2), 0.5)  # all equal: position 1 of every row before any position 2
    assert select_verify_lengths(ties, 4).tolist() == [2, 1, 1]
    # caps (shortened windows, pad rows at 0): never chosen past them, even with budget left
    assert select_verify_lengths(a, 3, torch.tensor([1, 2])).tolist() == [1, 2]
    assert select_verify_lengths(a, 99, torch.tensor([2, 0])).tolist() == [2, 0]
    # the empty batch and the empty budget
    assert select_verify_lengths(torch.zeros(0, 2), 5).tolist() == []
