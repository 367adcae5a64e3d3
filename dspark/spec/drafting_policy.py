"""Whether the next step drafts: the lagged-capacity choice between plain decoding and the full
block, priced by the measured cost table (DSPARK.md 6.3 item 2, 6.4).

Drafting is not free: the block is drafted in full for every window, and on a small target the
whole speculative step costs several plain steps at high batch. Before each step the host prices
the two cells of the step's graph size G that the engine can run today:

  plain (V = G)           expected tokens R                      / step_seconds(G, G)
  full block (V = G(K+1)) expected tokens R + sum_r sum_j a[r, j] / step_seconds(G, G(K+1))

with a[r, j] the calibrated survivals of each running request's last verified block (at least
one step old: the drafts they describe are already verified, so the choice cannot depend on the
tokens it admits; DSPARK.md 6.3). A request with no survivals yet (just admitted, preempted,
never drafted) counts as fully confident: a = 1. While drafting is off nothing refreshes the
survivals, so each request keeps the last ones it had: under steady load the choice is steady.

Flapping is prevented twice over (lagged.choose_cell): the other mode must beat the incumbent by
(1 + min_gain)^2, and after a switch the mode is held for min_dwell_steps steps. Example, G = 64,
K = 7, plain 1.0 ms, full 2.4 ms, survivals summing to 1.0 per row: plain 64 / 1.0 = 64 tokens/ms,
full 64 * 2.0 / 2.4 = 53 tokens/ms, so drafting goes off (64 > 53 * 1.02^2); it comes back only
when the full block's estimate beats plain by 4%, e.g. when load falls to G = 1 (1.0 vs 1.5 ms:
2.0 / 1.5 = 1.33 against 1.0 tokens/ms).

Trimmed cells (1 < V / G < K + 1) need ragged verify graphs and are not considered yet; a table
that has them is used for its plain and full-block cells only.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass

import torch

from dspark.spec.cost_table import CostTable, full_block_tokens
from dspark.spec.lagged import choose_cell, survival


@dataclass(frozen=True)
class Decision:
    drafting: bool
    reason: str  # for the counters: "full block", "no drafting", "dwell", "no table", ...


class DraftingPolicy:
    def __init__(
        self,
        table: CostTable | None,  # None: always draft (fixed K), the reason counted
        temperatures: torch.Tensor,  # [K] STS temperatures (host)
        draft_len: int,  # K verified per full block
        min_gain: float = 0.02,
        min_dwell_steps: int = 8,
    ) -> None:
        self.draft_len = draft_len
        self.temperatures = temperatures.float().cpu()
        self.min_gain, self.min_dwell_steps = min_gain, min_dwell_steps
        self.table = None
        if table is not None:  # the cells the engine can run: plain and the full block
            cells = {}
            for g, row in table.cells.items():
                runnable = {
                    v: t for v, t in row.items() if v in (g, full_block_tokens(g, draft_len))
                }
                if len(runnable) == 2:
                    cells[g] = runnable
            self.table = CostTable(table.fingerprint, cells) if cells else None
        self.sizes = sorted(self.table.cells) if self.table else []
        self.drafting = True
        self._steps_in_mode = 0
        self._survival: dict[str, torch.Tensor] = {}  # request id -> [K], the last block's
        self.counters: Counter[str] = Counter()

    # ---- what the step saw ------------------------------------------------------------------

    def observe(self, request_ids: list[str], confidence_logits: torch.Tensor) -> None:
        """After a speculative step's sync: each window's raw confidences [R, K] (host)."""
        a = survival(confidence_logits[:, : self.draft_len].float(), self.temperatures)
        for rid, row in zip(request_ids, a, strict=True):
            self._survival[rid] = row

    def forget(self, request_id: str) -> None:
        self._survival.pop(request_id, None)

    # ---- the choice -------------------------------------------------------------------------

    def decide(self, request_ids: list[str]) -> Decision:
        """Whether the step about to be scheduled for these running requests drafts."""
        decision = self._decide(request_ids)
        if decision.drafting != self.drafting:
            self.counters["drafting_switches"] += 1
            self.drafting, self._steps_in_mode = decision.drafting, 0
        self._steps_in_mode += 1
        self.counters[f"steps_{'drafting' if decision.drafting else 'not_drafting'}"] += 1
        self.counters[f"decision_{decision.reason.replace(' ', '_')}"] += 1
        return decision

    def _decide(self, request_ids: list[str]) -> Decision:
        if self.table is None:
            return Decision(True, "no table")
        if not request_ids:
            return Decision(self.drafting, "idle")
        if self._steps_in_mode < self.min_dwell_steps:
            return Decision(self.drafting, "dwell")
        i = bisect.bisect_left(self.sizes, len(request_ids))
        if i == len(self.sizes):
            return Decision(True, "batch beyond the table")
        ones = torch.ones(self.draft_len)
        a = torch.stack([self._survival.get(rid, ones) for rid in request_ids])
        choice = choose_cell(a, self.sizes[i], self.table, self.draft_len, self.min_gain,
                             drafting_now=self.drafting)  # fmt: skip
        return Decision(choice.geometry.drafts, choice.reason)
