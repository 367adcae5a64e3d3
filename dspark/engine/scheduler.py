"""Continuous batching: which requests run this step, with how many tokens, in which pages.

`schedule()` returns a frozen StepPlan; `advance()` moves the plan's rows forward before the
step runs (each row that samples gets a PENDING_TOKEN placeholder); `update()` writes the
sampled values over the placeholders and applies stops. These are the only places that mutate
requests and KV pages. Between advance and update nothing depends on a token's value, which is
what lets the engine schedule step N+1 before step N's tokens reach the host (async
scheduling): a request whose pending token turns out to be a stop has one wasted row in N+1,
whose output is dropped.

Policy (vLLM-style, one token budget per step):
1. running requests first, in admission order: a decoding request takes 1 token, one still
   prefilling takes the rest of its prompt up to the remaining budget (chunked prefill);
2. then waiting requests in arrival order (preempted ones at the front), while the budget,
   max_num_seqs and free pages allow; a request that does not fit stops admission (FIFO).
When a running request needs a page and none is free, the most recently admitted running
request is preempted: its pages are freed and it will recompute its prompt + outputs later.
With prefix caching (engine/prefix_cache.py) a request is admitted on the cached pages of its
longest cached prefix, its first chunk starting after them, and its own pages are published
as they become final (advance() for prefill chunks, update() for sampled tokens); a
preempted request's re-admission finds its own published pages if they were not evicted.

A drafting step that also admits or prefills (a mixed step) keeps its graph when the runner has
captured mixed speculative steps (`mixed_limits`: at most R tail rows of at most P tokens in
all after the windows). The scheduler then caps the prefill it adds after the first window at
those limits (the rest of a prompt follows in later steps, chunked prefill), and puts the rows
windows first, the tail (prefill chunks, plain rows) after: the layout the runner replays.
A plain step does the same with its decode rows as the head when the runner has captured mixed
decode steps (`decode_mixed_limits`).
update() does not depend on the rows' order. A burst (more requests waiting for a free seat than
a threshold that grows with the running rows) is admitted uncapped, in one eager step: capped,
most of it would wait for seats it could have for many steps, which costs more than one step's
host time (the threshold, its measurement and its A/B knob: engine/burst.py).

Speculative steps scheduled ahead, while the step before is in flight (async scheduling of
drafting steps, mixed steps among them): when they may be, and what their rows are, is
engine/ahead.py's (functions over the scheduler's queues, limits and window rules).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

from dspark.engine.ahead import ahead_blocker, continuing_most
from dspark.engine.burst import burst_threshold
from dspark.engine.kv_cache import PageAllocator
from dspark.engine.prefix_cache import PrefixCache
from dspark.request import PENDING_TOKEN, FinishReason, Request, RequestStatus
from dspark.sample.logits_shaping import has_multi_token_bad_words
from dspark.step_plan import SampledTokens, ScheduledRow, StepPlan, is_head, new_tuple, pages_for

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        allocator: PageAllocator,
        page_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        draft_len: int = 0,  # drafted slots per block (0: no speculation)
        max_verify: int | None = None,  # K: drafts verified per window (default draft_len)
        # (tail rows, tail tokens) a drafting step may carry after its windows, and a plain
        # step after its decode rows, and keep its graph (the runner's captured mixed steps);
        # None: no cap
        mixed_limits: tuple[int, int] | None = None,
        decode_mixed_limits: tuple[int, int] | None = None,
        prefix_cache: PrefixCache | None = None,  # None: prefix caching off
    ) -> None:
        self.allocator = allocator
        self.prefix_cache = prefix_cache
        self.draft_len = draft_len
        self.max_verify = draft_len if max_verify is None else max_verify
        # False: the next schedule() gives no request a window (the drafting policy's choice)
        self.drafting = True
        # the drafting policy's trimmed cell (G, V) for the next schedule()'s windows, or None
        self.trimmed_cell: tuple[int, int] | None = None
        # totals since start (the stats line reads their increments)
        self.num_prompt_tokens_computed = 0  # prompt tokens prefilled (again after preemption)
        self.num_generated_tokens = 0  # output tokens emitted
        # windows put off by a step scheduled ahead, until the in-flight count is known
        self.num_windows_deferred = 0
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.mixed_limits = mixed_limits
        self.decode_mixed_limits = decode_mixed_limits
        # first windows put off because the request's first token is in flight (ahead.py)
        self.num_first_windows_deferred = 0
        # unfinished requests with structured output: while 0, no step looks for grammar rows
        self.num_structured = 0
        # running requests that sample (temperature > 0): the drafting policy prices a step by
        # the sampled cells while any runs (kept here: counting them costs a pass over 256
        # requests a step)
        self.num_sampling = 0
        # told of each request that joins the running set (True) or leaves it (False): the
        # drafting policy keeps its survival sum by them (policy/survival.py RunningSums)
        self.on_running: Callable[[str, bool], None] | None = None
        # whether the last schedule() admitted a request or carried a prefill chunk (the
        # drafting policy prices such steps apart: policy/realised_costs.py)
        self.prefilled = False
        # requests ended at a token their grammar does not allow (update(): masking should
        # make it impossible; logged with the matcher's reason)
        self.num_grammar_errors = 0

    def add(self, request: Request) -> None:
        max_tokens = request.sampling_params.max_tokens
        request.max_num_tokens = self.max_model_len
        if max_tokens is not None:
            request.max_num_tokens = min(self.max_model_len, request.num_prompt_tokens + max_tokens)
        self.num_structured += request.grammar is not None
        self.waiting.append(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- schedule -------------------------------------------------------------------------

    def schedule(self, anchors_in_flight: bool = False) -> StepPlan:
        """The next step's rows. anchors_in_flight: the engine schedules behind a plain step
        in flight, so a request whose last token that step samples gets its window now, the
        anchor taken on the device (else, behind a mixed step, it waits a step: ahead.py)."""
        budget = self.max_num_batched_tokens
        rows: list[ScheduledRow] = []
        preempted_before = self.num_preemptions
        page_size, running = self.page_size, RequestStatus.RUNNING
        is_decode = True  # every row so far one token that samples
        prefilled = False  # a row so far admits or prefills
        # a mixed step: its head (windows in a drafting step, decode rows in a plain one),
        # then a tail of the other rows (prefill chunks; plain decode rows beside windows)
        drafting = bool(self.draft_len) and self.drafting
        limits = self.mixed_limits if drafting else self.decode_mixed_limits
        has_head = reorder = False  # reorder: some head row follows a tail row
        num_tail, tail_rows_left, tail_tokens_left = 0, *(limits or (0, 0))
        capped = limits is not None and not self.is_burst(limits)
        for req in list(self.running):
            if req.status is not running:  # preempted by an earlier row this step
                continue
            if req.num_windows_in_flight:  # scheduled ahead: ahead_blocker() found no obstacle
                most = continuing_most(self, req)
                # (pages checked inline, as for the common decode row below: most requests
                # own the pages for their next window already)
                if most is not None and (
                    -(-(most + self.draft_len) // page_size) <= len(req.page_ids)
                    or self._reserve(req, most + self.draft_len, preempt=False)
                ):
                    num_draft = min(self.max_verify, budget - 1)
                    # a continuation (built as the decode row below): a window behind the
                    # in-flight one, whose anchor lands 1 .. max_verify + 1 positions on;
                    # start is the furthest
                    start = req.num_computed_tokens + 1 + self.max_verify
                    rows.append(new_tuple(ScheduledRow, (req, start, 1 + num_draft, True,
                                                        num_draft, True, False)))  # fmt: skip
                    budget -= 1 + num_draft
                    is_decode, has_head, reorder = False, True, reorder or num_tail > 0
                else:
                    self.num_windows_deferred += 1
                continue
            tokens = req.token_ids
            num_tokens = len(tokens)
            if tokens[-1] == PENDING_TOKEN and num_tokens >= req.max_num_tokens:
                continue  # its pending token is its last: it ends once the value arrives
            if drafting and tokens[-1] == PENDING_TOKEN and not anchors_in_flight:
                self.num_first_windows_deferred += 1  # behind a mixed step (engine/ahead.py)
                continue
            num_draft = self.num_draft(req, budget) if drafting else 0
            if num_draft > 0:  # the drafter block writes K slots from the anchor on
                if self._reserve(req, req.num_computed_tokens + 1 + self.draft_len, preempt=True):
                    rows.append(ScheduledRow.window(req, num_draft))
                    budget -= 1 + num_draft
                    is_decode, has_head, reorder = False, True, reorder or num_tail > 0
                continue
            # the common row, a decode token, runs this loop hundreds of times per step: the
            # page check is inlined (a request owning the pages it needs skips _reserve), and
            # the row is built by new_tuple (ScheduledRow's generated __new__ is a Python
            # call; the fields are those of ScheduledRow(req, start, 1, True))
            start = req.num_computed_tokens
            if num_tokens - start == 1 and budget:
                if start // page_size < len(req.page_ids) or self._reserve(req, num_tokens, True):
                    empty = drafting and self.empty_window(req)
                    rows.append(new_tuple(ScheduledRow, (req, start, 1, True, 0, False, empty)))
                    budget -= 1
                    if not drafting:  # a decode row: the head of a mixed decode step
                        if limits is not None:  # (no mixed decode graphs: order as it came)
                            has_head, reorder = True, reorder or num_tail > 0
                    elif not empty:  # a plain row beside windows: the tail
                        num_tail += 1
                continue
            assert num_tokens > start, f"request {req.request_id} has no token left to compute"
            n = min(num_tokens - start, budget)
            if has_head and capped:  # a prefill chunk after windows: the tail's
                n = min(n, tail_tokens_left) if num_tail < tail_rows_left else 0
            if n == 0:
                continue
            has_pages = -(-(start + n) // page_size) <= len(req.page_ids)
            if not has_pages and not self._reserve(req, start + n, preempt=True):
                continue
            rows.append(ScheduledRow(req, start, n, start + n == num_tokens))
            budget -= n
            is_decode = is_decode and n == 1 and start + n == num_tokens
            prefilled = True
            num_tail += 1
            tail_tokens_left -= n
        cache = self.prefix_cache
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]  # (its num_computed_tokens is 0: it holds no page)
            hit = cache.match(req) if cache is not None else []
            start = len(hit) * page_size  # its first chunk starts after its cached pages
            n = min(req.num_tokens - start, budget)
            if has_head and capped:  # admitted into the tail of a mixed step
                n = min(n, tail_tokens_left) if num_tail < tail_rows_left else 0
                if n == 0:
                    break
            if cache is not None:
                if not cache.admit(req, hit, start + n):
                    break
            elif not self._reserve(req, start + n, preempt=False):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            if req.scheduled_time is None:  # (a preempted request's queue time ended before)
                req.scheduled_time = time.monotonic()
            self.running.append(req)
            self.num_sampling += req.sampling_params.temperature > 0
            if self.on_running is not None:
                self.on_running(req.request_id, True)
            prefilled = True
            row = ScheduledRow.of(req, n)
            rows.append(row)
            budget -= n
            is_decode = is_decode and n == 1 and row.do_sample
            num_tail += 1
            tail_tokens_left -= n
        if reorder:  # the head, then the tail: the mixed step's layout (stable)
            head = [is_head(r, drafting) for r in rows]
            rows = [r for r, h in zip(rows, head, strict=True) if h] + [
                r for r, h in zip(rows, head, strict=True) if not h
            ]
        self.prefilled = prefilled
        trimmed = self.trimmed_cell if drafting else None
        grammar_rows = ()
        if self.num_structured:
            grammar_rows = tuple(i for i, r in enumerate(rows) if r.request.grammar is not None)
        return StepPlan(tuple(rows), self.num_preemptions - preempted_before, is_decode, trimmed,
                        grammar_rows)  # fmt: skip

    def ahead_blocker(self, max_rows: int) -> str | None:
        """Why the next step may not be scheduled while the in-flight step's windows are
        unresolved; None: nothing (engine/ahead.py)."""
        return ahead_blocker(self, max_rows)

    def is_burst(self, limits: tuple[int, int]) -> bool:
        """More requests wait for a free seat than burst_threshold (
        else 4 sqrt(running rows), at least the mixed step's tail rows)."""
        seats = self.max_num_seqs - len(self.running)
        threshold = burst_threshold(len(self.running), limits[0])
        return min(len(self.waiting), seats) > threshold

    def empty_window(self, req: Request) -> bool:
        """Is req's next row (a plain decode row) its last token, of a drafting request, with
        the anchor on the host and the window's K + 1 positions inside max_model_len? Then the
        runner may lay it out as an empty window among the windows of a uniform step."""
        return (
            req.num_tokens + 1 == req.max_num_tokens
            and req.num_tokens + self.draft_len <= self.max_model_len
            and req.token_ids[-1] != PENDING_TOKEN
            and req.num_tokens - req.num_computed_tokens == 1
            and self.is_windowed(req)
        )

    def is_windowed(self, req: Request) -> bool:
        """Does req get a window when it decodes (drafting on, not opted out, past min_tokens,
        no bad word of several tokens: sample/logits_shaping.py)?"""
        sp = req.sampling_params
        return (self.drafting and sp.use_speculation and req.num_output_tokens >= sp.min_tokens
                and not has_multi_token_bad_words(req))  # fmt: skip

    def num_draft(self, req: Request, budget: int, num_tokens: int | None = None) -> int:
        """Fixed-K speculation: how many drafts a decoding request verifies (0: no window).

        Shortened so the step can never emit past max_tokens or max_model_len (a window of l
        drafts emits up to l + 1 tokens); requests that opted out, or that are still under
        their min_tokens (whose EOS ban runs on plain steps), get 0. `num_tokens`: the
        request's tokens when the window runs (its anchor is the last); default its tokens now.
        """
        if num_tokens is None:
            if req.num_tokens - req.num_computed_tokens != 1:
                return 0  # not decoding
            num_tokens = req.num_tokens
        if self.draft_len == 0 or not self.is_windowed(req):
            return 0  # (the min_tokens ban runs on plain steps)
        if num_tokens + self.draft_len > self.max_model_len:
            return 0  # the drafter block (K slots from the anchor) would run past the page table
        room = self.max_model_len - num_tokens - 1
        if req.sampling_params.max_tokens is not None:
            num_output = num_tokens - req.num_prompt_tokens
            room = min(room, req.sampling_params.max_tokens - num_output - 1)
        return max(0, min(self.max_verify, room, budget - 1))

    def _reserve(self, req: Request, num_tokens: int, preempt: bool) -> bool:
        """Make req own enough pages for num_tokens, preempting newer requests if allowed."""
        need = pages_for(num_tokens, self.page_size) - len(req.page_ids)
        while need > self.allocator.num_free:
            if not preempt:
                return False
            victim = self.running[-1]
            self._preempt(victim)
            if victim is req:
                return False
        if need > 0:
            req.page_ids.extend(self.allocator.allocate(need))
        return True

    def _preempt(self, req: Request) -> None:
        # recomputation: drop the KV, keep the tokens; the request re-prefills prompt + outputs
        self.running.remove(req)
        self.num_sampling -= req.sampling_params.temperature > 0
        if self.on_running is not None:
            self.on_running(req.request_id, False)
        self.allocator.free(req.page_ids)
        req.page_ids = []
        req.num_computed_tokens = req.num_published_pages = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # ---- advance and update ---------------------------------------------------------------

    def advance(self, plan: StepPlan) -> None:
        """Count the plan's work as done before it runs: KV lengths move to the rows' ends and
        each plain row that samples appends a placeholder for its token (at index row.end).

        Window rows [anchor, drafts] emit a number of tokens only verification knows; they
        advance in update() and are counted in flight until then.
        """
        cache, page_size = self.prefix_cache, self.page_size
        for req, start, num_tokens, do_sample, num_draft, _, _ in plan.rows:
            if num_draft:
                req.num_windows_in_flight += 1
                continue
            end = start + num_tokens
            num_prompt = len(req.prompt_token_ids)
            if start < num_prompt:  # a prefill chunk
                self.num_prompt_tokens_computed += min(end, num_prompt) - start
            req.num_computed_tokens = end
            if cache is not None and end >= (req.num_published_pages + 1) * page_size:
                cache.publish(req)  # (its pages' K/V is written by the step about to launch)
            if do_sample:
                req.token_ids.append(PENDING_TOKEN)

    def update(
        self, plan: StepPlan, sampled: list[SampledTokens | None]
    ) -> list[tuple[Request, int, int]]:
        """Apply a finished step; returns (request, index of its first new token, count) for
        every row that emitted.

        A plain row's token replaces the placeholder at index row.end; a window row [anchor,
        drafts] that emitted n tokens has the anchor and n - 1 accepted drafts in the KV cache
        now (anchor position + n) and appends its tokens. Its anchor is the request's last token
        here (for a continuation too: the in-flight window before it was applied first).
        Stops are judged by each token's index, not by the list's length, which may already
        hold the next step's placeholder; tokens after a stop (accepted drafts, a placeholder)
        are dropped. Requests that finished meanwhile
        (aborted, stopped at an earlier step) are skipped; preempted ones still get their token.
        A request with structured output first advances its grammar over the tokens it emitted
        (the only place a grammar moves): one that completes the grammar ends there, "stop",
        the tokens after it dropped (a window's recovered or bonus token after the completing
        draft), as plain decoding would end it.
        """
        emitted = []
        finished, running, num_generated = RequestStatus.FINISHED, RequestStatus.RUNNING, 0
        cache, page_size = self.prefix_cache, self.page_size
        structured = bool(plan.grammar_rows)
        for row, out in zip(plan.rows, sampled, strict=True):
            req, start, num_tokens, _, num_draft, is_continuation, _ = row  # (unpacked: per row)
            if num_draft:
                req.num_windows_in_flight -= 1
            if out is None or req.status is finished:
                continue
            # (tokens kept, why it ends) when its grammar ends the request in these tokens
            grammar_end = None
            if structured and req.grammar is not None:
                grammar_end = self._grammar_end(req, out.token_ids)
            # its new tokens may complete a page below num_computed_tokens (a decode row's
            # token is the next row's input, advanced already; a window's accepted drafts):
            # published after they are written, before a stop among them frees the pages
            if num_draft:
                first = len(req.token_ids)  # one past the anchor
                assert is_continuation or first - 1 == start, (req.request_id, first)
                if req.status is running:  # (preempted: its KV is recomputed)
                    req.num_computed_tokens = first - 1 + len(out.token_ids)
                req.token_ids.extend(out.token_ids)
                if cache is not None and req.status is running:
                    if req.num_computed_tokens >= (req.num_published_pages + 1) * page_size:
                        cache.publish(req)
                # a window emits its accepted drafts and one recovered-or-bonus token (the
                # device may have verified fewer drafts than planned: out.num_draft)
                verified = num_draft if out.num_draft is None else out.num_draft
                req.num_drafts += 1 if verified else 0
                req.num_draft_tokens += verified
                count = len(out.token_ids)
                req.num_accepted_tokens += count - 1
                # as the common plain row below: a window whose tokens cannot stop it (no stop
                # id among them, all short of its length) needs none of the per-token checks
                stop_ids = req.sampling_params.stop_token_ids
                if (
                    out.logprobs is None
                    and first + count < req.max_num_tokens
                    and req.eos_token_id not in out.token_ids
                    and not (stop_ids and any(t in stop_ids for t in out.token_ids))
                    and grammar_end is None
                ):
                    emitted.append((req, first, count))
                    num_generated += count
                    continue
            else:
                first = start + num_tokens
                assert req.token_ids[first] == PENDING_TOKEN, (req.request_id, first)
                (token_id,) = out.token_ids
                req.token_ids[first] = token_id
                if cache is not None and req.status is running:
                    if req.num_computed_tokens >= (req.num_published_pages + 1) * page_size:
                        cache.publish(req)
                # the common row: one token that cannot stop it (no stop id, short of its
                # length; only a stop id can be banned by min_tokens) needs none of the checks
                if (
                    out.logprobs is None
                    and first + 1 < req.max_num_tokens
                    and token_id != req.eos_token_id
                    and token_id not in req.sampling_params.stop_token_ids
                    and grammar_end is None
                ):
                    emitted.append((req, first, 1))
                    num_generated += 1
                    continue
            count = len(out.token_ids)
            if out.logprobs is not None:
                req.logprobs.extend(out.logprobs)
            for i, token_id in enumerate(out.token_ids):
                # a token after its grammar completed, or one it does not allow, is not kept
                reason = None if grammar_end is None or i < grammar_end[0] else grammar_end[1]
                if reason is not None:
                    count = i
                    del req.token_ids[first + count :]
                    del req.logprobs[req.num_output_tokens :]
                    self.finish(req, reason, None)
                    break
                reason = self._token_stop(req, token_id, first + i)
                if reason is not None:
                    count = i + 1
                    del req.token_ids[first + count :]
                    del req.logprobs[req.num_output_tokens :]
                    self.finish(req, *reason)
                    break
            else:
                if grammar_end is not None:  # the grammar completed on its last token
                    self.finish(req, grammar_end[1], None)
            emitted.append((req, first, count))
            num_generated += count
        self.num_generated_tokens += num_generated
        return emitted

    def _grammar_end(
        self, req: Request, tokens: tuple[int, ...]
    ) -> tuple[int, FinishReason] | None:
        """Advance req's grammar over its emitted tokens (structured/matcher.py): None while
        it goes on, else (the tokens req keeps, why it ends): STOP once the grammar is complete
        (it admits nothing more; vLLM's finish reason "stop"), ABORT at a token it does not
        allow, which masking rules out (logged and counted: the request cannot go on)."""
        grammar = req.grammar
        kept = grammar.advance(tokens)
        if not grammar.is_stopped:
            return None
        error = grammar.error
        if not error:
            return kept, FinishReason.STOP
        self.num_grammar_errors += 1
        logger.error("request %s: token %d breaks its structured output grammar, so it is "
                     "aborted: %s", req.request_id, tokens[kept],
                     error.splitlines()[0][:300])  # fmt: skip
        return kept, FinishReason.ABORT

    def _token_stop(
        self, req: Request, token_id: int, index: int
    ) -> tuple[FinishReason, int | None] | None:
        """Does the token at `index` of req.token_ids end the request?"""
        sp = req.sampling_params
        num_output = index + 1 - req.num_prompt_tokens  # outputs up to and including it
        if num_output >= sp.min_tokens:
            if not sp.ignore_eos and token_id == req.eos_token_id:
                return FinishReason.STOP, None
            if token_id in sp.stop_token_ids:
                return FinishReason.STOP, token_id
        if sp.max_tokens is not None and num_output >= sp.max_tokens:
            return FinishReason.LENGTH, None
        if index + 1 >= self.max_model_len:
            return FinishReason.LENGTH, None
        return None

    def finish(self, req: Request, reason: FinishReason, stop_reason: int | str | None) -> None:
        """End a request (stop, length, abort) wherever it is and free its pages."""
        if req.is_finished:
            return
        self.num_structured -= req.grammar is not None
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
            self.num_sampling -= req.sampling_params.temperature > 0
            if self.on_running is not None:
                self.on_running(req.request_id, False)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.allocator.free(req.page_ids)
        req.page_ids = []
        req.status = RequestStatus.FINISHED
        req.finished_time = time.monotonic()
        req.finish_reason = reason
        req.stop_reason = stop_reason
