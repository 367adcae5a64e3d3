"""Step costs as the engine realises them, next to the cost table's (DSPARK.md 6.4).

The profiler measures each cell in a steady state: G identical requests, no arrivals, no prefill.
A serving loop is not that: at high load requests end and arrive every step, so drafting steps
carry prefill tails (captured mixed steps, or eager steps when the tail has too many rows) and
cost more than the profiled full block, while plain steps barely change. On the H200
(2026-12-04, docs/PERFORMANCE.md twelfth look) a table that priced G = 256's full block at 2.36
plain steps let the policy draft every step of a closed loop at 256 requests, at 0.57x plain
decoding.

So the engine reports each step's period (host clock, from one step() call to the next: under
async scheduling the pipeline's period) with the cell it ran, and the policy prices a cell by
its table time scaled by the realised / table ratio of recent steps in that cell (exponentially
weighted, half-life `half_life` steps; each ratio clipped to [1/4, 4], so an idle pause between
calls cannot swing it), once `min_steps` steps of that cell were seen. A cell without enough
steps is scaled by its G's plain cell's ratio when that one has them (the machine's drift: a
slower host makes every step dearer), else priced by the table alone.

  table: G 256 plain 2.2 ms, full 5.2 ms; realised ratios plain 1.1, full 1.6 (8+ steps each)
  priced: plain 2.42 ms, full 8.3 ms  ->  full / plain 3.4 instead of 2.36

Everything it uses happened before the step being decided (the lagged scheduler's rule, 6.3).

Stale prices (stale_half_life; speculative_config's default is 16). A cell's ratio changes
only when its steps are counted, and while drafting is off no full block is: a lone probe
teaches nothing (below). So a full block's price that spiked with a burst of arrivals holds
until the survivals go stale and a probe leads to two drafting steps in a row, or for as long
as the load stays, if fresh survivals never beat the spiked price. With stale_half_life H > 0,
a cell's recent ratio reverts toward its long-run level (the same ratios, half-life
baseline_half_life steps) as the engine counts other cells' steps and not its own: halfway
after H of them. A price measured
again starts from the reverted value, so one new step cannot bring the spike back. A rise that
lasts is measured again when drafting resumes, and turns it off again: the dwell bounds how
often, and the half-life how soon (tests/spec/test_realised_costs.py: after a burst at 4x,
drafting resumed after 101 plain steps frozen, the staleness bound, and after 11 with H = 16).

  full block: recent ratio 2.2, long-run 1.6, H = 16; 16 plain steps counted since
  -> priced at 1.6 + (2.2 - 1.6) / 2 = 1.9 times the table

Steps with arrivals apart (split_arrivals; speculative_config "arrival_costs", on by default). A
drafting step that admits requests does not launch ahead, so the pipeline drains into it: at G = 64
on an H100 such a step took ~4.0 ms where a steady one took 2.05 (an offline trace,
docs/PERFORMANCE.md thirty-fifth look). One ratio per cell mixes the two in whatever share the steps
it happened to count had. A served first wave has arrivals in nearly every step: in a fresh server's
trace at 64 streams (thirty-sixth look) its drafting steps at G = 64 took ~5.3 ms, 2.8x the table,
so the full block priced at 4.6 plain steps after ten of them; drafting went off and stayed off
through the ~250 steps left of the wave and the timed run after it (the price fell only to 3.0-3.9
while a row expected ~2.7 tokens). With split_arrivals each cell keeps a ratio for steps with
arrivals and one for steps without, and a cell is priced by their mix at the share of recent steps
at its G that had arrivals. Plain steps count toward that share too, so the price of the full block
follows the load while drafting is off (in its twin with split_arrivals, off at the wave's end, it
drafted again ten steps later). A part not yet measured is the other part of its cell, or, for a
full block's steady part, its G's plain cell's (the machine's drift), else the table:

  G 64: full block steady 1.1, with arrivals 2.1; share of steps with arrivals 0.33
  -> priced 0.67 x 1.1 + 0.33 x 2.1 = 1.43 x the table (after a first wave, share 1.0: 2.1)

Which periods count (StepPeriods). Under async scheduling a call to step() launches step k and
then waits for step k - 1, so the period from decision k to decision k + 1 ends when step k - 1
completes: it is cell k's cost only when step k - 1 ran the same cell. At a switch (drafting on
or off, another G) the period holds the other cell's step and the pipeline's flush, so it
counts for neither cell:

    decisions   plain  plain  FULL  FULL  FULL  plain  plain  FULL  plain  plain
    recorded      -     yes    no    yes   yes    no    yes    no     no    yes

An isolated drafting step (a probe) therefore teaches nothing: before, its period carried the
plain step in flight before it, so the full block read cheap, and the plain step after it the
probe's own time. (Run synchronously, a period is its own step's: the rule then only drops the
first step after each switch.)
"""

from __future__ import annotations

from collections.abc import Mapping

MIN_RATIO, MAX_RATIO = 0.25, 4.0


class RealisedCosts:
    def __init__(
        self,
        half_life: float = 64.0,
        min_steps: float = 8.0,
        stale_half_life: float = 0.0,  # counted steps of other cells (0: prices never revert)
        baseline_half_life: float = 1024.0,  # steps, of a cell's long-run ratio
        split_arrivals: bool = False,  # steps with arrivals priced apart (module docstring)
        share_half_life: float = 64.0,  # counted steps at a G, of its share with arrivals
    ) -> None:
        if half_life <= 0 or min_steps <= 0 or baseline_half_life <= 0:
            raise ValueError(f"half_life, min_steps and baseline_half_life must be > 0, got "
                             f"{half_life}, {min_steps}, {baseline_half_life}")  # fmt: skip
        if stale_half_life < 0:
            raise ValueError(f"stale_half_life must be >= 0, got {stale_half_life}")
        self._decay = 0.5 ** (1.0 / half_life)
        self._baseline_decay = 0.5 ** (1.0 / baseline_half_life)
        self.min_steps = min_steps
        self.stale_half_life = stale_half_life
        self._counted = 0  # steps counted in any cell: the clock of a price's staleness
        # (G, V, sampled), with split_arrivals (G, V, sampled, arrivals) -> [weighted sum of
        # ratios, weight, steps seen, the long-run sum and weight, the clock when last
        # counted]: realised / table
        self._ratios: dict[tuple, list] = {}
        self.split_arrivals = split_arrivals
        self._share_decay = 0.5 ** (1.0 / share_half_life)
        # (G, sampled) -> [weighted count of steps with arrivals, weight] (split_arrivals)
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
        key = (*cell, sampled)
        if self.split_arrivals:
            key = (*key, arrivals)
            share = self._shares.setdefault((cell[0], sampled), [0.0, 0.0])
            d = self._share_decay
            share[:] = [share[0] * d + arrivals, share[1] * d + 1.0]
        state = self._ratios.get(key)
        if state is None:
            state = self._ratios[key] = [0.0, 0.0, 0, 0.0, 0.0, self._counted]
        total, weight, steps, long_total, long_weight, _ = state
        if weight and self.stale_half_life:  # (start from the reverted price: module docstring)
            total = self._reverted(state) * weight
        self._counted += 1
        d, b = self._decay, self._baseline_decay
        state[:] = [total * d + ratio, weight * d + 1.0, steps + 1,
                    long_total * b + ratio, long_weight * b + 1.0, self._counted]  # fmt: skip

    def ratio(self, cell: tuple[int, int], sampled: bool) -> float | None:
        """The recent realised / table ratio of a cell (reverted toward its long-run level as
        it goes stale, with stale_half_life), or None with fewer than min_steps; with
        split_arrivals, the mix of its two parts (module docstring)."""
        if not self.split_arrivals:
            return self._ratio_of((*cell, sampled))
        g, v = cell
        steady, busy = self._ratio_of((g, v, sampled, False)), self._ratio_of((g, v, sampled, True))
        if steady is None and busy is None:
            return None
        if steady is None:  # seen only with arrivals: the plain cell's steady part (drift)
            plain = self._ratio_of((g, g, sampled, False)) if v != g else None
            steady = plain if plain is not None else 1.0
        if busy is None:
            busy = steady
        count, weight = self._shares.get((g, sampled), (0.0, 0.0))
        share = count / weight if weight else 0.0
        return (1.0 - share) * steady + share * busy

    def _ratio_of(self, key: tuple) -> float | None:
        state = self._ratios.get(key)
        if state is None or state[2] < self.min_steps:
            return None
        return self._reverted(state) if self.stale_half_life else state[0] / state[1]

    def _reverted(self, state: list) -> float:
        total, weight, _, long_total, long_weight, last = state
        recent, long_run = total / weight, long_total / long_weight
        stale = 0.5 ** ((self._counted - last) / self.stale_half_life)
        return long_run + (recent - long_run) * stale

    def priced(self, g: int, row: Mapping[int, float], sampled: bool) -> dict[int, float]:
        """G's cells (V -> table seconds), each scaled by its own realised ratio, else by the
        plain cell's, else as the table has it (module docstring)."""
        drift = self.ratio((g, g), sampled) or 1.0
        return {v: t * (self.ratio((g, v), sampled) or drift) for v, t in row.items()}

    def as_dict(self) -> dict[str, float]:
        """The known ratios for the metrics: "G=256 V=2048 greedy" -> 1.6."""
        out = {}
        for (g, v, sampled, *arrivals), (total, weight, *_) in sorted(self._ratios.items()):
            name = f"G={g} V={v} {'sampled' if sampled else 'greedy'}"
            if arrivals:  # (split_arrivals: each part on its own)
                name += " arrivals" if arrivals[0] else " steady"
            out[name] = round(total / weight, 3)
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
