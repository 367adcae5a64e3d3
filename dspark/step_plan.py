"""The seam between the engine and the runner: the step plan the scheduler hands the runner,
what the runner hands back per row, the launched step in flight, and the KV page conventions
both sides keep.

`Scheduler.schedule()` (engine/scheduler.py) returns a frozen StepPlan, one ScheduledRow per
request that runs; the runner reads it without mutating requests and returns one SampledTokens
(or None) per row, which `Scheduler.update()` writes into the requests. A mixed step puts its
head rows first (`is_head`: windows, or decode rows in a plain step), the layout the runner's
captured mixed steps replay.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from dspark.request import Request, TokenLogprobs

# Page SCRATCH_PAGE is reserved: the allocator never hands it to a request. Pad rows (and
# anything else that must write somewhere harmless) write there, so a zero-initialised slot
# buffer is harmless too.
SCRATCH_PAGE = 0


PAD_SLOT = SCRATCH_PAGE  # slot 0 of the scratch page: where a pad row's K/V goes
PAD_TOKEN_ID = 0  # a pad row's input token (its logits are never read)


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages that hold num_tokens tokens: pages_for(17, 16) == 2."""
    return -(-num_tokens // page_size)


# a NamedTuple built from all its fields, in order, without its generated __new__ (a Python
# call): for the per-row tuples of a step, a few hundred at high load
#   new_tuple(ScheduledRow, (req, 5, 1, True, 0, False, False)) == ScheduledRow(req, 5, 1, True)
new_tuple = tuple.__new__


class ScheduledRow(NamedTuple):
    """One request's share of a step: tokens [start, start + num_tokens) of its token_ids.

    (A NamedTuple, like SampledTokens: immutable, and built several hundred times per step at
    high batch, where a frozen dataclass's __init__ costs 4x as much.)
    """

    request: Request
    start: int
    num_tokens: int  # tokens fed to the target: a prefill chunk, or 1 + num_draft
    do_sample: bool  # the chunk reaches the last known token: its logits give the next one
    num_draft: int = 0  # drafted positions verified this step (verify_len; 0: no window)
    # the anchor is what this request's in-flight window emits last, on the device; `start` is
    # then the latest position it can have (the host's upper bound, what staging writes)
    is_continuation: bool = False
    # a plain decode row of a drafting request whose next token is its last (max_tokens leaves
    # no room for a draft): the runner may verify it as a window of verify length 0 (the anchor
    # alone, its draft ignored) so that a step of windows keeps its graph. It stays a plain
    # row here: one KV slot reserved, a placeholder advanced, one token updated.
    empty_window: bool = False

    @classmethod
    def of(cls, request: Request, num_tokens: int) -> ScheduledRow:
        start = request.num_computed_tokens
        return cls(request, start, num_tokens, start + num_tokens == request.num_tokens)

    @classmethod
    def window(cls, request: Request, num_draft: int) -> ScheduledRow:
        """[anchor, num_draft drafts]: the drafts are made on the device during the step."""
        return cls(request, request.num_computed_tokens, 1 + num_draft, True, num_draft)

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


def is_head(row: ScheduledRow, drafting: bool) -> bool:
    """Does the row lead a mixed step: a window (empty ones too) in a drafting step, a row of
    one token that samples in a plain one?"""
    if drafting:
        return bool(row.num_draft or row.empty_window)
    return row.num_tokens == 1 and row.do_sample


@dataclass(frozen=True)
class StepPlan:
    rows: tuple[ScheduledRow, ...]
    num_preempted: int = 0
    # every row one token that samples (no windows, no prefill): a decode graph's step
    is_decode: bool = False
    # (G, V) of the trimmed cell the drafting policy chose for this step's windows (their
    # verify lengths are then chosen on the device, spec/ragged.py); None: the full block
    trimmed_cell: tuple[int, int] | None = None
    # the rows whose requests have structured output (a grammar masks what they sample and
    # verify: dspark/structured/); () in a step without any, which therefore does no such work
    grammar_rows: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows)

    @property
    def is_empty(self) -> bool:
        return not self.rows


class SampledTokens(NamedTuple):
    """What one row emitted this step: one token, or accepted drafts + a recovered/bonus one."""

    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...] | None = None
    num_draft: int | None = None  # drafts its window verified, where fewer than planned


@dataclass
class InFlightStep:
    """A launched step: its plan and the host copies of its results, valid once `done`."""

    plan: StepPlan
    plain: list[int]  # plan rows that sampled one token, in the order of `tokens`
    tokens: torch.Tensor | None = None  # [len(plain)]
    logprobs: tuple[torch.Tensor, ...] | None = None
    window_rows: list[int] | None = None  # plan rows with a window, in verification order
    verify_len: list[int] | None = None
    verified: tuple[torch.Tensor, torch.Tensor] | None = None  # emitted tokens, num accepted
    device_verify_len: torch.Tensor | None = None  # [R] chosen on the device: a trimmed
    #   cell's, or lowered for continuations near their requests' ends
    confidence: torch.Tensor | None = None  # [R, K] raw confidence logits (for observers)
    survivals: torch.Tensor | None = None  # [R, K] calibrated (SpecStepOutput.survivals)
    window_logprobs: tuple[torch.Tensor, ...] | None = None
    # prompt_logprobs: (plan row, first position, count) per scored chunk, and the host copies
    # of the scored tokens' (logprob of the next prompt token, top ids, top logprobs)
    prompt_scored: tuple[tuple[int, int, int], ...] = ()
    prompt_logprobs: tuple[torch.Tensor, ...] | None = None
    is_uniform: bool = False  # all rows windows laid out K + 1 wide: a step may launch behind it
    windows_first: bool = False  # its windows K + 1 wide in rows 0..n-1, a tail after or not
    sampled_serials: np.ndarray | None = None  # [len(plain)] the requests of `tokens`
    done: torch.cuda.Event | None = None  # None on the CPU: the results are ready at once
    # a step launched up to verification (runner/spec_runner.py's
    # AwaitingHost), until ModelRunner.verify_awaiting; None otherwise
    awaiting: Any = None
