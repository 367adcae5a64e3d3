"""The masks of a step's rows with structured output: filled on the host, uploaded, applied.

A plain row that samples one token is masked by its grammar after its outputs. The mask is
filled at launch, while the forward runs, and ModelRunner._sample applies it before any other
shaping: `plain_masks`. (A plain row whose input token is still in flight is not launched
ahead, ModelRunner.can_feed: the grammar has seen every token the row's request has.)

A window needs a mask at every position j, after the drafts x_1 .. x_j, and the drafts exist
only on the device, made inside the step. So such a speculative step is split on the host
(`StepWindowGrammar`): launched up to its verification, then, once the drafts are on the host,
the masks are filled and uploaded and verification is launched with them
(SpecRunner.verify_awaiting). An eager step queues the drafts' copy behind the drafter, before
the target forward; a captured step replays its whole graph (the drafts copied after it) and
runs its verification again, eagerly, with the masks (runner/spec_graphs.py): its captured
verification, unmasked, is not read. Where the host waits for the drafts depends on what runs
before the step:

  launched behind step N (engine/ahead.py), N+1's drafts are copied behind N's results, and
  the one wait of the step is for both (N's `done` becomes the drafts' event):

    device:  .. N ..| draft N+1 ─ copy ─ target N+1 ───────────────────> verify N+1 (masked)
    host:    launch N+1 ─ wait N and N+1's drafts ─ update N ─ fill masks ─ upload ─┘

  (update N moves the matchers by N's tokens, the anchor of a continuation among them, so the
  masks start from the state N+1's windows start from; a request N finished has no mask);

  launched with nothing in flight, the step waits for its own drafts, then for its results:

    device:  draft ─ copy ─ target forward ───────────────> verify (logits masked per position)
    host:          └─ wait ─ fill masks ─ upload ─┘

That second wait is the one exception to one host synchronisation a step (docs/SPECULATION.md
4.9, 9.2), counted in `structured_output_syncs`; only a step with grammar windows and nothing
in flight before it has it. A step without grammar windows runs as before.
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
        rows = [j for j, i in enumerate(window_rows) if i in grammar]
        if not rows:
            return None
        self.stats["structured_output_windows"] += len(rows)
        reqs = [plan.rows[window_rows[j]].request for j in rows]
        # (a trimmed cell verifies at most a row's num_draft)
        lengths = [plan.rows[window_rows[j]].num_draft for j in rows]
        return StepWindowGrammar(self, rows, reqs, lengths, width)


class StepWindowGrammar:
    """One step's grammar windows (module docstring):

    windows of plan rows [4, 7, 9], grammar rows (7,), K = 3, row 7 verifies 2 drafts
    rows [1]; drafts of window 1: [x1, x2, x3] -> masks after [], [x1], [x1, x2] at positions
    0, 1, 2 of bitmask slot 0 (position 3, past its drafts: all-allowed, never read);
    slot [-1, 0, -1] (-1: no mask, also for a request that finished before the masks were filled)
    """

    def __init__(
        self,
        owner: GrammarMasks,
        rows: list[int],  # the windows with a grammar (indices into the step's windows)
        reqs: list[Request],  # their requests
        lengths: list[int],  # the drafts each verifies at most
        width: int,  # K + 1
    ) -> None:
        self.owner, self.rows, self.reqs = owner, rows, reqs
        self.lengths, self.width = lengths, width
        self._drafts: torch.Tensor | None = None
        self.copied: torch.cuda.Event | None = None  # recorded behind the drafts' copy
        self.waited = False  # set when a wait for an earlier event covered `copied`

    def copy_drafts(self, drafts: torch.Tensor) -> None:
        """Queue the drafts [R, K] to the host (all rows: R K integers, no gather first)."""
        self._drafts = drafts.to("cpu", non_blocking=True, copy=True)
        if drafts.is_cuda:
            self.copied = torch.cuda.Event()
            self.copied.record()

    def masks(self, num_rows: int) -> WindowMasks | None:
        """The masks after each live grammar row's outputs (its matcher now) and drafts, for a
        step of num_rows windows (a captured step's pad windows after the live ones: no mask);
        None when every grammar row's request has finished."""
        owner = self.owner
        if not self.waited:
            # sync: a step with grammar windows and nothing before it waits for its drafts
            # (module docstring), counted
            if self.copied is not None:
                self.copied.synchronize()
            owner.stats["structured_output_syncs"] += 1
        drafts = self._drafts.numpy()
        slot = np.full(num_rows, -1, dtype=np.int64)
        matchers, window_drafts = [], []
        for j, req, n in zip(self.rows, self.reqs, self.lengths, strict=True):
            if req.is_finished:  # (it stopped in the step before: its row's tokens are dropped)
                continue
            slot[j] = len(matchers)
            matchers.append(req.grammar)
            window_drafts.append(drafts[j, :n].tolist())
        if not matchers:
            return None
        bits = owner.filler.window_bitmasks(matchers, window_drafts, self.width)
        return WindowMasks(host_to_device(bits, torch.int32, owner.device),
                           host_to_device(slot, torch.int64, owner.device))  # fmt: skip
