"""Step costs as the engine realises them, next to the cost table's (docs/SPECULATION.md, the
policy).

The profiler measures each cell in a steady state: G identical requests, no arrivals, no prefill.
A serving loop is not that: at high load requests end and arrive every step, so drafting steps
carry prefill tails (captured mixed steps, or eager steps when the tail has too many rows) and
cost more than the profiled full block, while plain steps barely change. A table that prices
G = 256's full block at 2.36 plain steps lets the policy draft every step of a closed loop at
256 requests, at about half plain decoding's throughput.

So the engine reports each step's period (host clock, from one step() call to the next: under
async scheduling the pipeline's period) with the cell it ran, and the policy prices a cell by
its table time scaled by the realised / table ratio of recent steps in that cell (exponentially
weighted, half-life price_half_life steps; each ratio clipped to [1/4, 4], so an idle pause
between calls cannot swing it), once min_price_steps steps of that cell were seen. A cell
without enough steps is scaled by its G's plain cell's ratio when that one has them (the
machine's drift: a slower host makes every step dearer), else priced by the table alone; a
trimmed cell without enough steps, by its G's full block's ratio first (the drafting step that
runs: the same drafter and verification, the same host work). Priced by plain's instead, a
trimmed cell not yet run looks cheaper than the full block that runs whenever this host is
slower than the profile was: on an H100 at C = 1 a policy with trimmed cells then ran a trimmed
cell in 1,275 of 1,310 steps, where the table prices every one of them above the full block
(docs/PERFORMANCE.md, trimmed cells).

  table: G 256 plain 2.2 ms, full 5.2 ms; realised ratios plain 1.1, full 1.6 (8+ steps each)
  priced: plain 2.42 ms, full 8.3 ms  ->  full / plain 3.4 instead of 2.36

Everything it uses happened before the step being decided (the lagged scheduler's rule).

Stale prices. A cell's ratio changes only when its steps are counted, and while drafting is off
no full block is: a lone probe teaches nothing (below). So a full block's price that spiked with
a burst of arrivals would hold until the survivals go stale and a probe leads to two drafting
steps in a row, or for as long as the load stays, if fresh survivals never beat the spiked
price. Instead a cell's recent ratio reverts toward its long-run level (the same ratios,
half-life baseline_price_half_life steps) as the engine counts other cells' steps and not its
own: halfway after stale_price_half_life of them. A price measured again starts from the
reverted value, so one new step cannot bring the spike back. A rise that lasts is measured
again when drafting resumes, and turns it off again: the dwell bounds how often, and the
half-life how soon (tests/policy/test_realised_costs.py: after a burst at 4x, drafting resumes
11 plain steps later, where a frozen price waits for the staleness bound, ~100).

  full block: recent ratio 2.2, long-run 1.6, half-life 16; 16 plain steps counted since
  -> priced at 1.6 + (2.2 - 1.6) / 2 = 1.9 times the table

Steps with arrivals apart. A drafting step that admits requests does not launch ahead, so the
pipeline drains into it: at G = 64 on an H100 such a step takes about twice a steady one. One
ratio per cell would mix the two in whatever share the steps it happened to count had, and a
served first wave has arrivals in nearly every step: its drafting steps at G = 64 cost ~2.8x
the table, which prices the full block at 4.6 plain steps after ten of them and would keep
drafting off through the wave and long after it. So each cell keeps a ratio for steps
with arrivals and one for steps without, and a cell is priced by their mix at the share of
recent steps at its G that had arrivals (half-life arrival_share_half_life steps). Plain steps
count toward that share too, so the price of the full block follows the load while drafting is
off (drafting resumes about ten steps after the wave ends). A part not yet measured is the other
part of its cell, or, for a full block's steady part, its G's plain cell's (the machine's
drift), else the table:

  G 64: full block steady 1.1, with arrivals 2.1; share of steps with arrivals 0.33
  -> priced 0.67 x 1.1 + 0.33 x 2.1 = 1.43 x the table (after a first wave, share 1.0: 2.1)

Which periods count (StepPeriods). Under async scheduling a call to step() launches step k and
then waits for step k - 1, so the period from decision k to decision k + 1 ends when step k - 1
completes: it is cell k's cost only when step k - 1 ran the same cell. At a switch (drafting on
or off, another G) the period holds the other cell's step and the pipeline's flush, so it
counts for neither cell:

    decisions   plain  plain  FULL  FULL  FULL  plain  plain  FULL  plain  plain
    recorded      -     yes    no    yes   yes    no    yes    no     no    yes

An isolated drafting step (a probe) therefore teaches nothing: its period would carry the plain
step in flight before it, so the full block would read cheap, and the plain step after it the
probe's own time. (Run synchronously, a period is its own step's: the rule then only drops the
first step after each switch.)
"""

from __future__ import annotations

from collections.abc import Mapping

from dspark.policy.tuning import TUNING, PolicyTuning

MIN_RATIO, MAX_RATIO = 0.25, 4.0  # realised / table: an idle pause cannot swing a price


class RealisedCosts:
    def __init__(self, tuning: PolicyTuning = TUNING) -> None:
        self._decay = 0.5 ** (1.0 / tuning.price_half_life)
        self._baseline_decay = 0.5 ** (1.0 / tuning.baseline_price_half_life)
        self.min_steps = tuning.min_price_steps
        self.stale_half_life = tuning.stale_price_half_life
        self._counted = 0  # steps counted in any cell: the clock of a price's staleness
        # (G, V, sampled) -> the cell's [steady part, part with arrivals], each None until its
        # first step, then [weighted sum of ratios, weight, steps seen, the long-run sum and
        # weight, the clock when last counted]: realised / table
        self._cells: dict[tuple[int, int, bool], list] = {}
        self._share_decay = 0.5 ** (1.0 / tuning.arrival_share_half_life)
        # (G, sampled) -> [weighted count of steps with arrivals, weight]
        self._shares: dict[tuple[int, bool], list[float]] = {}

    def record(
        self,
        cell: tuple[int, int],
        sampled: bool,
        table_s: float,
        seconds: float,
        arrivals: bool = False,  # the step admitted or prefilled requests
    ) -> None:
        """One step of `cell` took `seconds`; the table says `table_s`."""
        ratio = min(MAX_RATIO, max(MIN_RATIO, seconds / table_s))
        g, v = cell
        share = self._shares.get((g, sampled))
        if share is None:
            share = self._shares[g, sampled] = [0.0, 0.0]
        d = self._share_decay
        share[0], share[1] = share[0] * d + arrivals, share[1] * d + 1.0
        parts = self._cells.get((g, v, sampled))
        if parts is None:
            parts = self._cells[g, v, sampled] = [None, None]
        part = 1 if arrivals else 0
        state = parts[part]
        if state is None:
            state = parts[part] = [0.0, 0.0, 0, 0.0, 0.0, self._counted]
        total, weight, steps, long_total, long_weight, _ = state
        if weight:  # (start from the reverted price: module docstring)
            total = self._reverted(state) * weight
        self._counted += 1
        d, b = self._decay, self._baseline_decay
        state[:] = [total * d + ratio, weight * d + 1.0, steps + 1,
                    long_total * b + ratio, long_weight * b + 1.0, self._counted]  # fmt: skip

    def ratio(self, cell: tuple[int, int], sampled: bool) -> float | None:
        """The recent realised / table ratio of a cell, reverted toward its long-run level as
        it goes stale: the mix of its steady part and its part with arrivals (module
        docstring), or None with fewer than min_steps steps in both."""
        g, v = cell
        return self._ratio(g, v, sampled, self._share(g, sampled))

    def priced(self, g: int, row: Mapping[int, float], sampled: bool) -> dict[int, float]:
        """G's cells (V -> table seconds), each scaled by its own realised ratio, else (a
        trimmed cell) by the full block's, else by the plain cell's, else as the table has it
        (module docstring). (Before every step: G's share of steps with arrivals is read once,
        each cell's ratio once.)"""
        share, full = self._share(g, sampled), max(row)  # (the full block: G's widest)
        drift = self._ratio(g, g, sampled, share) or 1.0
        drafting = self._ratio(g, full, sampled, share) or drift
        prices = {}
        for v, t in row.items():
            if v == g:
                prices[v] = t * drift
            elif v == full:
                prices[v] = t * drafting
            else:  # (a trimmed cell)
                prices[v] = t * (self._ratio(g, v, sampled, share) or drafting)
        return prices

    def _share(self, g: int, sampled: bool) -> float:
        """The share of recent steps at G that had arrivals (0 before any)."""
        count, weight = self._shares.get((g, sampled), (0.0, 0.0))
        return count / weight if weight else 0.0

    def _ratio(self, g: int, v: int, sampled: bool, share: float) -> float | None:
        """ratio((G, V), sampled), given G's share of steps with arrivals."""
        parts = self._cells.get((g, v, sampled))
        if parts is None:
            return None
        steady, busy = self._measured(parts[0]), self._measured(parts[1])
        if steady is None and busy is None:
            return None
        if steady is None:  # seen only with arrivals: the plain cell's steady part (drift)
            plain = self._cells.get((g, g, sampled)) if v != g else None
            steady = None if plain is None else self._measured(plain[0])
            if steady is None:
                steady = 1.0
        if busy is None:
            busy = steady
        return (1.0 - share) * steady + share * busy

    def _measured(self, state: list | None) -> float | None:
        """A part's reverted ratio, or None with fewer than min_steps steps."""
        if state is None or state[2] < self.min_steps:
            return None
        return self._reverted(state)

    def _reverted(self, state: list) -> float:
        total, weight, _, long_total, long_weight, last = state
        recent, long_run = total / weight, long_total / long_weight
        stale = 0.5 ** ((self._counted - last) / self.stale_half_life)
        return long_run + (recent - long_run) * stale

    def as_dict(self) -> dict[str, float]:
        """The known ratios for the metrics, each part on its own: "G=256 V=2048 greedy
        steady" -> 1.6."""
        out = {}
        for (g, v, sampled), parts in sorted(self._cells.items()):
            for part, state in zip(("steady", "arrivals"), parts, strict=True):
                if state is not None:
                    kind = f"{'sampled' if sampled else 'greedy'} {part}"
                    out[f"G={g} V={v} {kind}"] = round(state[0] / state[1], 3)
        return out


class StepPeriods:
    """The engine's clock for realised costs: call decided() before each step with the choice
    for it; it returns the previous choice and its period when that period counts (the module
    docstring), else None."""

    def __init__(self) -> None:
        self._last = None  # the previous decision (None: none, or the engine was idle)
        self._last_time = 0.0
        self._prior_key = None  # (cell, sampled) of the decision before it

    def decided(self, decision, now: float, running: bool):
        """decision: the policy's choice for the step about to run (a Decision); running:
        whether any request runs (an idle engine's pause is no step)."""
        last, counted = self._last, None
        if last is not None and (last.cell, last.sampled) == self._prior_key:
            counted = (last, now - self._last_time)
        self._prior_key = None if last is None else (last.cell, last.sampled)
        self._last = decision if running else None
        self._last_time = now
        return counted
