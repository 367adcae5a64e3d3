"""Whether the next step drafts, and which cell it runs: the lagged-capacity choice priced by
the measured cost table (docs/SPECULATION.md, the policy).

Drafting is not free: the block is drafted in full for every window, and on a small target the
whole speculative step costs several plain steps at high batch. Before each step the host prices
the cells of the step's graph size G that the engine can run:

  plain (V = G)           expected tokens R                      / step_seconds(G, G)
  full block (V = G(K+1)) expected tokens R + sum_r sum_j a[r, j] / step_seconds(G, G(K+1))

with a[r, j] the calibrated survivals of each running request's last verified block (at least
one step old: the drafts they describe are already verified, so the choice cannot depend on the
tokens it admits), computed with the greedy calibration for greedy requests. A request whose
survivals are stale counts as fully confident (a = 1, a sum of K); one that never drafted, as
the recent requests' mean.

The policy is a composition of three parts, each with its own module: the survival estimates
(survival.py: smoothing, the population of recent requests, persistence, online
recalibration), the realised step costs that scale the table's prices (realised_costs.py) and
the cell choice over the priced cells (cells.py). Its constants are tuning.py's.

Probing. While drafting is off nothing refreshes the survivals. They go stale after
probe_steps (t_full / t_plain - 1) / probe_budget steps at the step's G, priced as the choice
prices it (realised step costs included, since that is what a probe costs), so the probe (the
drafting steps that refresh them) costs at most probe_budget of the time spent not drafting:
with one step a probe, about 80 steps at G = 1 (t_full / t_plain = 1.8) and 290 at G = 256
(3.9). When drafting steps launch ahead (async scheduling with uniform windows) a probe is two
steps: the second is decided while the first is in flight, its survivals not yet read, so the
rows are still stale, and probe_steps is 2 (engine/spec_setup.py). A step priced by the sampled
cells sets it by those (a sampled drafting step costs more, so probing it is rarer for the same
budget). Load that falls (a smaller G, where the full block costs relatively less), new
requests and stale rows bring drafting back.

Flapping is prevented twice over. The other mode must beat the incumbent by (1 + min_gain)^2
(cells.full_block_pays), and once drafting is off it stays off for at least dwell_steps steps.
Switching drafting off is not delayed: a drafting step costs several plain steps at high load,
so one step of fresh confidences is enough to stop. (A switch costs one step that cannot launch
ahead: the plain step after a drafting one, whose inputs only verification knows; the drafting
step that resumes launches behind the plain one, engine.py.) Example, G = 64, K = 7, plain
1.1 ms, full 4.3 ms, survivals summing to 1.3 per row: plain 64 / 1.1 = 58 tokens/ms, full
64 * 2.3 / 4.3 = 34 tokens/ms, so drafting goes off; at G = 1 (1.15 vs 2.0 ms) the same request
gives 0.87 against 1.15 tokens/ms, and drafting comes back once the dwell has passed.

Realised step costs (realised_costs.py): the table prices steady steps, and a serving loop's
drafting steps (prefill tails, eager fallbacks at high load) cost more; the engine reports
each step's period with the cell it was decided as (record_step), and every cell is priced by
its table time scaled by the recent realised / table ratio.

A batch with any row that samples is priced by the table's sampled cells (measured at
temperature 1: a sampled drafting step costs more than a greedy one), or by the greedy cells
where the table has none (counted: sampled_priced_by_greedy_cells).

Trimmed cells. With trimmed_widths (the cells (G, w G) the runner can run, spec/ragged.py) and a
table that measured them, the choice is cells.best_cell over G's plain, trimmed and full
cells: the expected tokens of a budget of D drafts are R plus the D highest lagged survivals
within the cell's reach (cells.py), so each request's survivals are kept per position, not only
summed. A row's vector is its own smoothed one (or the population's, for a request that never
drafted) rescaled to the total the sums above give it, each position clipped to 1; a stale row
is all ones. The full block's expected tokens are those of the sum-only choice (R plus the
sum), and a table without trimmed cells gives exactly the choices above. The vectors are read
only when a trimmed cell could win (cells.trimmed_may_win: a bound from the sum alone); at
G = 1-8 of the H100 tables every trimmed cell costs more than the full block, and none is. A
trimmed choice reaches the runner as StepPlan.trimmed_cell; the device fills its budget from
the step's fresh survivals.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from dspark.policy.cells import best_cell, full_block_pays, trimmed_may_win
from dspark.policy.cost_table import CostTable, full_block_tokens
from dspark.policy.realised_costs import RealisedCosts
from dspark.policy.survival import SurvivalEstimates
from dspark.policy.tuning import TUNING, PolicyTuning


@dataclass(frozen=True)
class Decision:
    drafting: bool
    reason: str  # for the counters: "full block", "no drafting", "trimmed", "dwell", ...
    # the cell the step is priced as, and by which cells (realised step costs' bookkeeping,
    # not part of the choice: not compared)
    cell: tuple[int, int] | None = field(default=None, compare=False)  # (G, V)
    sampled: bool = field(default=False, compare=False)  # priced by the sampled cells

    @property
    def trimmed_cell(self) -> tuple[int, int] | None:
        """(G, V) when the choice is a trimmed cell (StepPlan.trimmed_cell), else None."""
        return self.cell if self.reason == "trimmed" else None


NO_TABLE = Decision(True, "no table")
BEYOND_TABLE = Decision(True, "batch beyond the table")
IDLE = {drafting: Decision(drafting, "idle") for drafting in (False, True)}


@dataclass(frozen=True)
class GraphCells:
    """One G's runnable cells in one table (greedy or sampled), and the decision that runs each
    of them: built once, so that a step's decision is one of these, not a new object (decide
    runs before every step)."""

    g: int
    row: dict[int, float]  # V -> table seconds: plain, the full block, any trimmed cells
    full: int  # V of the full block
    sampled: bool  # the sampled cells
    decisions: dict[int, Decision]  # V -> "no drafting" (V = G), "full block" or "trimmed"
    dwell: Decision  # "dwell" (plain)
    trimmed: tuple[int, ...]  # V of the trimmed cells

    @staticmethod
    def of(g: int, row: dict[int, float], draft_len: int, sampled: bool) -> GraphCells:
        full = full_block_tokens(g, draft_len)
        reasons = {g: "no drafting", full: "full block"}
        decisions = {v: Decision(v != g, reasons.get(v, "trimmed"), (g, v), sampled) for v in row}
        trimmed = tuple(v for v in sorted(row) if g < v < full)
        return GraphCells(g, row, full, sampled, decisions,
                          Decision(False, "dwell", (g, g), sampled), trimmed)  # fmt: skip


class DraftingPolicy:
    """The choice (decide) over the survival estimates it holds (observe, forget: `estimates`)
    and the realised step costs that price the cells (record_step: `realised_costs`)."""

    def __init__(
        self,
        table: CostTable | None,  # None: always draft (fixed K), the reason counted
        temperatures: dict[bool, torch.Tensor],  # greedy? -> [K] STS temperatures (host)
        draft_len: int,  # K verified per full block
        probe_steps: int = 1,  # drafting steps a probe runs at least (2 with steps ahead)
        decision_lag: int = 1,  # blocks between a decision's newest evidence and its block
        trimmed_widths: tuple[int, ...] = (),  # the runner's trimmed cells (G, w G)
        tuning: PolicyTuning = TUNING,
    ) -> None:
        if probe_steps < 1:
            raise ValueError(f"probe_steps must be >= 1, got {probe_steps}")
        # the cells the engine can run (plain, the full block, the trimmed cells), greedy and,
        # if measured, sampled (a batch with any row that samples is priced by those)
        self.table = _runnable(table, draft_len, trimmed_widths)
        self.sampled_table = _runnable(table and table.for_sampling(), draft_len, trimmed_widths)
        if self.table is None or self.sampled_table is None or (
            self.sampled_table.cells.keys() != self.table.cells.keys()
        ):  # fmt: skip
            self.sampled_table = None
        # with trimmed cells to price, each request's survivals are kept per position too
        prices_trimmed = self.table is not None and any(
            len(row) > 2 for row in self.table.cells.values()
        )  # fmt: skip
        self.estimates = SurvivalEstimates(temperatures, draft_len, decision_lag, prices_trimmed,
                                           tuning)  # fmt: skip
        self.realised_costs = RealisedCosts(tuning)
        self.tuning, self.draft_len, self.probe_steps = tuning, draft_len, probe_steps
        self.sizes = sorted(self.table.cells) if self.table else []
        # some row samples? -> [num_rows] -> the cells of the G that holds them (the greedy
        # ones where the table has no sampled cells): bisect over the sizes, done once
        self._graphs: dict[bool, list[GraphCells]] = {
            sampled: _graphs_by_rows(self._cells(sampled), draft_len, sampled and
                                     self.sampled_table is not None)
            for sampled in (False, True)
        }  # fmt: skip
        self.drafting = True
        self._steps_in_mode = 0
        self.counters: Counter[str] = Counter()
        self._counter_keys: dict[tuple, tuple[str, ...]] = {}  # a decision's kind -> _keys
        # the host's scheduling overhead, timed by its callers (the engine, the confidence
        # sink): seconds in decide (with record_step), observe and the trace, and decisions
        self.host_time: Counter[str] = Counter()
        # each row's survival total and kind (lists, or arrays where trimmed cells priced the
        # step) of the last decide()
        self.last_row_totals: tuple[Sequence[float], Sequence[int]] | None = None

    def observe(
        self,
        request_ids: list[str],
        confidence_logits: torch.Tensor,  # [R, K] raw (host)
        greedy: list[bool],
        num_accepted: list[int] | None = None,  # per window, with verify_len: recalibration
        verify_len: list[int] | None = None,
    ) -> None:
        """After a speculative step's sync: each window's raw confidences and what it kept
        (SurvivalEstimates.observe)."""
        self.estimates.observe(request_ids, confidence_logits, greedy, num_accepted, verify_len)

    def observe_survivals(
        self,
        request_ids: list[str],
        survivals: np.ndarray,  # [R, K] calibrated (SpecStepOutput.survivals, host copy)
        num_accepted: list[int] | None = None,
        verify_len: list[int] | None = None,
    ) -> None:
        """observe() from the step's calibrated survivals, as the engine has them."""
        self.estimates.observe_survivals(request_ids, survivals, num_accepted, verify_len)

    def forget(self, request_id: str) -> None:
        self.estimates.forget(request_id)

    # ---- the choice -------------------------------------------------------------------------

    def decide(self, request_ids: list[str], sampled: bool = False) -> Decision:
        """Whether the step about to be scheduled for these running requests drafts; `sampled`:
        some of them sample (temperature > 0), so the step is priced by the sampled cells."""
        self.last_row_totals = None
        decision = self._decide(request_ids, sampled)
        if decision.drafting != self.drafting:
            self.counters["drafting_switches"] += 1
            self.drafting, self._steps_in_mode = decision.drafting, 0
        self._steps_in_mode += 1
        self.estimates.step += 1
        kind = (decision.drafting, decision.reason, decision.cell)
        keys = self._counter_keys.get(kind) or self._counter_keys.setdefault(kind, _keys(*kind))
        counters = self.counters
        for key in keys:
            counters[key] += 1
        return decision

    def _decide(self, request_ids: list[str], sampled: bool) -> Decision:
        if self.table is None:
            return NO_TABLE
        if not request_ids:
            return IDLE[self.drafting]
        graphs, num_rows = self._graphs[sampled], len(request_ids)
        if num_rows >= len(graphs):
            return BEYOND_TABLE
        graph = graphs[num_rows]
        if sampled and self.sampled_table is None:
            self.counters["sampled_priced_by_greedy_cells"] += 1
        if not self.drafting and self._steps_in_mode < self.tuning.dwell_steps:
            return graph.dwell
        g, full = graph.g, graph.full
        row = self.realised_costs.priced(g, graph.row, graph.sampled)
        fresh_since = self.estimates.step - self._stale_after(row[g], row[full])
        total = self.estimates.running_sum(request_ids, fresh_since)
        if graph.trimmed and trimmed_may_win(graph.trimmed, num_rows, total, row, g, full,
                                             self.tuning.min_gain, self.drafting):  # fmt: skip
            # (per-position survivals price the trimmed cells; the full block, R + total)
            a = self._lagged_survival(request_ids, fresh_since)
            v, _ = best_cell(a, g, row, self.draft_len, self.tuning.min_gain, self.drafting,
                             full_tokens=num_rows + total)  # fmt: skip
            return graph.decisions[v]
        pays = full_block_pays(num_rows, total, row[g], row[full], self.tuning.min_gain,
                               self.drafting)  # fmt: skip
        return graph.decisions[full if pays else g]

    def _cells(self, sampled: bool) -> CostTable:
        """The table that prices a step: the sampled cells when some row samples and the
        table measured them, else the greedy ones."""
        return self.sampled_table if sampled and self.sampled_table is not None else self.table

    def priced_cells(
        self, num_rows: int, sampled: bool
    ) -> tuple[int, dict[int, float], bool] | None:
        """The graph size G a step of num_rows rows runs at, its runnable cells' prices (V ->
        seconds: the table's, scaled by realised step costs), and whether they are the sampled
        cells; None when no G of the table holds num_rows."""
        graphs = self._graphs[sampled]
        if num_rows >= len(graphs):
            return None
        graph = graphs[num_rows]
        return graph.g, self.realised_costs.priced(graph.g, graph.row, graph.sampled), graph.sampled

    def record_step(self, decision: Decision, seconds: float, arrivals: bool = False) -> None:
        """The engine's period of a step the policy decided (realised_costs.py), and whether
        that step admitted or prefilled requests; a decision with no cell (no table, idle,
        beyond the table) teaches nothing."""
        cell = decision.cell
        if cell is None:
            return
        table_s = self._graphs[decision.sampled][cell[0]].row[cell[1]]  # ([G]: G's own cells)
        self.realised_costs.record(cell, decision.sampled, table_s, seconds, arrivals)

    def stale_after(self, g: int, sampled: bool = False) -> int:
        """Steps after which a request's survivals are stale at graph size G (module doc), by
        the cells that price the step: a sampled drafting step costs more than a greedy one
        (at G = 4, 2.2 plain steps against 1.3), so probing it is rarer for the same budget.
        The prices are the realised ones where the engine measured them, since that is what a
        probe costs: at G = 256 a drafting step can cost 3.1-3.7 plain ones where the table
        says 2.04, and probing at the table's horizon then spends ~5% of the time, not 1%."""
        _, row, _ = self.priced_cells(g, sampled)  # (G is one of the table's: it prices itself)
        return self._stale_after(row[g], row[full_block_tokens(g, self.draft_len)])

    def _stale_after(self, plain_s: float, full_s: float) -> int:
        """stale_after from G's priced plain and full-block cells (seconds)."""
        ratio = full_s / plain_s
        return max(1, math.ceil(self.probe_steps * (ratio - 1) / self.tuning.probe_budget))

    def survival_sum(self, request_ids: list[str], g: int, sampled: bool = False) -> float:
        """Sum of the requests' recalibrated lagged survivals at graph size G; missing or stale
        rows count K (a = 1). (Kept by groups as the scheduler reports requests joining and
        leaving: SurvivalEstimates.running_sum; a trace asks row_totals for its evidence.)"""
        return self.estimates.running_sum(request_ids, self._fresh_since(g, sampled))

    def running(self, request_id: str, joined: bool) -> None:
        """The scheduler's report of a request joining or leaving the running set."""
        self.estimates.running(request_id, joined)

    def row_totals(
        self, request_ids: list[str], g: int, sampled: bool = False
    ) -> tuple[list[float], list[int]]:
        """Each request's estimated survival sum and its kind (FRESH, STALE or UNSEEN), stale
        after stale_after(G) steps by the cells that price the step (`sampled`)."""
        return self._row_totals(request_ids, self._fresh_since(g, sampled))

    def lagged_survival(self, request_ids: list[str], g: int, sampled: bool = False) -> np.ndarray:
        """[R, K] the requests' lagged survivals per position (estimate_vectors)."""
        return self._lagged_survival(request_ids, self._fresh_since(g, sampled))

    def _fresh_since(self, g: int, sampled: bool) -> int:
        return self.estimates.step - self.stale_after(g, sampled)

    def _row_totals(
        self, request_ids: list[str], fresh_since: int
    ) -> tuple[list[float], list[int]]:
        totals = self.estimates.estimate_totals(request_ids, fresh_since)
        self.last_row_totals = totals  # (the decision's evidence, for trace.py)
        return totals

    def _lagged_survival(self, request_ids: list[str], fresh_since: int) -> np.ndarray:
        a, totals, kinds = self.estimates.estimate_vectors(request_ids, fresh_since)
        self.last_row_totals = totals, kinds  # (the decision's evidence, for trace.py)
        return a


def _keys(drafting: bool, reason: str, cell: tuple[int, int] | None) -> tuple[str, ...]:
    """The counters a decision moves: its mode, its reason, where in the batch-size range it
    drafts, a trimmed cell's width (tokens per row: the chosen budget). Built once per kind of
    decision (DraftingPolicy._counter_keys), not every step."""
    mode = "drafting" if drafting else "not_drafting"
    keys = [f"steps_{mode}", f"decision_{reason.replace(' ', '_')}"]
    if cell is not None:
        keys.append(f"g{cell[0]}_{mode}")
        if reason == "trimmed":
            keys.append(f"trimmed_w{cell[1] // cell[0]}")
    return tuple(keys)


def _graphs_by_rows(table: CostTable | None, draft_len: int, sampled: bool) -> list[GraphCells]:
    """[num_rows] -> the cells of the smallest G of the table that holds num_rows rows, for
    num_rows up to the largest G (no table: an empty list).

      G 1, 4, 16:  num_rows 0 1 | 2 3 4 | 5 .. 16  ->  G 1 1 | 4 4 4 | 16 .. 16
    """
    if table is None:
        return []
    sizes = sorted(table.cells)
    graphs = {g: GraphCells.of(g, table.cells[g], draft_len, sampled) for g in sizes}
    return [graphs[sizes[bisect.bisect_left(sizes, r)]] for r in range(sizes[-1] + 1)]


def _runnable(
    table: CostTable | None, draft_len: int, trimmed_widths: tuple[int, ...] = ()
) -> CostTable | None:
    """The table's cells the engine can run: plain, the full block and its trimmed cells, for
    the G that have both plain and full (None: no such G)."""
    if table is None:
        return None
    cells = {}
    for g, row in table.cells.items():
        full = full_block_tokens(g, draft_len)
        if g not in row or full not in row:
            continue
        runnable = (g, full, *(g * w for w in trimmed_widths))
        cells[g] = {v: t for v, t in row.items() if v in runnable}
    return CostTable(table.fingerprint, cells) if cells else None
