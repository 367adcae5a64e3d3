"""Each request's smoothed survivals per position, as rows of one array, and the step it was
last observed at: what prices the trimmed cells (policy.py, trimmed cells; survival.py keeps
the sums that price the rest, and reads these through SurvivalEstimates.estimate_vectors).

A request holds a slot from its first observed block until it is forgotten; a freed slot is
reused. Two rows are reserved: FLAT (1/K everywhere: the shape of a row without evidence, its
total spread evenly) and POPULATION (the recent requests' weighted survivals). Observing a
step's blocks and reading a step's rows are each one gather and one scatter, whatever the
batch, not a handful of numpy calls per request:

  slot_of {a: 2, b: 3}, observe [b, c] at step 9 -> c takes slot 4;
  rows[[3, 4]] = [rows[3] + w (a_b - rows[3]), a_c], seen[[3, 4]] = 9
  slots([a, x]) -> [2, -1] (x never observed: the caller masks it)
"""

from __future__ import annotations

from itertools import repeat

import numpy as np

FLAT, POPULATION = 0, 1  # the reserved rows
_RESERVED = 2


class SurvivalVectors:
    def __init__(self, draft_len: int, block_weight: float, capacity: int = 64) -> None:
        self.draft_len, self.block_weight = draft_len, block_weight
        self.rows = np.zeros((_RESERVED + capacity, draft_len))
        self.rows[FLAT] = 1.0 / draft_len
        self.seen = np.zeros(len(self.rows), dtype=np.int64)  # the step a slot was observed at
        self.slot_of: dict[str, int] = {}
        self._free = list(range(len(self.rows) - 1, _RESERVED - 1, -1))  # (pop() takes the lowest)

    def observe(self, request_ids: list[str], a: np.ndarray, decay: float, step: int) -> None:
        """A step's calibrated survivals [R, K]: each request's row smoothed toward its block
        (weight block_weight; a request's first block is its row), the population's decayed by
        `decay` (its weight per observed block, to the power R) plus the blocks' sum."""
        slot_of = self.slot_of
        slots = [slot_of.get(rid, -1) for rid in request_ids]
        first = [i for i, slot in enumerate(slots) if slot < 0]
        for i in first:
            slots[i] = self._take(request_ids[i])
        seen = self.rows[slots]
        smoothed = seen + self.block_weight * (a - seen)
        if first:
            smoothed[first] = a[first]
        self.rows[slots] = smoothed
        self.seen[slots] = step
        self.rows[POPULATION] = self.rows[POPULATION] * decay + a.sum(0)

    def forget(self, request_id: str) -> None:
        slot = self.slot_of.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def slots(self, request_ids: list[str]) -> np.ndarray:
        """[R] each request's slot, -1 for one never observed (or forgotten)."""
        return np.fromiter(map(self.slot_of.get, request_ids, repeat(-1)), np.intp,
                           count=len(request_ids))  # fmt: skip

    def _take(self, request_id: str) -> int:
        if not self._free:  # (double the array; the new rows are free)
            old = len(self.rows)
            self.rows = np.concatenate([self.rows, np.zeros((old, self.draft_len))])
            self.seen = np.concatenate([self.seen, np.zeros(old, dtype=np.int64)])
            self._free = list(range(2 * old - 1, old - 1, -1))
        slot = self.slot_of[request_id] = self._free.pop()
        return slot
