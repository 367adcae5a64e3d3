"""The lagged-capacity scheduler: geometry, survivals, the host's cell choice with hysteresis,
and the device's fixed-budget selection (ties by position, then row)."""

from __future__ import annotations

import pytest
import torch

from dspark.policy.cells import (
    cell_geometry,
    choose_cell,
    choose_drafting,
    expected_tokens,
    select_verify_lengths,
    survival,
)
from dspark.policy.cost_table import CostTable

K = 3


def test_geometry_worked_example():
    geo = cell_geometry(4, 10, 3)
    assert (geo.num_rows, geo.num_tokens, geo.num_live, geo.num_drafts) == (4, 10, 3, 6)
    assert not cell_geometry(4, 4, 4).drafts
    with pytest.raises(ValueError, match="cannot serve 5 live rows"):
        cell_geometry(4, 10, 5)


def test_survival_is_the_cumulative_product_of_calibrated_confidences():
    logits = torch.tensor([[2.0, 0.0, -2.0]])
    temps = torch.tensor([1.0, 2.0, 0.5])
    a = survival(logits, temps)
    c = torch.sigmoid(torch.tensor([2.0, 0.0, -4.0]))
    torch.testing.assert_close(a[0], torch.cumprod(c, 0))
    assert (a[:, 1:] <= a[:, :-1]).all()
    assert expected_tokens(torch.tensor([[0.9, 0.5], [0.8, 0.1]]), 2) == pytest.approx(2 + 1.7)


def _table(g, times):  # times: V -> seconds
    return CostTable({}, {g: dict(times)})


def test_host_choice_full_trimmed_plain_and_hysteresis():
    g, full = 2, 2 * (K + 1)
    confident = torch.ones(2, K)  # every draft survives: the full block wins
    table = _table(g, {2: 1.0, 4: 1.1, full: 1.3})
    assert choose_cell(confident, g, table, K).reason == "full block"
    # late drafts hopeless: verifying one per row is worth it
    unsure = torch.tensor([[0.9, 0.05, 0.01], [0.9, 0.05, 0.01]])
    choice = choose_cell(unsure, g, table, K)
    assert choice.reason == "trimmed" and choice.geometry.num_drafts == 2
    # nothing survives: stop drafting; once stopped, only a clear gain resumes it
    hopeless = torch.full((2, K), 0.01)
    assert choose_cell(hopeless, g, table, K).reason == "no drafting"
    slight = _table(g, {2: 1.0, full: 2.0})
    a = torch.tensor([[0.4, 0.35, 0.3], [0.4, 0.35, 0.3]])  # full: (2 + 2.1) / 2.0 = 2.05
    assert choose_cell(a, g, slight, K, min_gain=0.02, drafting_now=True).reason == "full block"
    # plain gives 2.0: within the doubled margin of 2.05, so no switch either way
    assert choose_cell(a, g, slight, K, min_gain=0.02, drafting_now=False).reason == "no drafting"


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


def test_a_switch_off_must_also_clear_its_round_trip():
    """off_margin (the drafting policy's price of a switch's round trip) raises the bar for
    turning drafting off only: plain decoding 11% ahead switches it off at the doubled min_gain
    (4%), not with 26% more; from plain decoding the bar to resume is unchanged."""
    g, full = 2, 2 * (K + 1)
    table = _table(g, {2: 1.0, full: 2.0})
    a = torch.tensor([[0.4, 0.2, 0.2], [0.4, 0.2, 0.2]])  # full: (2 + 1.6) / 2.0 = 1.8, plain 2.0
    assert choose_cell(a, g, table, K, 0.02, drafting_now=True).reason == "no drafting"
    assert choose_cell(a, g, table, K, 0.02, True, off_margin=0.26).reason == "full block"
    assert choose_drafting(2, 1.6, g, table, K, 0.02, True).reason == "no drafting"
    assert choose_drafting(2, 1.6, g, table, K, 0.02, True, off_margin=0.26).reason == (
        "full block"
    )
    confident = torch.ones(2, K)  # full: (2 + 6) / 2.0 = 4.0 against 2.0: resumes either way
    for off in (0.0, 0.26):
        assert choose_cell(confident, g, table, K, 0.02, False, off).reason == "full block"
