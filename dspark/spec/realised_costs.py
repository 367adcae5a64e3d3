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
    def __init__(self, half_life: float = 64.0, min_steps: float = 8.0) -> None:
        if half_life <= 0 or min_steps <= 0:
            raise ValueError(f"half_life and min_steps must be > 0, got {half_life}, {min_steps}")
        self._decay = 0.5 ** (1.0 / half_life)
        self.min_steps = min_steps
        # (G, V, sampled) -> (weighted sum of ratios, weight, steps seen): realised / table
        self._ratios: dict[tuple[int, int, bool], tuple[float, float, int]] = {}

    def record(self, cell: tuple[int, int], sampled: bool, table_s: float, seconds: float) -> None:
        """One step of `cell` took `seconds`; the table says `table_s`."""
        ratio = min(MAX_RATIO, max(MIN_RATIO, seconds / table_s))
        key = (*cell, sampled)
        total, weight, steps = self._ratios.get(key, (0.0, 0.0, 0))
        self._ratios[key] = (total * self._decay + ratio, weight * self._decay + 1.0, steps + 1)

    def ratio(self, cell: tuple[int, int], sampled: bool) -> float | None:
        """The recent realised / table ratio of a cell, or None with fewer than min_steps."""
        total, weight, steps = self._ratios.get((*cell, sampled), (0.0, 0.0, 0))
        return total / weight if steps >= self.min_steps else None

    def priced(self, g: int, row: Mapping[int, float], sampled: bool) -> dict[int, float]:
        """G's cells (V -> table seconds), each scaled by its own realised ratio, else by the
        plain cell's, else as the table has it (module docstring)."""
        drift = self.ratio((g, g), sampled) or 1.0
        return {v: t * (self.ratio((g, v), sampled) or drift) for v, t in row.items()}

    def as_dict(self) -> dict[str, float]:
        """The known ratios for the metrics: "G=256 V=2048 greedy" -> 1.6."""
        out = {}
        for (g, v, sampled), (total, weight, _) in sorted(self._ratios.items()):
            out[f"G={g} V={v} {'sampled' if sampled else 'greedy'}"] = round(total / weight, 3)
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
