"""Speculative steps scheduled ahead (async scheduling of drafting steps): a window row emits a
number of tokens only verification knows, so between advance and update its request has
`num_windows_in_flight` = 1 and its token_ids and num_computed_tokens stop at the window's
anchor. The engine schedules step N+1 while N's windows are in flight only when
`ahead_blocker()` finds nothing in the way; then every row of N+1 is a full window (what the
synchronous engine would give it, so outputs do not change), either
  - a continuation (`ScheduledRow.is_continuation`): its anchor is the last token its window in
    N emits, at a position only the device knows; pages are reserved for the most N can emit, or
  - a request with no window in flight, its anchor on the host as usual.
N is updated before N+1, so update() of a continuation reads where the request stands then.

Mixed steps in the pipeline: a step of windows scheduled ahead may also admit waiting requests
into a captured mixed step's tail, or carry there the next chunk of a prompt chunked over
steps (prompt tokens are on the host), and a mixed step may have a step scheduled behind it.
There, a request whose prefill the tail completed has its first token in flight (a
PENDING_TOKEN with no window): it gets no row (deferred), and its first window one step later,
the window the synchronous engine gives it. That step's lag behind the other requests can move
where the KV pages run out among them: when they do, the preemptions, and so the windows after
a recomputed prefill, may differ from the synchronous engine's; the tokens do not
(tests/spec/test_async_drafting_steps.py, "preemption"). Why mixed steps join the pipeline:
otherwise each arrival finishes the step in flight and the mixed step itself before the next is
scheduled, two host turns with the GPU idle (on an H100 at 64 requests a drafting step with
arrivals then took 4.4 ms where a steady one took 2.2).
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from dspark.request import PENDING_TOKEN, Request
from dspark.step_plan import pages_for


class FreePages(Protocol):
    num_free: int


class SchedulerView(Protocol):
    """What these rules read of the scheduler (engine/scheduler.py): its queues and limits, and
    the per-request window rules it applies itself, so that a step scheduled ahead gives each
    request the window the synchronous engine would."""

    waiting: deque[Request]
    running: list[Request]
    allocator: FreePages
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    page_size: int
    draft_len: int
    max_verify: int
    drafting: bool
    mixed_limits: tuple[int, int] | None

    def is_windowed(self, req: Request) -> bool: ...

    def num_draft(self, req: Request, budget: int, num_tokens: int | None = None) -> int: ...

    def empty_window(self, req: Request) -> bool: ...

    def is_burst(self, limits: tuple[int, int]) -> bool: ...


def ahead_blocker(s: SchedulerView, max_rows: int) -> str | None:
    """Why the next step may not be scheduled while the in-flight step's windows are
    unresolved (None: nothing; max_rows: the most windows one step can lay out).

    Scheduled ahead, every row is a window the synchronous engine would give its request
    too, or a prefill chunk in a mixed step's captured tail (a waiting request's, or the next
    of a prompt chunked over steps, after a window; a request that stops in the in-flight
    step frees its seat one step later than it would synchronously), no plain row, a token
    budget no window can exhaust, and the pages for the most every request can reach free
    now (preempting on a worst-case guess would preempt where the synchronous engine does
    not). A request in flight whose next window max_tokens or max_model_len shortens,
    depending on what the in-flight one emits, gets it shortened on the device. One whose
    in-flight window could emit its last token, or whose drafter block could run past
    max_model_len, is deferred: it gets that window one step later, once its count is
    known (its windows, so its tokens, are the same; only their step changes).
    """
    admissible = bool(s.waiting) and len(s.running) < s.max_num_seqs
    if admissible and not _admits_ahead(s):
        return "waiting_requests"
    if len(s.running) > max_rows:
        return "too_many_rows"
    if len(s.running) * (1 + s.max_verify) > s.max_num_batched_tokens:
        return "token_budget"
    pages = rows = 0  # rows: the requests with a window in the next step
    tail_tokens = s.mixed_limits[1] if s.mixed_limits is not None else 0
    head = chunked = False  # head: a window so far; chunked: a prompt chunk joins the tail
    for req in s.running:
        if not req.num_windows_in_flight and req.is_prefilling:
            # a prompt chunked over steps: its next chunk joins the tail as an admission
            # would, if a window comes before it (Scheduler.schedule caps a chunk after the
            # head to the tail's limits; before it, the chunk would run uncapped)
            if not head or not _admits_ahead(s):
                return "plain_rows"
            pages += pages_for(min(req.num_tokens, req.num_computed_tokens + tail_tokens),
                               s.page_size) - len(req.page_ids)  # fmt: skip
            chunked = True
            continue
        if req.num_windows_in_flight:
            most = continuing_most(s, req)
            if most is None:
                continue  # deferred
        else:
            most = len(req.token_ids)  # (no window in flight: its anchor is its last token)
        if not req.num_windows_in_flight and req.token_ids[-1] == PENDING_TOKEN:
            if req.num_tokens >= req.max_num_tokens:
                continue  # its pending token is its last: no row
            if s.is_windowed(req):
                continue  # its first token in flight: deferred (module docstring)
            return "plain_rows"
        most += s.draft_len  # + the drafter block
        rows += 1
        if not req.num_windows_in_flight and s.num_draft(req, s.max_verify + 1) == 0:
            if not s.empty_window(req):
                return "plain_rows"
            most = req.num_tokens  # its anchor's slot
        else:
            head = True
        pages += pages_for(most, s.page_size) - len(req.page_ids)
    if admissible and not rows:
        return "waiting_requests"  # no window to put an admission's tail behind
    # (windows after a chunk in the running order draw on the budget the chunk leaves)
    if chunked and len(s.running) * (1 + s.max_verify) + tail_tokens > s.max_num_batched_tokens:
        return "token_budget"
    return "kv_pages" if pages > s.allocator.num_free else None


def _admits_ahead(s: SchedulerView) -> bool:
    """May a step scheduled ahead admit the waiting requests? Only into a captured mixed
    step's capped tail (not a burst, which runs uncapped and eagerly)."""
    limits = s.mixed_limits
    return limits is not None and not s.is_burst(limits)


def continuing_most(s: SchedulerView, req: Request) -> int | None:
    """The most tokens the in-flight req can have when its next window runs (one anchor
    past all that its in-flight window can emit), if it can have that window now, whatever
    the in-flight one emits; None: deferred.

    The window is staged at full length; near the request's end the device shortens it to
    what max_tokens and max_model_len allow, as Scheduler.num_draft would
    (runner/continuations.py). So it needs a window at all (Scheduler.is_windowed), a token left
    after the most its in-flight windows can emit (else the window could come after its
    last token: a step of a dead row), and the drafter block's K slots from the furthest
    anchor inside max_model_len.

    (One call per row where the ahead check and schedule each run over a few hundred rows
    a step: is_windowed is written out here.)
    """
    tokens, sp = req.token_ids, req.sampling_params
    most = len(tokens) + (1 + s.max_verify) * req.num_windows_in_flight
    if (
        s.drafting
        and sp.use_speculation
        and len(tokens) - len(req.prompt_token_ids) >= sp.min_tokens
        and most < req.max_num_tokens
        and most + s.draft_len <= s.max_model_len
    ):
        return most
    return None
