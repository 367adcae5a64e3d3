"""The synchronous planner (Algorithm 1, a reference function): its worked example, its pricing
by a cost table's cells, and why it must stop early.

The losslessness test reproduces the paper's counterexample (docs/SPECULATION.md, the
scheduler) through the real
rejection sampler: one request, K = 2, vocabulary {A, B}, target (0.7, 0.3) at every position,
draft (0.5, 0.5); survival a1 = 0.8, and a2 = 0.72 if the first draft is A, else 0 (the
confidence head reads the previous token). Step times 1.0, 2.0, 2.22 for 1, 2, 3 tokens.
Algorithm 1 stops at draft 1 (Theta 0.9 < 1.0) whatever was drafted, so the first emitted token
is the target's: P(A) = 0.7. The retrospective argmax verifies draft 1 only when draft 2 looks
good, i.e. only when draft 1 is A, and emits A with probability 0.5 + 0.5 * 0.7 = 0.85.
The lagged-capacity scheduler (the production one) picks the budget from the previous step's
survivals (another, already verified block) by the global argmax, then fills it with this
step's fresh survivals on the device: unbiased too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dspark.policy.cells import choose_cell
from dspark.policy.cost_table import CostTable
from dspark.policy.planner import candidate_order, plan_sync, staircase
from dspark.spec.selector import select_verify_lengths
from dspark.spec.verifier import VerifyInput, verify
from tests.helpers import chi2_critical_001

TIMES = {1: 1.0, 2: 2.0, 3: 2.22}


def plan_retrospective(
    survival: list[list[float]], step_time: Callable[[int], float | None]
) -> list[int]:
    """The LOSSY variant Algorithm 1 must not be: scan every prefix of the order and take the
    best (the counterexample below shows why it is not lossless)."""
    num_rows = len(survival)
    lengths = [0] * num_rows
    tokens, expected = num_rows, float(num_rows)
    best, best_lengths = expected / step_time(tokens), list(lengths)
    for r, j in candidate_order(survival):
        if j != lengths[r] + 1:
            continue
        t = step_time(tokens + 1)
        if t is None:
            break
        lengths[r], tokens, expected = j, tokens + 1, expected + survival[r][j - 1]
        if expected / t > best:
            best, best_lengths = expected / t, list(lengths)
    return best_lengths


def test_worked_example_of_the_docstring():
    survival = [[0.9, 0.6], [0.8, 0.1]]
    assert candidate_order(survival) == [(0, 1), (1, 1), (0, 2), (1, 2)]
    assert plan_sync(survival, lambda b: 1 + 0.1 * (b - 2)) == [2, 1]
    # ties: position first, then row; a step time the table lacks ends the plan
    assert candidate_order([[0.5, 0.5], [0.5, 0.5]]) == [(0, 1), (1, 1), (0, 2), (1, 2)]
    assert plan_sync([[0.9, 0.9]], lambda b: {1: 1.0, 2: 1.0}.get(b)) == [1]


def test_staircase_worked_example():
    """A step of B live tokens costs the smallest measured cell holding them and the pad rows."""
    step_time = staircase({4: 1.0, 8: 1.2, 16: 2.0}, 4 - 3)
    assert [step_time(b) for b in (3, 5, 14, 16)] == [1.0, 1.2, 2.0, None]
    # Algorithm 1 priced by those cells, R 3: the V = 8 stair holds the four best drafts
    # (Theta 5.4 / 1.2 = 4.5); the fifth needs V = 16 (5.5 / 2.0): stop
    assert plan_sync([[0.9, 0.5], [0.8, 0.1], [0.2, 0.1]], step_time) == [2, 1, 1]


def _first_tokens(planner, n: int = 20000) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    drafts = torch.randint(0, 2, (n, 2), generator=g)  # x1, x2 ~ (0.5, 0.5); A = 0, B = 1
    lengths = []
    for x1 in drafts[:, 0].tolist():
        a2 = 0.8 * 0.9 if x1 == 0 else 0.0
        lengths.append(planner([[0.8, a2]], TIMES.get)[0])
    verify_len = torch.tensor(lengths)
    cu = torch.zeros(n + 1, dtype=torch.int64)
    cu[1:] = (verify_len + 1).cumsum(0)
    target = torch.tensor([0.7, 0.3]).expand(int(cu[-1]), -1)
    out = verify(VerifyInput(
        target_probs=target, draft_probs=torch.full((n, 2, 2), 0.5), draft_tokens=drafts,
        verify_len=verify_len, cu_num_tokens=cu, anchor_positions=torch.zeros(n, dtype=torch.long),
        seeds=torch.arange(n), is_greedy=torch.zeros(n, dtype=torch.bool),
    ))  # fmt: skip
    return out.tokens[:, 0]


def _chi2_vs_target(first: torch.Tensor) -> float:
    n = len(first)
    counts = torch.bincount(first, minlength=2).float()
    expected = torch.tensor([0.7, 0.3]) * n
    return float(((counts - expected) ** 2 / expected).sum())


def plan_lagged(survival: list[list[float]], step_time: Callable[[int], float | None]) -> list[int]:
    """The lagged-capacity scheduler on the counterexample: the cell (its budget of drafts) by
    the global argmax over the measured cells, from the survivals of a PREVIOUS block (an
    independent draw of the same law: x1 = A or B with probability 0.5, already verified),
    then the device's fixed-budget fill from this step's fresh survivals."""
    previous_a2 = 0.8 * 0.9 if torch.rand(1, generator=_LAG_RNG).item() < 0.5 else 0.0
    table = CostTable({}, {1: {v: step_time(v) for v in (1, 2, 3)}})
    cell = choose_cell(torch.tensor([[0.8, previous_a2]]), 1, table, 2, min_gain=0.0)
    fresh = torch.tensor(survival)
    return select_verify_lengths(fresh, cell.geometry.num_drafts).tolist()


_LAG_RNG = torch.Generator().manual_seed(1)


def test_algorithm_1_is_lossless_and_the_retrospective_argmax_is_not():
    critical = chi2_critical_001(1)
    lossless = _first_tokens(plan_sync)
    assert _chi2_vs_target(lossless) < critical
    lagged = _first_tokens(plan_lagged)
    assert _chi2_vs_target(lagged) < critical
    assert abs((lagged == 0).float().mean().item() - 0.70) < 0.01
    lossy = _first_tokens(plan_retrospective)
    assert _chi2_vs_target(lossy) > critical  # the test can tell the difference
    assert abs((lossy == 0).float().mean().item() - 0.85) < 0.01
