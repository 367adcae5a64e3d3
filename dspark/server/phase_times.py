"""Wall time a loop spends in each of its phases, for the one line it logs when it stops.

The serving path's loops (the engine process's step loop, its output sender, the server's
reader of the engine pipe) time their phases with this, so a served run says where its time
went beside the offline engine's (docs/SERVING.md):

    times = PhaseTimes()
    while ...:
        wait(); times.lap("idle")
        step(); times.lap("step")
    logger.info("engine loop: %s", times.summary("step"))
    # engine loop: 5,210 steps; a step: step 1.71 ms, post 0.04 ms; idle 2.31 s in all

A loop that serves in bursts logs a line per busy period (`take`), so that each load level of
a benchmark is seen apart. perf_counter costs ~0.1 us a lap: cheap enough to stay on.
"""

from __future__ import annotations

import copy
from collections import Counter, defaultdict
from time import perf_counter


class PhaseTimes:
    def __init__(self) -> None:
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.counts: Counter[str] = Counter()
        self._last = perf_counter()

    def restart(self) -> None:
        """The next lap starts now (time before it is no phase's)."""
        self._last = perf_counter()

    def lap(self, phase: str) -> None:
        """The time since the last lap (or restart) was spent in `phase`."""
        now = perf_counter()
        self.seconds[phase] += now - self._last
        self.counts[phase] += 1
        self._last = now

    def take(self) -> PhaseTimes:
        """The times so far, as their own PhaseTimes; these start again from nothing (laps
        continue from the last one)."""
        taken = copy.copy(self)
        self.seconds, self.counts = defaultdict(float), Counter()
        return taken

    def summary(self, per: str, totals: tuple[str, ...] = ("idle",)) -> str:
        """Each phase's time per `per` phase (ms), the `totals` phases in all (s)."""
        n = self.counts[per]
        each = ", ".join(f"{p} {1e3 * s / n:.3f} ms" for p, s in self.seconds.items()
                         if p not in totals) if n else "none"  # fmt: skip
        rest = "".join(f"; {p} {self.seconds[p]:.2f} s in all" for p in totals if p in self.seconds)
        return f"{n:,} {per}s; a {per}: {each}{rest}"
