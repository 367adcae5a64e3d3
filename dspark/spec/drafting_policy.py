"""Whether the next step drafts: the lagged-capacity choice between plain decoding and the full
block, priced by the measured cost table (DSPARK.md 6.3 item 2, 6.4).

Drafting is not free: the block is drafted in full for every window, and on a small target the
whole speculative step costs several plain steps at high batch. Before each step the host prices
the two cells of the step's graph size G that the engine can run today:

  plain (V = G)           expected tokens R                      / step_seconds(G, G)
  full block (V = G(K+1)) expected tokens R + sum_r sum_j a[r, j] / step_seconds(G, G(K+1))

with a[r, j] the calibrated survivals of each running request's last verified block (at least
one step old: the drafts they describe are already verified, so the choice cannot depend on the
tokens it admits; DSPARK.md 6.3), computed with the greedy calibration for greedy requests. Only
each request's sum over j is kept. A request with no survivals yet (just admitted, never
drafted), or whose survivals are stale, counts as fully confident: a = 1, a sum of K.

With unobserved="population" (the default) a request that never drafted counts instead as
the recent requests' mean survival sum (exponentially weighted over observed blocks, half-life
calibration_half_life blocks, recalibrated like the others), once min_population_blocks
blocks were observed; stale rows still count K, so probing is unchanged. With "confident" every
admission counts K, and under load, where requests arrive every few steps, the batch then
drafts for a few steps after each arrival at several times the plain cost. In a closed loop of
256 requests ending at different steps on the H200 (docs/PERFORMANCE.md, tenth look) that ran
at 0.89x plain decoding against 1.03x with "population"; from 1 to 64 requests the two made the
same choices. DSPARK.md 6.4 counts a just-admitted request as fully confident. Here that still
holds for what the step verifies (a drafting step verifies every window in full) and for the
choice while there is no evidence; only the price of drafting at all uses the population's
evidence in place of a = 1.

A request's estimate is not its last block alone. Its blocks' sums are smoothed (exponentially,
half-life block_half_life blocks: the newest block weighs one half by default), and the estimate
is pulled toward the population mean as it ages (half-life regression_half_life steps). One
weak block (a sentence boundary, a number) therefore neither turns drafting off by itself nor,
once it has, keeps it off until the row goes stale: at G = 1 staleness takes ~120 steps, and on
the H200 (2026-12-03) the policy drafted 33 of 166 steps at concurrency 1 for 1.29x plain
decoding where fixed K gave 1.65x. Where plain decoding wins on the population's own mean
(under load), the pull changes nothing.

Three corrections keep lagged estimates honest:
- Persistence, measured. How much a request's past blocks say about its next one is measured,
  not assumed: for full blocks verified from rows that had an estimate (at most 16 rows a
  step, in rotation), the pair (the row's estimate before the block, the drafts the block
  kept) enters an exponentially weighted least-squares fit (half-life calibration_half_life
  blocks). Its slope rho, clipped to [0, 1], is how far an estimate may stand from the
  population mean: own = mean + rho (own - mean), before the pull with age. The fit is used
  once min_persistence_blocks pairs (weighted) are in and their estimates spread (until then
  rho = 1). On the H200 (2026-12-04) the unfitted policy turned drafting off at concurrency 1
  on 28 weak estimates and dwelt 196 steps, at 0.93x fixed K, where the blocks that followed
  weak ones still kept enough drafts to pay.
  Everything the fit uses was verified before the current drafts exist (6.3).
- Online recalibration. STS is fitted offline on other prompts; the engine knows, for every full
  block it verified, how many drafts the calibrated survivals predicted and how many were
  accepted. The sums are scaled by realised / predicted over recent full blocks (exponentially
  weighted, half-life calibration_half_life blocks, with a prior of prior_blocks blocks at ratio
  1), clipped to K. Everything it uses was verified before the current drafts exist (6.3).
- Probing. While drafting is off nothing refreshes the survivals. They go stale after
  (t_full / t_plain - 1) / probe_budget steps at the step's G, so the probe (one drafting step
  that refreshes them) costs at most probe_budget of the time spent not drafting: about 80
  steps at G = 1 (t_full / t_plain = 1.8) and 290 at G = 256 (3.9) with the 1% default. A step
  priced by the sampled cells sets it by those (G = 4 on the H200: 118 steps at 2.18, where the
  greedy cells' 1.29 gave 29 and a sampled batch probed four times its budget).
Load that falls (a smaller G, where the full block costs relatively less), new requests and
stale rows bring drafting back.

Flapping is prevented twice over. The other mode must beat the incumbent by (1 + min_gain)^2
(lagged.choose_drafting), and once drafting is off it stays off for at least min_dwell_steps
steps. Switching drafting off is not delayed: a drafting step costs several plain steps at high
load, so one step of fresh confidences is enough to stop. Example, G = 64, K = 7, plain 1.1 ms,
full 4.3 ms, survivals summing to 1.3 per row: plain 64 / 1.1 = 58 tokens/ms, full 64 * 2.3 /
4.3 = 34 tokens/ms, so drafting goes off; at G = 1 (1.15 vs 2.0 ms) the same request gives
0.87 against 1.15 tokens/ms, and drafting comes back once the dwell has passed.

Realised step costs (spec/realised_costs.py, on by default): the table prices steady steps,
and a serving loop's drafting steps (prefill tails, eager fallbacks at high load) cost more; the
engine reports each step's period with the cell it was decided as (record_step), and every cell
is priced by its table time scaled by the recent realised / table ratio.

A batch with any row that samples is priced by the table's sampled cells (measured at
temperature 1: a sampled drafting step costs more than a greedy one), or by the greedy cells
where the table has none (counted: sampled_priced_by_greedy_cells).

Trimmed cells. With trimmed_widths (the cells (G, w G) the runner can run, spec/ragged.py) and a
table that measured them, the choice is lagged.choose_cell over G's plain, trimmed and full
cells: the expected tokens of a budget of D drafts are R plus the D highest lagged survivals,
so each request's survivals are kept per position, not only summed. A row's vector is its own
smoothed one (or the population's, for a request that never drafted) rescaled to the total the
sums above give it, each position clipped to 1; a stale row is all ones. The full block's
expected tokens are then those of the sum-only choice, and a table without trimmed cells gives
exactly the choices above. A trimmed choice reaches the runner as StepPlan.trimmed_cell; the
device fills its budget from the step's fresh survivals.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from dspark.spec.cost_table import CostTable, full_block_tokens
from dspark.spec.lagged import choose_cell, choose_drafting, survival
from dspark.spec.realised_costs import RealisedCosts

# what a request's lagged survivals rest on (DraftingPolicy.row_totals)
FRESH, STALE, UNSEEN = 0, 1, 2
PERSISTENCE_PAIRS_PER_STEP = 16  # rows a drafting step adds to the persistence fit


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


class DraftingPolicy:
    def __init__(
        self,
        table: CostTable | None,  # None: always draft (fixed K), the reason counted
        temperatures: dict[bool, torch.Tensor],  # greedy? -> [K] STS temperatures (host)
        draft_len: int,  # K verified per full block
        min_gain: float = 0.02,
        min_dwell_steps: int = 8,  # plain steps before drafting may resume
        probe_budget: float = 0.01,  # the share of plain time probes (stale rows) may cost
        calibration_half_life: float = 256.0,  # full blocks, of the realised/predicted ratio
        prior_blocks: float = 4.0,  # ratio-1 pseudo-blocks: a few blocks cannot swing it
        unobserved: str = "population",  # or "confident" (module docstring)
        min_population_blocks: float = 16.0,
        block_half_life: float = 1.0,  # blocks, of a request's smoothed survival sum
        regression_half_life: float = 8.0,  # steps, of a request's pull to the population mean
        fit_persistence: bool = True,  # False: rho = 1 (a row's own survivals count in full)
        min_persistence_blocks: float = 32.0,  # fitted pairs before rho is used (module doc)
        trimmed_widths: tuple[int, ...] = (),  # the runner's trimmed cells (G, w G)
        realised_costs: RealisedCosts | None = None,  # price cells by realised step times too
    ) -> None:
        if not 0 < probe_budget <= 1:
            raise ValueError(f"probe_budget must be in (0, 1], got {probe_budget}")
        if unobserved not in ("confident", "population"):
            raise ValueError(f'unobserved must be "confident" or "population", got {unobserved!r}')
        self.unobserved = unobserved
        self.realised_costs = realised_costs
        self.min_population_blocks = min_population_blocks
        self._population_sum = self._population_blocks = 0.0  # weighted observed sums, blocks
        self._population_vector = np.zeros(draft_len)  # weighted observed survivals [K]
        self.draft_len = draft_len
        self.temperatures = {g: t.float().cpu()[:draft_len] for g, t in temperatures.items()}
        self.min_gain, self.min_dwell_steps = min_gain, min_dwell_steps
        self.probe_budget = probe_budget
        self._decay = 0.5 ** (1.0 / calibration_half_life)
        if block_half_life < 0 or regression_half_life <= 0:
            raise ValueError(f"block_half_life must be >= 0 and regression_half_life > 0, got "
                             f"{block_half_life} and {regression_half_life}")  # fmt: skip
        # weight of a request's newest block in its smoothed sum (1: the last block alone)
        self._block_weight = 1.0 - 0.5 ** (1.0 / block_half_life) if block_half_life else 1.0
        self._regression_half_life = regression_half_life
        # the persistence fit (module docstring): weighted pairs and their sums x, y, xx, xy
        self.fit_persistence = fit_persistence
        self.min_persistence_blocks = min_persistence_blocks
        self._pairs = [0.0] * 5
        self._fit_start = 0  # the row the next step's pairs start from (modulo the batch)
        # exponentially weighted predicted and realised accepted drafts over full blocks, each
        # starting from prior_blocks blocks of one accepted draft predicted and realised
        self._predicted = self._realised = prior_blocks
        # the cells the engine can run (plain and the full block), greedy and, if measured,
        # sampled (a batch with any row that samples is priced by those)
        self.table = _runnable(table, draft_len, trimmed_widths)
        self.sampled_table = _runnable(table and table.for_sampling(), draft_len, trimmed_widths)
        if self.table is None or self.sampled_table is None or (
            self.sampled_table.cells.keys() != self.table.cells.keys()
        ):  # fmt: skip
            self.sampled_table = None
        self.sizes = sorted(self.table.cells) if self.table else []
        self.drafting = True
        self._steps_in_mode = 0
        self._step = 0  # decisions made: the clock of staleness
        # request id -> (sum of its smoothed K survivals, the step it was last observed at)
        self._survival_sums: dict[str, tuple[float, int]] = {}
        # with trimmed cells to price, each request's smoothed survivals per position [K] too
        # (kept only then: a dozen numpy calls per row cost the step loop ~1 us each)
        self.prices_trimmed = self.table is not None and any(
            len(row) > 2 for row in self.table.cells.values()
        )  # fmt: skip
        self._survival_vectors: dict[str, np.ndarray] = {}
        self.counters: Counter[str] = Counter()

    # ---- what the step saw ------------------------------------------------------------------

    def observe(
        self,
        request_ids: list[str],
        confidence_logits: torch.Tensor,  # [R, K] raw (host)
        greedy: list[bool],
        num_accepted: list[int] | None = None,  # per window, with verify_len: recalibration
        verify_len: list[int] | None = None,
    ) -> None:
        """After a speculative step's sync: each window's raw confidences and what it kept."""
        temps = torch.stack([self.temperatures[g] for g in greedy])
        a = survival(confidence_logits[:, : self.draft_len].float(), temps)  # [R, K]
        sums = a.sum(-1).tolist()
        if num_accepted is not None and verify_len is not None:
            self._fit_persistence(request_ids, num_accepted, verify_len)  # (estimates before)
        w = self._block_weight
        for rid, total in zip(request_ids, sums, strict=True):
            seen = self._survival_sums.get(rid)
            smoothed = total if seen is None else seen[0] + w * (total - seen[0])
            self._survival_sums[rid] = (smoothed, self._step)
        decay = self._decay ** len(sums)
        self._population_sum = self._population_sum * decay + sum(sums)
        if self.prices_trimmed:
            self._observe_vectors(request_ids, a.double().numpy(), decay)
        self._population_blocks = self._population_blocks * decay + len(sums)
        if num_accepted is None or verify_len is None:
            return
        full = [j for j, v in enumerate(verify_len) if v == self.draft_len]  # uncensored
        decay = self._decay ** len(full)
        self._predicted = self._predicted * decay + sum(sums[j] for j in full)
        self._realised = self._realised * decay + sum(num_accepted[j] for j in full)

    def _fit_persistence(
        self, request_ids: list[str], num_accepted: list[int], verify_len: list[int]
    ) -> None:
        """observe()'s pairs into the persistence fit: (the row's recalibrated estimate before
        its block, the drafts the block kept), for uncensored blocks of rows that had an
        estimate. At most PERSISTENCE_PAIRS_PER_STEP rows a step, from a start that rotates
        with each call: a large batch gives far more pairs than the fit needs, and observe()
        runs after every drafting step (at 256 rows, pairs from every row doubled its cost)."""
        r = len(request_ids)
        if not self.fit_persistence or not r:
            return
        scale, k, smoothed = self.correction, self.draft_len, self._survival_sums
        start = self._fit_start
        self._fit_start += PERSISTENCE_PAIRS_PER_STEP
        n = sx = sy = sxx = sxy = 0.0
        for i in range(r):
            j = (start + i) % r
            seen = smoothed.get(request_ids[j]) if verify_len[j] == k else None
            if seen is None:
                continue
            x, y = min(k, scale * seen[0]), num_accepted[j]
            n, sx, sy, sxx, sxy = n + 1, sx + x, sy + y, sxx + x * x, sxy + x * y
            if n == PERSISTENCE_PAIRS_PER_STEP:
                break
        if n:
            decay = self._decay**n
            step = (n, sx, sy, sxx, sxy)
            self._pairs = [a * decay + b for a, b in zip(self._pairs, step, strict=True)]

    @property
    def persistence(self) -> float:
        """rho: the slope of a block's kept drafts on its row's estimate before it, clipped to
        [0, 1]; 1 until the fit has min_persistence_blocks pairs whose estimates spread."""
        n, sx, sy, sxx, sxy = self._pairs
        if not self.fit_persistence or n < self.min_persistence_blocks:
            return 1.0
        var = sxx / n - (sx / n) ** 2
        if var < 1e-3:  # (every estimate alike: no slope to read)
            return 1.0
        return min(1.0, max(0.0, (sxy / n - sx * sy / n**2) / var))

    def _observe_vectors(self, request_ids: list[str], a: np.ndarray, decay: float) -> None:
        """observe()'s per-position twin of the smoothed sums (trimmed cells only)."""
        w = self._block_weight
        for rid, vector in zip(request_ids, a, strict=True):
            seen = self._survival_vectors.get(rid)
            self._survival_vectors[rid] = vector if seen is None else seen + w * (vector - seen)
        self._population_vector = self._population_vector * decay + a.sum(0)

    @property
    def correction(self) -> float:
        """Realised / predicted accepted drafts over recent full blocks (1 with no evidence)."""
        return self._realised / self._predicted

    def forget(self, request_id: str) -> None:
        self._survival_sums.pop(request_id, None)
        self._survival_vectors.pop(request_id, None)

    # ---- the choice -------------------------------------------------------------------------

    def decide(self, request_ids: list[str], sampled: bool = False) -> Decision:
        """Whether the step about to be scheduled for these running requests drafts; `sampled`:
        some of them sample (temperature > 0), so the step is priced by the sampled cells."""
        decision = self._decide(request_ids, sampled)
        if decision.drafting != self.drafting:
            self.counters["drafting_switches"] += 1
            self.drafting, self._steps_in_mode = decision.drafting, 0
        self._steps_in_mode += 1
        self._step += 1
        self.counters[f"steps_{'drafting' if decision.drafting else 'not_drafting'}"] += 1
        self.counters[f"decision_{decision.reason.replace(' ', '_')}"] += 1
        if decision.cell is not None:  # where in the batch-size range the policy drafts
            mode = "drafting" if decision.drafting else "not_drafting"
            self.counters[f"g{decision.cell[0]}_{mode}"] += 1
        if decision.trimmed_cell is not None:  # the chosen budget: tokens per row of the cell
            g, v = decision.trimmed_cell
            self.counters[f"trimmed_w{v // g}"] += 1
        return decision

    def _decide(self, request_ids: list[str], sampled: bool) -> Decision:
        if self.table is None:
            return Decision(True, "no table")
        if not request_ids:
            return Decision(self.drafting, "idle")
        priced = self.priced_cells(len(request_ids), sampled)
        if priced is None:
            return Decision(True, "batch beyond the table")
        if sampled and self.sampled_table is None:
            self.counters["sampled_priced_by_greedy_cells"] += 1
        g, row, sampled = priced
        if not self.drafting and self._steps_in_mode < self.min_dwell_steps:
            return Decision(False, "dwell", (g, g), sampled)
        table = CostTable({}, {g: row})
        if len(row) > 2:  # trimmed cells: per-position survivals price them
            a = self.lagged_survival(request_ids, g, sampled)
            choice = choose_cell(a, g, table, self.draft_len, self.min_gain, self.drafting)
        else:
            choice = choose_drafting(len(request_ids), self.survival_sum(request_ids, g, sampled),
                                     g, table, self.draft_len, self.min_gain,
                                     drafting_now=self.drafting)  # fmt: skip
        geometry = choice.geometry
        return Decision(geometry.drafts, choice.reason, (g, geometry.num_tokens), sampled)

    def priced_cells(
        self, num_rows: int, sampled: bool
    ) -> tuple[int, dict[int, float], bool] | None:
        """The graph size G a step of num_rows rows runs at, its runnable cells' prices (V ->
        seconds: the table's, scaled by realised step costs), and whether they are the sampled
        cells; None when no G of the table holds num_rows."""
        i = bisect.bisect_left(self.sizes, num_rows)
        if self.table is None or i == len(self.sizes):
            return None
        g = self.sizes[i]
        table = self.sampled_table if sampled and self.sampled_table is not None else self.table
        row = table.cells[g]
        if self.realised_costs is not None:  # (realised_costs.py)
            row = self.realised_costs.priced(g, row, table is self.sampled_table)
        return g, row, table is self.sampled_table

    def record_step(self, decision: Decision, seconds: float) -> None:
        """The engine's period of a step the policy decided (realised_costs.py); a decision
        with no cell (no table, idle, beyond the table) teaches nothing."""
        if self.realised_costs is None or decision.cell is None:
            return
        g, v = decision.cell
        table = self.sampled_table if decision.sampled else self.table
        self.realised_costs.record(decision.cell, decision.sampled, table.cells[g][v], seconds)

    def stale_after(self, g: int, sampled: bool = False) -> int:
        """Steps after which a request's survivals are stale at graph size G (module doc), by
        the cells that price the step: a sampled drafting step costs more than a greedy one
        (on the H200 at G = 4, 2.2 plain steps against 1.3), so probing it is rarer for the
        same budget."""
        table = self.sampled_table if sampled and self.sampled_table is not None else self.table
        row = table.cells[g]
        ratio = row[full_block_tokens(g, self.draft_len)] / row[g]
        return max(1, math.ceil((ratio - 1) / self.probe_budget))

    def survival_sum(self, request_ids: list[str], g: int, sampled: bool = False) -> float:
        """Sum of the requests' recalibrated lagged survivals at graph size G; missing or stale
        rows count K (a = 1).

        A fresh row's estimate is its smoothed sum, its distance from the population mean
        scaled by the measured persistence rho and halved every regression_half_life steps
        of age (module docstring), once the population has min_population_blocks blocks of
        evidence. (Called before every step: plain floats, no numpy.)
        """
        return sum(self.row_totals(request_ids, g, sampled)[0])

    def row_totals(
        self, request_ids: list[str], g: int, sampled: bool = False
    ) -> tuple[list[float], list[int]]:
        """Each request's estimated survival sum, and its kind: FRESH, STALE or UNSEEN
        (`sampled`: the step is priced by the sampled cells, which set when a row is stale)."""
        fresh_since = self._step - self.stale_after(g, sampled)
        scale, k = self.correction, self.draft_len
        unseen = self.unobserved_sum()
        mean = self.population_mean()
        decay = 0.5 ** (1.0 / self._regression_half_life)
        rho = self.persistence
        totals, kinds = [], []
        for rid in request_ids:
            seen = self._survival_sums.get(rid)
            if seen is None:
                totals.append(unseen)
                kinds.append(UNSEEN)
            elif seen[1] < fresh_since:
                totals.append(float(k))
                kinds.append(STALE)
            else:
                own = min(k, scale * seen[0])
                if mean is not None:
                    own = mean + (own - mean) * rho * decay ** (self._step - seen[1])
                totals.append(own)
                kinds.append(FRESH)
        return totals, kinds

    def lagged_survival(self, request_ids: list[str], g: int, sampled: bool = False) -> np.ndarray:
        """[R, K] the requests' lagged survivals per position: each row's vector (its own, or
        the population's for a request that never drafted; ones when stale or without
        evidence) rescaled to the row's total of survival_sum, clipped to 1."""
        totals, kinds = self.row_totals(request_ids, g, sampled)
        k = self.draft_len
        flat = np.ones(k) / k  # (the shape of a row with no vector: its total spread evenly)
        population = flat
        if self.unobserved == "population" and self.population_mean() is not None:
            population = self._population_vector
        vectors = np.stack([
            self._survival_vectors.get(rid, flat) if kind == FRESH
            else population if kind == UNSEEN else flat
            for rid, kind in zip(request_ids, kinds, strict=True)
        ]).reshape(len(request_ids), k)  # fmt: skip
        mass = vectors.sum(axis=1, keepdims=True)
        scale = np.asarray(totals)[:, None] / np.where(mass > 0, mass, 1.0)
        rows = np.where(mass > 0, vectors * scale, np.asarray(totals)[:, None] / k)
        return np.minimum(1.0, rows)

    def population_mean(self) -> float | None:
        """The recent requests' recalibrated mean survival sum per block (exponentially
        weighted over observed blocks), or None before min_population_blocks blocks."""
        if self._population_blocks < self.min_population_blocks:
            return None
        return min(self.draft_len, self.correction * self._population_sum / self._population_blocks)

    def unobserved_sum(self) -> float:
        """What a request that never drafted counts: K, or with unobserved="population" and
        enough evidence, the recent requests' recalibrated mean survival sum."""
        mean = self.population_mean()
        if self.unobserved == "confident" or mean is None:
            return float(self.draft_len)
        return mean


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
