"""Cells: the geometry that pricing, allocation and execution share, and the host's choice
of a step's cell (docs/SPECULATION.md, the policy).

Before launch the host chooses the step's cell (G, V) by the global argmax of expected tokens
per second over the measured cells, from survivals at least one step old (the drafts they
describe are already verified, so the budget cannot depend on the tokens it admits). Inside the
step the device ranks the fresh survivals and fills exactly that budget
(spec/selector.py select_verify_lengths).

Geometry, the one formula pricing, allocation and execution share: a cell of G rows and V
tokens serves R <= G live rows; the G - R pad rows take one token each, and the live rows get
their anchors plus D = V - G drafts in all. V = G means no drafting (plain decoding).

  G 4, R 3, V 10:  pad rows 1 x 1 token; live rows 3 anchors + D = 6 drafts

Reach: the most drafts a row of the cell may verify, one past the cell's mean budget a row
(D / G rounded up), at most K. No row verifies a slot past it, so the drafter's heads (LM,
Markov, confidence) run over the first `reach` slots only, and the device's selection caps
every row there. The full block reaches K; a narrow cell drafts (and costs) less:

  K 7, G 256:  V 512 (D/G 1) -> reach 2;  V 1024 (3) -> 4;  V 1536 (5) -> 6;  V 2048 -> 7

Survival a[r, j] is the calibrated probability that drafts 1..j of row r all survive
(survival.py survival).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from dspark.policy.cost_table import CostTable
from dspark.policy.tuning import TUNING


@dataclass(frozen=True)
class CellGeometry:
    num_rows: int  # G
    num_tokens: int  # V
    num_live: int  # R
    num_drafts: int  # D = V - G, drafts shared by the live rows

    @property
    def drafts(self) -> bool:
        return self.num_drafts > 0


def cell_reach(g: int, v: int, draft_len: int) -> int:
    """The cell (G, V)'s reach (module docstring): ceil(D / G) + 1, at most K."""
    return min(draft_len, -(-(v - g) // g) + 1)


def cell_geometry(g: int, v: int, num_live: int) -> CellGeometry:
    if not 1 <= num_live <= g <= v:
        raise ValueError(f"cell G={g} V={v} cannot serve {num_live} live rows")
    return CellGeometry(g, v, num_live, v - g)


def expected_tokens(a: torch.Tensor | np.ndarray, num_drafts: int) -> float:
    """Live rows' anchors plus the D highest survivals (always a prefix of each row)."""
    return _expected_by_budget(a)(num_drafts)


def _expected_by_budget(a: torch.Tensor | np.ndarray) -> Callable[[int], float]:
    """num_drafts -> expected tokens for the rows' survivals [R, K]: sorted once on the host,
    so pricing every cell of a G costs one sort."""
    a = np.asarray(a, dtype=np.float64)
    num_live = a.shape[0]
    best_first = np.concatenate([[0.0], np.cumsum(np.sort(a, axis=None)[::-1])])

    def expected(num_drafts: int) -> float:
        return num_live + float(best_first[min(max(num_drafts, 0), best_first.size - 1)])

    return expected


@dataclass(frozen=True)
class CellChoice:
    geometry: CellGeometry
    expected_tokens_per_s: float
    reason: str  # why this cell (for the log and the metrics)


def choose_cell(
    lagged_survival: torch.Tensor | np.ndarray,  # [R, K] from the previous step's confidences
    g: int,
    table: CostTable,
    draft_len: int,
    min_gain: float = TUNING.min_gain,
    drafting_now: bool = True,
) -> CellChoice:
    """The measured cell of G rows with the highest expected tokens per second.

    The incumbent is the full block while drafting (fixed K, the safe default) and plain
    decoding while not. Another cell must beat the incumbent by min_gain, and by that margin
    twice over when it switches drafting off or back on (hysteresis: noise in the lagged
    estimates cannot flip the mode every step). A budget of D drafts expects R plus the sum of
    the D largest survivals within the cell's reach (the first `reach` of each row).
    """
    by_reach: dict[int, Callable[[int], float]] = {}  # (one sort per distinct reach)

    def expected(num_drafts: int, reach: int) -> float:
        if reach not in by_reach:
            by_reach[reach] = _expected_by_budget(np.asarray(lagged_survival)[:, :reach])
        return by_reach[reach](num_drafts)

    num_live = lagged_survival.shape[0]
    return _best_cell(g, table.cells[g], num_live, draft_len, expected, min_gain, drafting_now)


def choose_drafting(
    num_live: int,
    survival_sum: float,  # sum over the live rows of their K lagged survivals
    g: int,
    table: CostTable,
    draft_len: int,
    min_gain: float = TUNING.min_gain,
    drafting_now: bool = True,
) -> CellChoice:
    """choose_cell restricted to G's plain and full-block cells, from the survivals' sum.

    The full block verifies every drafted position (D = G K >= R K candidates), so its expected
    tokens are R + the sum of all survivals; plain decoding's are R. The per-row survivals are
    not needed, which keeps the choice O(R) on the host.
    """
    row, full = table.cells[g], g * (draft_len + 1)
    if full_block_pays(num_live, survival_sum, row[g], row[full], min_gain, drafting_now):
        v, tokens, reason = full, num_live + survival_sum, "full block"
    else:
        v, tokens, reason = g, num_live + 0.0, "no drafting"
    return CellChoice(cell_geometry(g, v, num_live), tokens / row[v], reason)


def full_block_pays(
    num_live: int,
    survival_sum: float,  # sum over the live rows of their K lagged survivals
    plain_s: float,  # G's plain cell, seconds
    full_s: float,  # G's full block, seconds
    min_gain: float,
    drafting_now: bool,
) -> bool:
    """choose_drafting's choice in a few float comparisons (the drafting policy makes it before
    every step, and builds no objects for it): _best_cell over the two cells, where either one
    beating the incumbent switches the mode, so the margin is (1 + min_gain)^2 both ways.

      R 2, survival sum 2.1, plain 1.0 s, full 2.0 s: plain 2 / 1.0 = 2.0 tokens/s, full
      (2 + 2.1) / 2.0 = 2.05. Drafting, the full block stays (plain would need 2.05 x 1.02^2 =
      2.13); not drafting, plain stays (the full block would need 2.0 x 1.02^2 = 2.08).
    """
    plain, full = num_live / plain_s, (num_live + survival_sum) / full_s
    margin = (1 + min_gain) ** 2  # (>= 1: beating the incumbent by it beats the incumbent)
    if drafting_now:  # (the incumbent is the full block)
        return not plain > full * margin
    return full > plain * margin


def _best_cell(
    g: int,
    row: dict[int, float],  # V -> seconds
    num_live: int,
    draft_len: int,
    expected: Callable[[int, int], float],  # (num_drafts, reach) -> expected tokens
    min_gain: float,
    drafting_now: bool,
) -> CellChoice:
    """Argmax of expected tokens / seconds over the cells in `row` (V -> seconds)."""
    full = g * (draft_len + 1)

    def theta(v: int) -> float:
        num_drafts = cell_geometry(g, v, num_live).num_drafts
        return expected(num_drafts, cell_reach(g, v, draft_len)) / row[v]

    incumbent = full if drafting_now or g not in row else g
    floor = theta(incumbent)
    best_v, best = incumbent, floor
    for v in sorted(row):
        if v == incumbent:
            continue
        switches_mode = (v == g) != (incumbent == g)
        margin = (1 + min_gain) ** (2 if switches_mode else 1)
        if theta(v) > floor * margin and theta(v) > best:
            best_v, best = v, theta(v)
    reason = "full block" if best_v == full else ("no drafting" if best_v == g else "trimmed")
    return CellChoice(cell_geometry(g, best_v, num_live), best, reason)
