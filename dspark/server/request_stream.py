"""One HTTP request's view of its engine requests: outputs in, paced and coalesced updates out.

The engine reports what each request gained per step (DeltaOutput), so `put` appends it to the
choice's slot, and `updates()` yields {choice index: everything gained since the last update,
as one delta} whenever the slots hold something new. A consumer that falls behind therefore
gets several tokens per chunk instead of one chunk per step, and nothing is lost or repeated.

    put (0, "He")  put (1, "A")  put (0, "llo")     -> one update {0: "Hello", 1: "A"}

Pacing. Each chunk costs the event loop some 20-50 us of CPU, which with a few hundred streams
is the loop's whole time if every step made a chunk per stream (and, with the engine in the
server's process, time the engine's host loop waited for the interpreter lock). So a stream
sends at most one chunk per `StreamPacer.interval_s`,

    interval = open streams x loop CPU per chunk (moving average) / budget

    budget 0.1, 20 us per chunk:   1 stream -> 0.2 ms   (under a step: every token its chunk)
                                 256 streams -> 51 ms   (a chunk carries ~20 steps' tokens)

and chunks cost about `budget` of the loop's time whatever the load. Decoding a stream's tokens
(when the server decodes, `decoders`) is left out of the per-chunk cost: it is paid per token,
however the tokens are grouped. A stream's first output,
its final one and a failure are never held (TTFT and a stream's end are not delayed); an output
that arrives before its stream is due waits in the slot until the due time.

`close()` is the one exit path (normal end, client gone, server error): it asks the engine to
abort every choice that has not finished, so a disconnected client's pages are freed at the
engine's next iteration, and it ends a consumer waiting in `updates()`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

from dspark.engine.detokenizer import Detokenizer
from dspark.outputs import DeltaOutput

COST_WEIGHT = 0.05  # of the newest chunk in the moving average of the CPU per chunk


class EngineFailed:
    """Delivered in place of an output when the engine stopped serving the request."""

    finished = True  # like a final RequestOutput: nothing follows it

    def __init__(self, reason: str) -> None:
        self.reason = reason


Update = DeltaOutput | EngineFailed


def joined(updates: list[Update]) -> Update:
    """Consecutive updates of one choice as one: deltas concatenated, a failure kept."""
    if len(updates) == 1 or isinstance(updates[-1], EngineFailed):
        return updates[-1]
    first = updates[0]
    logprobs = None if first.logprobs is None else [lp for u in updates for lp in u.logprobs]
    return DeltaOutput(
        first.request_id,
        "".join(u.text for u in updates),
        [t for u in updates for t in u.token_ids],
        logprobs,
        updates[-1].final,
    )


class StreamPacer:
    """How often each open stream may send a chunk (see the module docstring).

    budget: the share of the event loop's time chunks may take; None sends every output as it
    comes.
    """

    def __init__(self, budget: float | None) -> None:
        assert budget is None or 0 < budget <= 1, f"budget must be in (0, 1], got {budget}"
        self.budget = budget
        self.num_streams = 0
        self.num_chunks = 0
        self.cpu_per_chunk_s = 0.0
        self.interval_s = 0.0

    def open(self) -> None:
        self.num_streams += 1
        self._update()

    def close(self) -> None:
        self.num_streams -= 1
        self._update()

    def record(self, cpu_s: float) -> None:
        """The loop CPU one chunk took, from the consumer taking an update to asking again
        (the first chunk starts the average)."""
        weight = COST_WEIGHT if self.num_chunks else 1.0
        self.cpu_per_chunk_s += weight * (cpu_s - self.cpu_per_chunk_s)
        self.num_chunks += 1
        self._update()

    def _update(self) -> None:
        if self.budget is not None:
            self.interval_s = self.num_streams * self.cpu_per_chunk_s / self.budget


class RequestStream:
    def __init__(
        self,
        request_ids: list[str],
        abort: Callable[[list[str]], None],
        pacer: StreamPacer | None = None,
        decoders: list[Detokenizer] | None = None,
    ) -> None:
        self.request_ids = request_ids
        # one per choice when the engine sends tokens only (output_kind "delta_tokens"): the
        # text of each update is decoded here, after coalescing (one decode per chunk)
        self._decoders = decoders
        self._num_chars = [0] * len(request_ids)  # of each decoder's text already sent
        self._abort = abort
        self._pacer = pacer
        self._gained: dict[int, list[Update]] = {}  # choice -> updates not yet taken
        self._has_last = False  # _gained holds a choice's last update: send it at once
        self._due = 0.0  # loop time before which other updates wait in _gained
        self._waiter: asyncio.Future | None = None  # set while updates() waits
        self._timer: asyncio.TimerHandle | None = None  # wakes the waiter at the due time
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ended: set[int] = set()  # choices whose final output (or failure) was taken
        self._closed = False
        # choice -> its prompt's logprobs (prompt_logprobs), delivered with its final output
        self.prompt_logprobs: dict[int, list[dict[int, float] | None]] = {}
        if pacer is not None:
            pacer.open()

    def put(self, index: int, update: Update, now: float) -> None:
        """Called on the event loop; `now` is the loop's time."""
        if self._closed:
            return
        gained = self._gained.get(index)
        if gained is None:
            self._gained[index] = [update]
        else:
            gained.append(update)
        if update.finished:
            self._has_last = True
        if self._waiter is None:
            return
        if self._has_last or now >= self._due:
            self._wake()
        elif self._timer is None:
            self._timer = self._loop.call_at(self._due, self._wake)

    @property
    def is_done(self) -> bool:
        return len(self._ended) == len(self.request_ids)

    async def updates(self) -> AsyncIterator[dict[int, Update]]:
        """Yield what each choice gained, at most once per pacing interval, until every choice
        has ended."""
        loop = self._loop = asyncio.get_running_loop()
        while not self.is_done:
            await self._ready(loop)
            if self._closed:  # (the client left: close() woke the wait)
                return
            gained, self._gained, self._has_last = self._gained, {}, False
            batch = {index: joined(updates) for index, updates in gained.items()}
            if self._decoders is not None:
                batch = {index: self._decoded(index, u) for index, u in batch.items()}
            self._ended.update(i for i, update in batch.items() if update.finished)
            # (the clock starts after decoding: its cost is per token, which no pacing saves;
            # counted per chunk, it would lengthen the interval, so each chunk would carry more
            # tokens and cost more, without end at a few hundred streams)
            start = time.thread_time()
            yield batch
            if self._pacer is not None:
                self._pacer.record(time.thread_time() - start)
                self._due = loop.time() + self._pacer.interval_s

    def _decoded(self, index: int, update: Update) -> Update:
        """The update with its text: what its tokens add to the choice's text (a character
        still incomplete waits for the next update; the last one flushes)."""
        if isinstance(update, EngineFailed):
            return update
        decoder = self._decoders[index]
        decoder.add_tokens(update.token_ids)
        if update.final is not None:
            decoder.flush()
        text = decoder.text
        new_text, self._num_chars[index] = text[self._num_chars[index] :], len(text)
        return update._replace(text=new_text)

    async def _ready(self, loop: asyncio.AbstractEventLoop) -> None:
        """Until the slots hold an update that may go now."""
        while not (self._gained and (self._has_last or loop.time() >= self._due)):
            if self._closed:
                return
            self._waiter = loop.create_future()
            if self._gained:  # held until due (put arms the timer for later arrivals)
                self._timer = loop.call_at(self._due, self._wake)
            try:
                await self._waiter
            finally:
                self._waiter = None
                if self._timer is not None:
                    self._timer.cancel()
                    self._timer = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def close(self) -> None:
        """Abort the choices still running (idempotent; a no-op once all have ended)."""
        if self._closed:
            return
        self._closed = True
        self._wake()  # a consumer waiting in updates() ends
        if self._pacer is not None:
            self._pacer.close()
        unfinished = [rid for i, rid in enumerate(self.request_ids) if i not in self._ended]
        if unfinished:
            self._abort(unfinished)
