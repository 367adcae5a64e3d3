"""The engine process's side of the pipe: messages sent from a thread, step outputs merged while
the server is behind.

The step loop must not wait for the server. A send blocks once the pipe's buffer is full, that
is whenever the server's event loop (HTTP for hundreds of streams) reads slower than the engine
steps, and the engine would then step at the server's pace. So the loop only posts; a sender
thread sends. While a send is blocked, the steps posted meanwhile merge into one pending STEP
message, request by request, so a slow server gets fewer, larger deltas (less work per token
on its side) instead of a backlog:

    posted  step 1: a "He" [5]      step 2: a "llo" [7], b "Hi" [9]      step 3: a "!" [2] final
    sent    (STEP, [a "He" [5]])    (STEP, [a "llo!" [7, 2] final, b "Hi" [9]])   (if 2 and 3
                                                                                   met a busy pipe)

Order is kept: a control message (ADDED, FAILED, STOPPED) goes out after every output posted
before it, and a request id that finished in the pending message and comes back (ids may be
reused) starts a new message. Only the newest stats snapshot of a merged message is sent,
with the newest of each of its metrics parts.
Pickling happens on the sender thread; the write itself releases the interpreter lock.

Each message goes out in one write, its length header and its pickle together
(`send_whole`). multiprocessing's Connection.send writes a message over 16 KiB as two writes,
and between them the thread waits for the interpreter lock, which the step loop may hold for
the switch interval (5 ms): meanwhile the server, which reads a message whole in blocking mode
(engine_loop.py), sat in its read with its event loop stopped. (The server now reads whatever
bytes have arrived and never waits for the rest, so this only saves a write.)
"""

from __future__ import annotations

import logging
import os
import struct
import threading
from collections import deque
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler

from dspark.server import wire
from dspark.server.phase_times import PhaseTimes

logger = logging.getLogger(__name__)


class OutputSender:
    def __init__(self, conn: Connection, on_closed_exit: int | None) -> None:
        self._conn = conn
        # the process exits with it if the pipe closes; None: this sender stops, dropping what
        # is posted after (one API process of several is gone: engine_process.EngineServer)
        self._exit_status = on_closed_exit
        self.closed = False
        self._cond = threading.Condition()
        self._queue: deque[tuple] = deque()  # whole messages, in order
        self._pending: dict[str, list] = {}  # request id -> [text, token_ids, logprobs, final]
        # one step's outputs as posted, while nothing else is pending (post_step's usual case)
        self._step: list[tuple] | None = None
        self._stats: tuple | None = None
        self._busy = False  # a message is being sent
        self.num_steps_posted = self.num_step_messages = 0
        self.times = PhaseTimes()  # the thread's time: waiting, and pickling + sending
        threading.Thread(target=self._run, name="dspark-output-sender", daemon=True).start()

    def post_step(self, outputs: list[tuple], stats: tuple) -> None:
        """A step's wire outputs (wire.encode_outputs, not changed after) and the stats after
        it. While the sender keeps up, the list is kept as it came and sent as it is; only a
        step posted behind one still pending is merged, request by request. (On the
        development CPU, a step of 190 outputs: 36 -> 8 us to post, 36 -> 32 us to send,
        `bench/serving.py sender-cost`.)"""
        with self._cond:
            if self.closed:
                return
            if self._step is None and not self._pending:
                self._step = outputs
            else:
                if self._step is not None:  # the step still pending, merged from now on
                    step, self._step = self._step, None
                    self._merge(step)
                self._merge(outputs)
            if self._stats is not None:  # a merged step's metrics parts are kept
                stats = wire.kept_parts(stats, *self._stats[-2:])
            self._stats = stats
            self.num_steps_posted += 1
            self._cond.notify()

    def _merge(self, outputs: list[tuple]) -> None:
        """A step's outputs into the pending ones, request by request (the lock held)."""
        for request_id, text, token_ids, logprobs, final, *prompt_logprobs in outputs:
            entry = self._pending.get(request_id)
            if entry is not None and entry[3] is not None:  # a reused id after its final
                self._flush_locked()
                entry = None
            if entry is None:  # (prompt logprobs: only a final-only output's, its one output)
                entry = [text, list(token_ids), _list(logprobs), final, *prompt_logprobs]
                self._pending[request_id] = entry
                continue
            entry[0] += text
            entry[1] += token_ids
            if logprobs is not None:
                entry[2] = (entry[2] or []) + list(logprobs)
            entry[3] = final

    def send(self, message: tuple) -> None:
        """A control message, after every output posted before it."""
        with self._cond:
            if self.closed:
                return
            self._flush_locked()
            self._queue.append(message)
            self._cond.notify()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until everything posted has been sent; False on timeout."""
        with self._cond:
            return self._cond.wait_for(
                lambda: not (self._queue or self._pending or self._step is not None or self._busy),
                timeout,
            )

    def _flush_locked(self) -> None:
        if self._step is not None:
            self._queue.append((wire.STEP, self._step, self._stats))
            self._step, self._stats = None, None
            self.num_step_messages += 1
        elif self._pending or self._stats is not None:
            outputs = [(rid, *entry) for rid, entry in self._pending.items()]
            self._queue.append((wire.STEP, outputs, self._stats))
            self._pending, self._stats = {}, None
            self.num_step_messages += 1

    def _run(self) -> None:
        times = self.times
        while True:
            with self._cond:
                # (a step kept as posted comes with its stats: _stats covers it)
                self._cond.wait_for(lambda: self._queue or self._pending or self._stats)
                if not self._queue:
                    self._flush_locked()
                message = self._queue.popleft()
                self._busy = True
            times.lap("idle")
            try:
                send_whole(self._conn, message)
                times.lap("message")
            except (EOFError, OSError):  # the server closed the pipe: nobody is left to answer
                if self._exit_status is not None:
                    logger.warning("the server closed the pipe: the engine process exits")
                    os._exit(self._exit_status)
                with self._cond:  # one of several servers: stop sending to it
                    self.closed, self._busy = True, False
                    self._queue.clear()
                    self._pending, self._step, self._stats = {}, None, None
                    self._cond.notify_all()
                return
            with self._cond:
                self._busy = False
                self._cond.notify_all()


def send_whole(conn: Connection, message) -> None:
    """conn.send(message) in one write: the header Connection.recv reads ("!i", the pickle's
    length), then the pickle, concatenated (a partial write, rare on a blocking socket, is
    continued)."""
    payload = ForkingPickler.dumps(message)
    if len(payload) > 0x7FFFFFFF:  # Connection's own framing for 2 GiB and more
        conn.send_bytes(payload)
        return
    view = memoryview(b"".join((struct.pack("!i", len(payload)), payload)))
    fd = conn.fileno()
    while view:
        view = view[os.write(fd, view) :]


def _list(logprobs) -> list | None:
    return None if logprobs is None else list(logprobs)
