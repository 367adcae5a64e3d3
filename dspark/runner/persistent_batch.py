"""Which request each row of the step's buffers holds, kept from step to step (vLLM's
persistent batch, InputBatch).

A decode batch changes little between steps: most rows keep their request, a few requests
finish (the rows behind them move up), a few are admitted (appended), and now and then one
crosses a page boundary. Row i of the block table and of the sampling parameters therefore
stays as it was unless its request changed; `sync` finds the rows that did with a few numpy
comparisons and applies only the changes:
  - a row whose request sat in another row last step (rows moving up past a finished request)
    is copied from there, a numpy gather of whole rows;
  - a row whose request is new to the batch (or was preempted since: its pages were rebuilt)
    is written from the request's page list and SamplingParams;
  - a row whose request grew a page gets the new pages only.
What a row holds is InputBuffers.block_row_owner / _preemptions / _num_pages (see there).
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from dspark.request import Request
from dspark.runner.input_buffers import NO_OWNER, InputBuffers
from dspark.sample.sampling_rows import SamplingRows
from dspark.step_plan import SCRATCH_PAGE

NOT_FOUND = -1


def index_of(haystack: np.ndarray, needles: np.ndarray) -> np.ndarray:
    """For each needle, an index i with haystack[i] == needle (NOT_FOUND where none).

    haystack [7, -1, 3, 9], needles [9, 3, 5] -> [3, 2, -1]
    """
    order = np.argsort(haystack, kind="stable")
    ranked = haystack[order]  # [-1, 3, 7, 9]
    at = np.minimum(np.searchsorted(ranked, needles), len(ranked) - 1)  # [3, 1, 2]
    return np.where(ranked[at] == needles, order[at], NOT_FOUND)


class PersistentBatch:
    def __init__(self, buffers: InputBuffers, sampling: SamplingRows) -> None:
        self.buffers = buffers
        self.sampling = sampling
        # rows copied from another row, written from their request, given new pages only
        self.counts: Counter[str] = Counter()

    def sync(self, reqs: list[Request]) -> np.ndarray:
        """Make rows 0..n-1 hold reqs[0..n-1] (block table and sampling parameters); returns
        the requests' serials [n]."""
        b = self.buffers
        n = len(reqs)
        serials = np.array([q.serial for q in reqs], dtype=np.int64)
        preemptions = np.array([q.num_preemptions for q in reqs], dtype=np.int64)
        num_pages = np.array([len(q.page_ids) for q in reqs], dtype=np.int64)
        stale = np.flatnonzero(
            (b.block_row_owner[:n] != serials)
            | (b.block_row_preemptions[:n] != preemptions)
            | (b.block_row_num_pages[:n] != num_pages)
        )
        if stale.size:
            self._move_rows(stale, serials[stale], preemptions[stale])
            self._write_rows(reqs, stale)
        return serials

    def _move_rows(self, stale: np.ndarray, serials: np.ndarray, preemptions: np.ndarray) -> None:
        """Stale rows whose request holds another row (at the same preemption count) take a
        copy of it: its pages so far and its sampling parameters.

          owner [5, 6, 7, 8], step rows [5, 7, 8] (6 finished): stale rows [1, 2]
          src [2, 3] -> rows 1, 2 <- rows 2, 3; owner [5, 7, 8, 8] (row 3 a stale copy: harmless,
          it still holds a true prefix of request 8's pages)
        """
        b = self.buffers
        src = index_of(b.block_row_owner, serials)
        src_preemptions = b.block_row_preemptions[np.maximum(src, 0)]
        movable = (src >= 0) & (src_preemptions == preemptions) & (src != stale)
        if not movable.any():
            return
        dst, src = stale[movable], src[movable]
        bt = b.np("block_table")
        bt[dst] = bt[src]
        for field in (b.block_row_owner, b.block_row_preemptions, b.block_row_num_pages):
            field[dst] = field[src]
        self.sampling.move(dst, src)
        self.counts["rows_moved"] += int(dst.size)

    def _write_rows(self, reqs: list[Request], stale: np.ndarray) -> None:
        """Rows still not matching their request after the moves: new requests written in full,
        requests that grew a page get the new pages (the rest of the row is scratch already)."""
        b = self.buffers
        bt = b.np("block_table")
        owner, preempted, have = b.block_row_owner, b.block_row_preemptions, b.block_row_num_pages
        for i in stale.tolist():
            req = reqs[i]
            pages = req.page_ids
            first = int(have[i])
            if owner[i] != req.serial or preempted[i] != req.num_preemptions:
                first = 0
                self.sampling.write(i, req)
                self.counts["rows_written"] += 1
            if first == len(pages):
                continue  # (moved in with all its pages)
            if first > len(pages):
                first = 0  # (cannot happen while a request runs: pages only grow; be exact)
            bt[i, first : len(pages)] = pages[first:]
            self.counts["rows_grown"] += first > 0
            if first == 0:
                bt[i, len(pages) :] = SCRATCH_PAGE
            owner[i], preempted[i], have[i] = req.serial, req.num_preemptions, len(pages)

    def invalidate(self) -> None:
        """Forget every row (a test's reference rebuild, or rows written by someone else)."""
        self.buffers.block_row_owner[:] = NO_OWNER
