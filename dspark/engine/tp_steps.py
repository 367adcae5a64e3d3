"""How the ranks of a tensor-parallel engine agree on every step, and check that they did.

Every rank runs the same engine on the same requests, so each step's plan, drafts, verify
lengths and tokens come out the same everywhere as long as every input agrees:

  - what only rank 0 sees: requests added and aborted since the last step, and the drafting
    policy's cell (its realised costs are rank 0's wall clock). Rank 0 sends them at the
    start of each step (the header); the workers apply them before they schedule.
  - stop strings: only rank 0 detokenizes. After a step whose requests have stop strings,
    rank 0 sends where each stopped; the workers truncate and finish them the same way.
  - tokens and acceptance: the logits are gathered whole on every rank (bitwise the same: one
    all-gather of all-reduced activations), and sampling draws its uniforms from
    (seed, position), so every rank samples and accepts the same tokens with no message.
  - the schedule: derived on every rank from the same state. Before each launch rank 0 sends
    its plan's digest and a worker whose own differs raises PlanDivergedError at once (a rank
    that launched a different step would hang in, or corrupt, the next collective).

None of these messages waits for the device: they cross the gloo host group, so the step keeps
its one host synchronisation (ModelRunner.collect). They cost three small gloo broadcasts a
step (the header's length and bytes, the digest), two more after a step whose requests have
stop strings; with one rank the engine sends nothing.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch
import torch.distributed as dist

from dspark.distributed.parallel_state import TensorParallel
from dspark.step_plan import StepPlan


class PlanDivergedError(RuntimeError):
    """A worker's plan for a step differs from rank 0's: an engine invariant is broken."""


def plan_digest(plan: StepPlan) -> torch.Tensor:  # [3] int64
    """(rows, crc32 of each row's (start, tokens, drafts), crc32 of the request ids).

    Request ids, not serials: a serial counts requests in this process, and a worker's process
    may have served fewer engines than rank 0's."""
    shape = np.array([(r.start, r.num_tokens, r.num_draft) for r in plan.rows], dtype=np.int64)
    ids = "\0".join(r.request.request_id for r in plan.rows).encode()
    return torch.tensor([len(plan.rows), zlib.crc32(shape.tobytes()), zlib.crc32(ids)])


class TPSteps:
    """The messages of one rank (rank 0 sends, the others receive), over the host group."""

    def __init__(self, tp: TensorParallel) -> None:
        self.tp = tp
        self.num_steps = 0

    def share(self, value: object = None) -> object:
        """Rank 0's `value` on every rank (workers pass nothing)."""
        return self.tp.broadcast_object(value)

    def check_plan(self, plan: StepPlan) -> None:
        """Raise PlanDivergedError on a worker whose plan is not rank 0's."""
        self.num_steps += 1
        mine = plan_digest(plan)
        theirs = mine.clone()
        dist.broadcast(theirs, 0, group=self.tp.cpu_group)
        if not torch.equal(mine, theirs):
            raise PlanDivergedError(
                f"rank {self.tp.rank}'s plan for launch {self.num_steps} differs from rank 0's: "
                f"(rows, shape crc, ids crc) {mine.tolist()} against {theirs.tolist()}"
            )
