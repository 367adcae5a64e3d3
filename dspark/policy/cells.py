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
    a = np.asarray(a, dtype=np.float64)
    return cell_tokens(a, num_drafts, a.shape[1])


def cell_tokens(a: np.ndarray, num_drafts: int, reach: int) -> float:
    """Expected tokens of a budget of D = num_drafts drafts within `reach`: the live rows'
    anchors plus the D highest of the survivals a[:, :reach] [R, K] (float64), which are a
    prefix of each row since a row's survivals do not increase. One partition, no sort.

      a [[0.9, 0.5], [0.8, 0.1]]:  D 3, reach 2 -> 2 + 0.9 + 0.8 + 0.5 = 4.2;
                                   D 3, reach 1 -> 2 + 0.9 + 0.8 = 3.7 (all of the reach)
    """
    num_live, window = a.shape[0], a[:, :reach]
    drop = window.size - num_drafts  # the candidates left out
    if num_drafts <= 0:
        return float(num_live)
    if drop <= 0:
        return num_live + float(window.sum())
    return num_live + float(np.partition(window.ravel(), drop)[drop:].sum())


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
    a = np.asarray(lagged_survival, dtype=np.float64)
    row = table.cells[g]
    v, theta = best_cell(a, g, row, draft_len, min_gain, drafting_now)
    full = g * (draft_len + 1)
    reason = "full block" if v == full else ("no drafting" if v == g else "trimmed")
    return CellChoice(cell_geometry(g, v, a.shape[0]), theta, reason)


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


def best_cell(
    a: np.ndarray,  # [R, K] lagged survivals (float64)
    g: int,
    row: dict[int, float],  # V -> seconds: G's cells
    draft_len: int,
    min_gain: float,
    drafting_now: bool,
    full_tokens: float | None = None,  # the full block's expected tokens, if known (R + sum)
) -> tuple[int, float]:
    """choose_cell's choice over `row` as (V, expected tokens per second), each cell priced
    once (the drafting policy calls this before every step, and builds no objects for it)."""
    num_live, full = a.shape[0], g * (draft_len + 1)
    if not 1 <= num_live <= g:
        raise ValueError(f"cells of G={g} cannot serve {num_live} live rows")
    theta = {v: (full_tokens if v == full and full_tokens is not None else
                 cell_tokens(a, v - g, cell_reach(g, v, draft_len))) / row[v]
             for v in row}  # fmt: skip
    incumbent = full if drafting_now or g not in row else g
    floor = theta[incumbent]
    best_v, best = incumbent, floor
    for v in sorted(row):
        if v == incumbent:
            continue
        switches_mode = (v == g) != (incumbent == g)
        margin = (1 + min_gain) ** (2 if switches_mode else 1)
        if theta[v] > floor * margin and theta[v] > best:
            best_v, best = v, theta[v]
    return best_v, best


def trimmed_may_win(
    trimmed: tuple[int, ...],  # V of G's trimmed cells
    num_live: int,
    survival_sum: float,  # sum over the live rows of their K lagged survivals
    row: dict[int, float],  # V -> seconds: G's cells
    g: int,
    full: int,  # V of the full block
    min_gain: float,
    drafting_now: bool,
) -> bool:
    """Could best_cell choose one of the trimmed cells? Its expected tokens are at most
    R + min(D, survival_sum) (D drafts, none above 1, none beyond the rows' survivals), so a
    cell whose bound does not beat the incumbent by its margin cannot be chosen, and the choice
    is full_block_pays' (the drafting policy then reads no per-position survivals). A trimmed
    cell that costs no less than the full block is never better than it.

      R 16, sum 56 (3.5 a row), full 4.0 ms, w 3 (D 32) 3.6 ms: (16 + 32) / 3.6 = 13.3 tokens
      a ms against the full block's (16 + 56) / 4.0 = 18: the full block stays, unpriced.
    """
    floor = (num_live + survival_sum) / row[full] if drafting_now else num_live / row[g]
    margin = (1 + min_gain) if drafting_now else (1 + min_gain) ** 2
    return any(
        row[v] < row[full] and (num_live + min(v - g, survival_sum)) / row[v] > floor * margin
        for v in trimmed
    )  # fmt: skip
