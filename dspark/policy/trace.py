"""A step-by-step record of the drafting policy's choices: where a scheduled run loses time.

The policy's counters say how often it drafted and why; they cannot say when. A policy that
drafts most steps in a handful of long stretches, with repeats that spread widely, raises
per-step questions: which stretch cost the time, what the prices and survivals read when
drafting went off, and what brought it back. With DSPARK_POLICY_TRACE=DIR every engine
with a drafting policy writes one JSON line per decision to DIR/policy_trace_<pid>_<n>.jsonl
(n counts the process's traced engines, in creation order: a bench's arms). Engines without
a policy (plain decoding, fixed K) write a line per step too, without the decision's fields,
so that arms compare step by step. Off by default. A line costs 1.3-2.3x the policy's own
decide() (its prices read again, the JSON, the write; `bench/policy.py host-cost` measures
both). Enough to see where time goes, not to time the engine: compare traced arms with traced
arms.

A decision's line (times in seconds, `t` from the trace's start, perf_counter):

  {"t": 1.234, "cpu_s": 1.101, "wait_s": 0.052, "R": 64, "waiting": 3, "seats": 0,
   "prefilling": 1, "sampled": false, "drafting": false, "reason": "no drafting", "cell": [64, 64],
   "priced": {"64": 0.00148, "512": 0.00282}, "table": {"64": 0.00106, "512": 0.00174},
   "survival_sum": 51.2, "fresh": 60, "stale": 0, "unseen": 4, "correction": 0.92,
   "persistence": 0.61, "population_mean": 1.71, "stale_after": 65,
   "period": {"cell": [64, 512], "sampled": false, "seconds": 0.0036},
   "stats": {"spec_graph_steps": 1, "spec_graph_steps_mixed": 1}}

- R, waiting, seats, prefilling: the running requests the decision priced, the queue, the free
  sequence slots (waiting and seats > 0: the step admits arrivals, whose prefill rides on it)
  and running requests still prefilling.
- priced / table: the step's runnable cells (V -> seconds) as the policy priced them (the
  table scaled by realised costs) and as the table has them; survival_sum and the row counts
  by kind (fresh, stale, unseen) are the lagged evidence the choice rested on.
- period: the realised step cost this decision taught (realised_costs.py StepPeriods),
  or null; stats: the runner's counters that moved since the previous decision (what the
  pipeline ran in between).
- cpu_s, wait_s: the engine thread's CPU seconds (time.thread_time) and the wall seconds it
  waited in the steps' host synchronisation (ModelRunner.sync_wait_s), both since the trace
  began. The CUDA synchronisation spins, so CPU time includes the wait: a step's host work is
  its CPU time less its wait, and its period beyond its CPU time is time the thread did not
  run (descheduled).
- A line {"t": ..., "mark": {...}} is the caller's label (a bench's arm, level and repeat).
- An engine without a policy writes {"t", "cpu_s", "wait_s", "R", "waiting", "seats",
  "prefilling", "drafting", "stats"} per step ("drafting": whether its steps draft, fixed K).

`python bench/policy.py trace FILE` summarises a trace: time by graph size and mode, and
every stretch without drafting with what started and ended it.
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from dspark import envs
from dspark.policy.policy import Decision, DraftingPolicy
from dspark.policy.survival import FRESH, STALE, UNSEEN

_engines = itertools.count()  # this process's traced engines, in creation order


class PolicyTrace:
    def __init__(
        self,
        policy: DraftingPolicy | None,
        path: str | Path,
        runner=None,  # its sync_wait_s
    ) -> None:
        self.policy = policy
        self._runner = runner
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # line-buffered: an engine process ends without running atexit (multiprocessing)
        self._file = self.path.open("w", buffering=1)
        self._start = time.perf_counter()
        self._cpu_start = time.thread_time()
        self._wait_start = self._waited()
        self._stats: dict[str, int] = {}
        atexit.register(self.close)

    @classmethod
    def from_env(cls, policy: DraftingPolicy | None, runner=None) -> PolicyTrace | None:
        """A trace under $DSPARK_POLICY_TRACE (None when it is unset); `policy` None: an engine
        without a drafting policy; `runner`: the ModelRunner whose sync wait is reported."""
        directory = envs.ENVS.policy_trace
        if directory is None:
            return None
        name = f"policy_trace_{os.getpid()}_{next(_engines)}.jsonl"
        return cls(policy, Path(directory) / name, runner)

    def _waited(self) -> float:
        return self._runner.sync_wait_s if self._runner is not None else 0.0

    def decided(
        self,
        decision: Decision,
        request_ids: list[str],
        scheduler,  # engine/scheduler.py Scheduler: the queue and the running requests
        runner_stats: Mapping[str, int],
        period: tuple[Decision, float] | None,  # what StepPeriods counted at this decision
        now: float,
    ) -> None:
        """One decision's line; call it after policy.decide() and before record_step(), so the
        prices recorded are the ones the decision saw."""
        line = {
            **self._queue(scheduler, now),
            "sampled": decision.sampled,
            "drafting": decision.drafting,
            "reason": decision.reason,
            "cell": list(decision.cell) if decision.cell else None,
            **self._evidence(decision, request_ids),
            "period": None,
            "stats": self._moved(runner_stats),
        }
        if period is not None:
            counted, seconds = period
            cell = list(counted.cell) if counted.cell else None  # (no table: no cell)
            line["period"] = {"cell": cell, "sampled": counted.sampled,
                              "seconds": round(seconds, 7)}  # fmt: skip
        self._write(line)

    def stepped(
        self, scheduler, runner_stats: Mapping[str, int], drafting: bool, now: float
    ) -> None:
        """An engine without a policy: one line per step, before it is scheduled."""
        self._write({**self._queue(scheduler, now), "drafting": drafting,
                     "stats": self._moved(runner_stats)})  # fmt: skip

    def _queue(self, scheduler, now: float) -> dict:
        """When, and the requests the step starts from: running, waiting, free seats and
        running requests still prefilling."""
        running = scheduler.running
        return {
            "t": round(now - self._start, 6),
            "cpu_s": round(time.thread_time() - self._cpu_start, 6),
            "wait_s": round(self._waited() - self._wait_start, 6),
            "R": len(running),
            "waiting": len(scheduler.waiting),
            "seats": scheduler.max_num_seqs - len(running),
            "prefilling": sum(r.is_prefilling for r in running),
        }

    def mark(self, **labels) -> None:
        """A label in the trace (the bench's arm, level and repeat)."""
        self._write({"t": round(time.perf_counter() - self._start, 6), "mark": labels})

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()

    def _evidence(self, decision: Decision, request_ids: list[str]) -> dict:
        """The prices and lagged survivals the decision rested on (empty without a cell)."""
        if decision.cell is None:
            return {}
        policy, g = self.policy, decision.cell[0]
        priced = policy.priced_cells(len(request_ids), decision.sampled)
        table = policy.sampled_table if decision.sampled else policy.table
        # the decision's own estimates, or (a dwell decides without them) computed here
        totals, kinds = policy.last_row_totals or policy.row_totals(
            request_ids, g, decision.sampled
        )
        kinds = np.asarray(kinds)  # (lists or, where trimmed cells priced it, arrays)
        estimates = policy.estimates
        mean = estimates.population_mean()
        return {
            "priced": {str(v): round(s, 7) for v, s in priced[1].items()} if priced else None,
            "table": {str(v): s for v, s in table.cells[g].items()},
            "survival_sum": round(float(np.sum(totals)), 4),
            "fresh": int(np.count_nonzero(kinds == FRESH)),
            "stale": int(np.count_nonzero(kinds == STALE)),
            "unseen": int(np.count_nonzero(kinds == UNSEEN)),
            "correction": round(estimates.correction, 4),
            "persistence": round(estimates.persistence, 4),
            "population_mean": None if mean is None else round(mean, 4),
            "stale_after": policy.stale_after(g, decision.sampled),
        }

    def _moved(self, stats: Mapping[str, int]) -> dict[str, int]:
        """The counters that moved since the last call."""
        before, self._stats = self._stats, dict(stats)
        return {k: v - before.get(k, 0) for k, v in self._stats.items() if v != before.get(k, 0)}

    def _write(self, line: dict) -> None:
        self._file.write(json.dumps(line, separators=(",", ":")) + "\n")
