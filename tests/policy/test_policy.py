"""The per-step choice (plain decoding, a trimmed cell or the full block) from the cost table's
prices and the lagged survival estimates: hysteresis, the dwell, staleness and probing."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dspark.policy.cost_table import CostTable, full_block_tokens
from dspark.policy.policy import Decision, DraftingPolicy
from dspark.policy.tuning import TUNING

K = 7

TABLE = CostTable({}, {1: {1: 1.0, 8: 1.5}, 64: {64: 1.0, 512: 2.4}})

ONES = {False: torch.ones(K), True: torch.ones(K)}  # uncalibrated, greedy or not


def _policy(table=TABLE, dwell=2, probe_steps=1, decision_lag=1, **tuning):
    """A policy at TABLE's prices with the dwell and any other constants given."""
    tuning = replace(TUNING, dwell_steps=dwell, **tuning)
    return DraftingPolicy(table, ONES, K, probe_steps, decision_lag, tuning=tuning)


def _ids(n):
    return [f"r{i}" for i in range(n)]


def test_unknown_requests_count_as_fully_confident():
    p = _policy(dwell=0)
    # 64 rows, a = 1: full block 64 * 8 / 2.4 = 213 tokens/s against plain 64 / 1.0
    assert p.decide(_ids(64)).drafting


def test_drafting_goes_off_under_load_at_once_and_back_on_after_the_dwell():
    p = _policy(dwell=2)
    p.observe(_ids(64), torch.zeros(64, K), [False] * 64)  # c = 0.5: sum 0.5 + 0.25 .. ~ 0.99
    d = p.decide(_ids(64))  # 64 * 1.99 / 2.4 = 53 < 64 / 1.0 / 1.02^2: off, no dwell first
    assert (d.drafting, d.reason) == (False, "no drafting")
    assert p.decide(_ids(1)) == Decision(False, "dwell")  # held off for min_dwell_steps
    assert p.decide(_ids(64)) == Decision(False, "no drafting")
    d = p.decide(_ids(1))  # G = 1: 1.99 / 1.5 = 1.33 beats 1.0 by more than 1.02^2
    assert (d.drafting, d.reason) == (True, "full block")
    assert p.decide(_ids(64)) == Decision(False, "no drafting")  # and off again at once
    assert p.counters["drafting_switches"] == 3
    assert p.counters["steps_not_drafting"] == 4


def test_stale_survivals_count_as_fully_confident():
    # G = 64: t_full / t_plain = 2.4, so with probe_budget 0.5 survivals go stale after
    # ceil(1.4 / 0.5) = 3 steps (with the 1% default: 140)
    p = _policy(dwell=0, probe_budget=0.5)
    assert (p.stale_after(64), _policy().stale_after(64), _policy().stale_after(1)) == (3, 140, 50)
    p.observe(_ids(64), torch.zeros(64, K), [False] * 64)
    assert [p.decide(_ids(64)).drafting for _ in range(4)] == [False] * 4
    # observed at step 0; at step 4 they are older than 3 steps: a = 1 again
    assert p.decide(_ids(64)) == Decision(True, "full block")
    assert p.survival_sum(_ids(2), 64) == 2 * K
    with pytest.raises(ValueError, match="probe_budget must be > 0"):
        _policy(probe_budget=0)


def test_a_probe_of_two_steps_makes_staleness_twice_as_long():
    """Drafting steps launched ahead: the second step of a probe is decided before the first's
    survivals are read, so a probe costs two drafting steps and survivals stay fresh twice
    as long for the same budget (G = 64: 2 x 1.4 / 0.5 -> 6 steps; 2 x 140 = 280 at 1%)."""
    p = _policy(dwell=0, probe_budget=0.5, probe_steps=2)
    assert (p.stale_after(64), _policy(probe_steps=2).stale_after(64)) == (6, 280)
    p.observe(_ids(64), torch.zeros(64, K), [False] * 64)
    steps = [p.decide(_ids(64)).drafting for _ in range(8)]
    assert steps == [False] * 7 + [True]  # observed at step 0, older than 6 at step 7
    with pytest.raises(ValueError, match="probe_steps must be >= 1, got 0"):
        _policy(probe_steps=0)


def test_staleness_follows_the_realised_prices():
    """A probe costs what a drafting step realises: G = 64's full block priced 2.4 plain steps
    by the table (stale after 140 steps) but realised at 1.5x it, 3.6: stale after
    ceil(2.6 / 0.01) = 260."""
    p = _policy(min_price_steps=2)
    assert p.stale_after(64) == 140  # nothing measured yet: the table's prices
    plain, full = Decision(False, "no drafting", (64, 64)), Decision(True, "full block", (64, 512))
    for _ in range(2):
        p.record_step(plain, 1.0)
        p.record_step(full, 1.5 * 2.4)
    assert p.stale_after(64) == 260
    assert p.stale_after(1) == 50  # G = 1 measured nothing: its table's


def test_a_sampled_step_sets_staleness_by_the_sampled_cells():
    """G = 64 sampled: t_full / t_plain = 4.4 (greedy 2.4), so with probe_budget 0.5 a sampled
    batch's survivals go stale after ceil(3.4 / 0.5) = 7 steps, a greedy batch's after 3."""
    sampled = {1: {1: 1.0, 8: 2.0}, 64: {64: 1.0, 512: 4.4}}
    table = CostTable({}, TABLE.cells, sampled)
    p = _policy(table, dwell=0, probe_budget=0.5)
    assert (p.stale_after(64), p.stale_after(64, sampled=True)) == (3, 7)
    assert _policy(probe_budget=0.5).stale_after(64, sampled=True) == 3  # no sampled cells
    p.observe(_ids(64), torch.zeros(64, K), [False] * 64)
    # observed at step 0: older than 7 steps at step 8 (greedy: older than 3 at step 4)
    steps = [p.decide(_ids(64), sampled=True).drafting for _ in range(9)]
    assert steps == [False] * 8 + [True]


def test_hysteresis_needs_the_squared_gain_to_switch():
    # plain 1.0, full 1.99 / 1.0 * x: a full block just 3% better than plain while drafting is
    # off does not turn it on (it needs 1.02^2 = 4.04%), 5% does
    for full, expect in ((1.99 / 1.03, False), (1.99 / 1.05, True)):
        p = _policy(CostTable({}, {1: {1: 1.0, 8: full}}), dwell=0)
        p.drafting = False
        p.observe(["r0"], torch.zeros(1, K), [False])
        assert p.decide(["r0"]).drafting is expect


def test_no_table_always_drafts_and_trimmed_cells_are_not_runnable():
    p = _policy(table=None)
    assert p.decide(_ids(64)).reason == "no table" and p.decide(_ids(3)).drafting
    assert _policy(table=CostTable({}, {4: {4: 1.0, 12: 1.3}})).table is None  # V=12 is trimmed
    p = _policy(dwell=0)
    assert p.decide(_ids(65)).reason == "batch beyond the table"


def test_policy_prices_trimmed_cells_from_per_position_survivals():
    g, k = 4, 3
    table = CostTable({}, {g: {g: 1.0, 2 * g: 1.1, full_block_tokens(g, k): 1.6}})
    ones = {False: torch.ones(k), True: torch.ones(k)}
    tuning = replace(TUNING, dwell_steps=0, regression_half_life=1e9)  # (estimates that do not age)
    policy = DraftingPolicy(table, ones, k, trimmed_widths=(2,), tuning=tuning)
    ids = [f"r{i}" for i in range(4)]
    # first drafts likely, later ones hopeless: one draft a row (w = 2) is the best cell
    logits = torch.tensor([[3.0, -4.0, -4.0]] * 4)
    policy.observe(ids, logits, [False] * 4)
    decision = policy.decide(ids)
    assert decision.drafting and decision.reason == "trimmed"
    assert decision.trimmed_cell == (g, 2 * g)
    a = policy.lagged_survival(ids, g)
    assert a.shape == (4, k) and a.sum() == pytest.approx(policy.survival_sum(ids, g), rel=1e-5)
    # every draft survives: the full block
    policy.observe(ids, torch.full((4, k), 9.0), [False] * 4)
    assert policy.decide(ids).reason == "full block"
    # without the runner's trimmed cells the table's are ignored
    plain_policy = DraftingPolicy(table, ones, k, tuning=tuning)
    assert set(plain_policy.table.cells[g]) == {g, full_block_tokens(g, k)}


def test_a_batch_that_samples_is_priced_by_the_sampled_cells():
    """Greedy full blocks cheap, sampled ones dear: the same survivals draft when every row is
    greedy and do not when one samples; without sampled cells the greedy ones price it too,
    counted. Sampled cells for other G than the greedy ones are refused."""
    sampled = {1: {1: 1.0, 8: 4.0}, 64: {64: 1.0, 512: 9.0}}
    table = CostTable({}, dict(TABLE.cells), sampled)
    p = _policy(table, dwell=0)
    assert p.sampled_table is not None
    p.observe(["r0"], torch.zeros(1, K), [False])  # survival sum ~0.99: 1.99 / 1.5 at G = 1
    assert p.decide(["r0"], sampled=False).drafting
    assert not p.decide(["r0"], sampled=True).drafting  # 1.99 / 4.0 < 1 / 1.0
    greedy_only = _policy(dwell=0)
    greedy_only.observe(["r0"], torch.zeros(1, K), [False])
    assert greedy_only.decide(["r0"], sampled=True).drafting
    assert greedy_only.counters["sampled_priced_by_greedy_cells"] == 1
    assert _policy(CostTable({}, dict(TABLE.cells), {1: sampled[1]})).sampled_table is None


def test_a_batch_runs_at_the_smallest_g_that_holds_it():
    """policy._graphs_by_rows' example: with G 1, 4, 16, num_rows 0 1 | 2 3 4 | 5 .. 16 are
    priced at G 1 1 | 4 4 4 | 16; 17 rows are beyond the table."""
    table = CostTable({}, {g: {g: 1.0, full_block_tokens(g, K): 2.0} for g in (1, 4, 16)})
    p = _policy(table)
    assert [p.priced_cells(n, False)[0] for n in range(17)] == [1, 1, 4, 4, 4] + [16] * 12
    assert p.priced_cells(17, False) is None
    assert p.decide(_ids(17)) == Decision(True, "batch beyond the table")
