"""The masks of a step's rows with structured output: filled on the host, uploaded, applied.

A plain row that samples one token is masked by its grammar after its outputs. The mask is
filled at launch, while the forward runs, and ModelRunner._sample applies it before any other
shaping: `plain_masks`. (The step was not launched ahead of the one before it, engine/ahead.py:
the grammar has seen every token the row's request has.)

A window needs a mask at every position j, after the drafts x_1 .. x_j, and the drafts exist
only on the device, made inside the step. So such a speculative step runs eagerly, split on the
host (`StepWindowGrammar`, the WindowGrammar that SpecDecoder calls):

  device:  draft ──> target forward ───────────────> verify (logits masked per position)
  host:         └─ copy drafts ─ wait ─ fill masks ─ upload ─┘

The copy of the drafts is queued before the target forward, so the wait is for the drafter
only, and the host fills the masks while the target runs. The wait is the step's second host
synchronisation, the one exception to one a step (docs/SPECULATION.md 4.9, 9.2): counted in
`structured_output_syncs`, and only a step with grammar rows among its windows has it; a step
without any runs as before, captured where it fits.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch

from dspark.request import Request
from dspark.runner.input_buffers import host_to_device
from dspark.sample.token_bitmask import WindowMasks
from dspark.step_plan import StepPlan
from dspark.structured.masks import BitmaskFiller
from dspark.structured.matcher import GrammarMatcher


class GrammarMasks:
    """The runner's: one filler (llguidance's threads, started on first use) for all steps."""

    def __init__(self, vocab_size: int, device: torch.device, stats: Counter[str]) -> None:
        self.filler = BitmaskFiller(vocab_size)
        self.device, self.stats = device, stats

    def plain_masks(
        self,
        plan: StepPlan,
        sampled_rows: np.ndarray,  # [N] plan rows that sample one token
        reqs: list[Request],  # the plan rows' requests
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(bitmask [M, W], index [N]: each sampled row's bitmask row, -1 for a row without a
        grammar) on the device, for sample/token_bitmask.apply_token_bitmask; None when no
        sampled row has a grammar.

          sampled rows [0, 2, 3], grammar rows (0, 3) -> index [0, -1, 1]
        """
        grammar = set(plan.grammar_rows)
        index = np.full(sampled_rows.size, -1, dtype=np.int64)
        matchers: list[GrammarMatcher] = []
        for j, i in enumerate(sampled_rows.tolist()):
            if i in grammar:
                index[j] = len(matchers)
                matchers.append(reqs[i].grammar)
        if not matchers:
            return None
        self.stats["structured_output_rows"] += len(matchers)
        bits = self.filler.anchor_bitmasks(matchers)
        return (host_to_device(bits, torch.int32, self.device),
                host_to_device(index, torch.int64, self.device))  # fmt: skip

    def window_grammar(
        self, plan: StepPlan, window_rows: list[int], width: int
    ) -> StepWindowGrammar | None:
        """The grammar rows among a speculative step's windows (window_rows: plan rows in
        verification order; width: K + 1 positions a window), or None without any."""
        grammar = set(plan.grammar_rows)
        slot = np.full(len(window_rows), -1, dtype=np.int64)
        matchers, lengths = [], []
        for j, i in enumerate(window_rows):
            if i in grammar:
                slot[j] = len(matchers)
                matchers.append(plan.rows[i].request.grammar)
                lengths.append(plan.rows[i].num_draft)  # (a trimmed cell verifies at most it)
        if not matchers:
            return None
        self.stats["structured_output_windows"] += len(matchers)
        return StepWindowGrammar(self, slot, matchers, lengths, width)


class StepWindowGrammar:
    """One step's grammar windows (module docstring):

    windows of plan rows [4, 7, 9], grammar rows (7,), K = 3, row 7 verifies 2 drafts
    slot [-1, 0, -1]; drafts of window 1: [x1, x2, x3] -> masks after [], [x1], [x1, x2]
    at positions 0, 1, 2 of slot 0 (position 3, past its drafts: all-allowed, never read)
    """

    def __init__(
        self,
        owner: GrammarMasks,
        slot: np.ndarray,  # [R] each window's grammar slot, -1: none
        matchers: list[GrammarMatcher],  # per slot
        lengths: list[int],  # per slot: the drafts its window verifies at most
        width: int,  # K + 1
    ) -> None:
        self.owner, self.slot, self.matchers = owner, slot, matchers
        self.lengths, self.width = lengths, width
        self._drafts: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None

    def copy_drafts(self, drafts: torch.Tensor) -> None:
        """Queue the drafts [R, K] to the host (all rows: R K integers, no gather first)."""
        self._drafts = drafts.to("cpu", non_blocking=True, copy=True)
        if drafts.is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()

    def masks(self) -> WindowMasks:
        owner = self.owner
        # sync: a step with grammar windows waits for its drafts (module docstring), counted
        if self._copied is not None:
            self._copied.synchronize()
        owner.stats["structured_output_syncs"] += 1
        rows = np.flatnonzero(self.slot >= 0)
        drafts = self._drafts.numpy()[rows]  # [M, K] in slot order
        drafts = [d[:n].tolist() for d, n in zip(drafts, self.lengths, strict=True)]
        bits = owner.filler.window_bitmasks(self.matchers, drafts, self.width)
        return WindowMasks(host_to_device(bits, torch.int32, owner.device),
                           host_to_device(self.slot, torch.int64, owner.device))  # fmt: skip
