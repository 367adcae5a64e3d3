"""Cells: the geometry, survivals and expected tokens, the host's cell choice with hysteresis
(the device's fixed-budget fill: tests/spec/test_selector.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dspark.policy.cells import (
    best_cell,
    cell_geometry,
    cell_reach,
    cell_tokens,
    choose_cell,
    choose_drafting,
    expected_tokens,
    full_block_pays,
    trimmed_may_win,
)
from dspark.policy.cost_table import CostTable
from dspark.policy.survival import host_survivals, survival

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


def test_a_cells_reach_caps_what_it_expects():
    """policy/cells.py's worked example of the reach (one past the mean budget a row, at most
    K); a narrow cell expects only the survivals within its reach: one confident row among
    hopeless ones fills a budget of 4 with 3 drafts uncapped, 2 within a reach of 2."""
    assert [cell_reach(256, v, 7) for v in (256, 512, 1024, 1536, 2048)] == [1, 2, 4, 6, 7]
    assert cell_reach(3, 4, 7) == 2  # (D / G rounded up: 1 / 3 -> 1)
    a = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert expected_tokens(a, 4) == 4 + 3
    choice = choose_cell(a, 4, _table(4, {4: 1.0, 8: 1.0, 16: 100.0}), K, drafting_now=False)
    assert choice.geometry.num_tokens == 8 and choice.expected_tokens_per_s == 4 + 2


def test_host_survivals_equal_the_devices_row_by_row():
    """The host's survivals (once a step, for the metrics and the policy) are survival() with
    each row's temperatures: greedy rows the greedy fit, sampled rows the other; a block wider
    than K is cut to K."""
    temps = {False: torch.tensor([1.0, 2.0, 0.5]), True: torch.tensor([0.7, 1.5, 1.0])}
    logits = torch.randn(4, K + 2)
    greedy = [True, False, False, True]
    a = host_survivals(logits, greedy, {g: t.double().numpy() for g, t in temps.items()})
    rows = torch.stack([temps[g] for g in greedy])
    torch.testing.assert_close(torch.from_numpy(a), survival(logits[:, :K], rows).double())
    for same in ([True] * 4, [False] * 4):  # (one row of temperatures for the batch)
        a = host_survivals(logits, same, {g: t.double().numpy() for g, t in temps.items()})
        expected = survival(logits[:, :K], temps[same[0]]).double()
        torch.testing.assert_close(torch.from_numpy(a), expected)


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
    # the sum-only choice agrees: plain and the full block of G
    assert choose_drafting(2, 2.1, g, slight, K, 0.02, drafting_now=True).reason == "full block"
    assert choose_drafting(2, 2.1, g, slight, K, 0.02, drafting_now=False).reason == "no drafting"


def test_the_policys_two_cell_choice_is_choose_cell_over_plain_and_the_full_block():
    """full_block_pays (the policy's choice before every step: a few float comparisons, no
    objects) picks what choose_cell picks over G's plain and full-block cells, incumbent and
    margins included; its docstring's example first."""
    assert full_block_pays(2, 2.1, 1.0, 2.0, min_gain=0.02, drafting_now=True)
    assert not full_block_pays(2, 2.1, 1.0, 2.0, min_gain=0.02, drafting_now=False)
    rng = np.random.default_rng(0)
    g, chosen = 4, set()
    for _ in range(2000):
        a = np.cumprod(rng.uniform(0.0, 1.0, (int(rng.integers(1, g + 1)), K)), axis=1)
        plain_s = float(rng.uniform(0.5, 1.5))
        table = _table(g, {g: plain_s, g * (K + 1): plain_s * float(rng.uniform(1.0, 3.0))})
        gain, drafting_now = float(rng.uniform(0.0, 0.1)), bool(rng.integers(2))
        total = float(np.cumsum(np.sort(a, axis=None)[::-1])[-1])  # (choose_cell's sum)
        pays = full_block_pays(a.shape[0], total, table.cells[g][g], table.cells[g][g * (K + 1)],
                               gain, drafting_now)  # fmt: skip
        reason = choose_cell(a, g, table, K, gain, drafting_now).reason
        assert reason == ("full block" if pays else "no drafting")
        chosen.add((pays, drafting_now))
    assert len(chosen) == 4  # (both choices from both incumbents)


def test_cell_tokens_is_the_sum_of_the_highest_survivals_within_reach():
    """One partition, against the sort it replaces: R + the D highest of a[:, :reach]; the
    docstring's example first."""
    a = np.array([[0.9, 0.5], [0.8, 0.1]])
    assert cell_tokens(a, 3, 2) == pytest.approx(4.2)
    assert cell_tokens(a, 3, 1) == pytest.approx(3.7)
    assert cell_tokens(a, 0, 2) == 2.0
    rng = np.random.default_rng(1)
    for _ in range(500):
        r, k = int(rng.integers(1, 20)), int(rng.integers(1, 8))
        a = np.cumprod(rng.uniform(0.0, 1.0, (r, k)), axis=1)
        reach, drafts = int(rng.integers(1, k + 1)), int(rng.integers(0, r * k + 3))
        best_first = np.sort(a[:, :reach], axis=None)[::-1]
        assert cell_tokens(a, drafts, reach) == pytest.approx(r + best_first[:drafts].sum())


def test_trimmed_cells_that_cannot_win_leave_the_two_cell_choice():
    """trimmed_may_win's bound (R + min(D, sum) tokens) is safe: where it says no trimmed cell
    can win, best_cell over every cell chooses what full_block_pays chooses; and where a trimmed
    cell wins, the bound let it through. Its docstring's example first."""
    row = {16: 1.1, 48: 3.6, 128: 4.0}
    assert not trimmed_may_win((48,), 16, 56.0, row, 16, 128, 0.02, True)
    rng = np.random.default_rng(2)
    g, k, outcomes = 8, 7, set()
    full = g * (k + 1)
    for _ in range(3000):
        r = int(rng.integers(1, g + 1))
        a = np.cumprod(rng.uniform(0.2, 1.0, (r, k)) ** rng.uniform(0.1, 3.0), axis=1)
        plain_s = float(rng.uniform(0.5, 1.5))
        full_s = plain_s * float(rng.uniform(1.2, 3.0))
        row = {g: plain_s, full: full_s}
        row |= {w * g: full_s * float(rng.uniform(0.6, 1.1)) for w in (2, 3, 5)}
        gain, drafting_now = float(rng.uniform(0.0, 0.05)), bool(rng.integers(2))
        total = float(a.sum())
        may_win = trimmed_may_win((2 * g, 3 * g, 5 * g), r, total, row, g, full, gain,
                                  drafting_now)  # fmt: skip
        v, _ = best_cell(a, g, row, k, gain, drafting_now, full_tokens=r + total)
        if not may_win:
            pays = full_block_pays(r, total, plain_s, full_s, gain, drafting_now)
            assert v == (full if pays else g)
        outcomes.add((may_win, v not in (g, full)))
    assert (False, True) not in outcomes
    assert {(True, True), (False, False), (True, False)} <= outcomes
