"""The drafting policy's constants, in one place (docs/SPECULATION.md, the policy).

None of them is a user setting: each was measured on the GPUs the engine targets and the
losing values are gone. The policy takes them as one argument, so that a test needing another
value builds a variant (`dataclasses.replace(TUNING, dwell_steps=2)`) instead of the policy
growing a keyword per constant.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class PolicyTuning:
    # ---- the choice (policy.py, cells.py) ----
    # what another cell must beat the incumbent by, squared when it switches drafting on or
    # off: noise in the lagged estimates cannot flip the mode every step
    min_gain: float = 0.02
    # plain steps drafting stays off once the policy turned it off (the second flapping guard)
    dwell_steps: int = 8
    # the share of the time spent not drafting that probes of stale survivals may cost
    probe_budget: float = 0.01
    # ---- the survival estimates (survival.py) ----
    # full blocks, of the realised / predicted recalibration and the population's mean
    calibration_half_life: float = 256.0
    # ratio-1 pseudo-blocks behind the recalibration: a few blocks cannot swing it
    prior_blocks: float = 4.0
    # observed blocks before the population's mean prices anything (before: K)
    min_population_blocks: float = 16.0
    # blocks, of a request's smoothed survival sum (1: the newest block weighs one half)
    block_half_life: float = 1.0
    # steps, of an aged estimate's pull toward the population mean
    regression_half_life: float = 8.0
    # weighted (estimate, kept drafts) pairs before the persistence slope is used (before: 1)
    min_persistence_blocks: float = 32.0
    # rows a drafting step adds to the persistence fit: a large batch gives far more than the
    # fit needs, and observe() runs after every drafting step
    persistence_pairs_per_step: int = 16
    # ---- realised step costs (realised_costs.py) ----
    # steps, of a cell's recent realised / table ratio
    price_half_life: float = 64.0
    # steps of a cell before its own ratio prices it
    min_price_steps: float = 8.0
    # steps counted in other cells, of an unmeasured price's reversion to its long-run level
    stale_price_half_life: float = 16.0
    # steps, of a cell's long-run ratio (what a stale price reverts to)
    baseline_price_half_life: float = 1024.0
    # counted steps at a G, of its share of steps with arrivals
    arrival_share_half_life: float = 64.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value, low = getattr(self, f.name), 0 if f.name in MAY_BE_ZERO else 1e-12
            if not low <= value:
                raise ValueError(f"PolicyTuning.{f.name} must be {'>= 0' if low == 0 else '> 0'}, "
                                 f"got {value}")  # fmt: skip
        if self.probe_budget > 1 or self.min_gain >= 1:
            raise ValueError(f"PolicyTuning: probe_budget must be <= 1 and min_gain < 1, got "
                             f"{self.probe_budget} and {self.min_gain}")  # fmt: skip


# constants whose zero means something: no margin, no dwell, a request's newest block alone
MAY_BE_ZERO = frozenset({"min_gain", "dwell_steps", "block_half_life"})
TUNING = PolicyTuning()
