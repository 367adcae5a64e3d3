"""The server's side of the engine process: commands out, outputs routed to their streams.

The engine runs in its own process (engine_process.py), so its step loop and the event loop's
HTTP work do not share an interpreter lock. Everything here runs on the event loop: `start`
spawns the engine process (or `attach` joins the one the main server spawned, for the workers
of `--api-server-count`, api_servers.py) and watches its end of the pipe with `add_reader` (no
thread: a message is read when the loop is free, and a thread handing the lock back and forth
would cost more than it saves); commands are sent on the loop too (small, and the engine
drains its pipe every step).

Reading never waits for a message in transit. poll() reports the pipe readable as soon as a
message's first bytes arrive, and a large one (READY carries the tokenizer, a step at C = 256
hundreds of deltas) arrives in parts. `Connection.recv` reads a message whole: in blocking mode
it waits for the rest with the event loop stopped, and in non-blocking mode it stopped
mid-message with BlockingIOError and lost the stream (which killed servers under uvloop, which
sets every watched fd non-blocking). So `_read`
takes whatever bytes are there, one os.read per poll() that says there are some, and
`wire.FrameReader` keeps a partial frame until its rest arrives. The fd itself stays blocking:
the commands are sent on it, and a send must not stop halfway.

`submit` registers a `RequestStream` per HTTP request before its add command is sent, so no
output can arrive unrouted; outputs are routed by request id until each request's final
output. (The request metrics are recorded in the engine process, where every request ends,
aborted ones included; a 503 answered here is sent there to be counted: `count_rejected`.)
A stream gathers what its choices gained and sends it when its pacing allows
(request_stream.py). With `decode_streams` (the server's default), a stream without stop
strings is sent to the engine as output_kind "delta_tokens": the engine reports its tokens
only and the stream decodes them, once per chunk. Decoding in the engine cost its step loop
one DecodeStream call per report (32 a step at 256 streams and stream interval 8: some 10% of
the step on the H200); a stop string still needs the
engine's decoding, to know which token completed it.

Admission control lives here: a submission is refused with 503 when the requests (or prompt
tokens) waiting for the scheduler, per the engine's latest stats, plus those sent but not yet
acknowledged, less the seats still free, would pass the configured limits. A group of
sub-requests (n choices, several prompts) is added atomically: the engine validates all before
it adds any.

Failures: a request the engine refuses (prompt too long, a token outside the vocabulary) fails
its submission with a 400, before any response starts. If the engine fails to load, a step
raises, or its process ends for any reason (killed, crashed), every open stream ends with
EngineFailed (finish_reason "error") and /health answers 503 with the reason. `stop` asks the
engine to abort what is left and waits for the process to exit (killing it if it does not).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from time import perf_counter

from dspark.engine.collector import steady_collector_for_good
from dspark.engine.detokenizer import Detokenizer
from dspark.models.tokenizer import import_backend
from dspark.sampling_params import SamplingParams
from dspark.server import wire
from dspark.server.engine_process import run_engine_process
from dspark.server.errors import APIError, bad_request
from dspark.server.gc_pauses import GCPauses
from dspark.server.loop_lag import LoopLag
from dspark.server.phase_times import PhaseTimes
from dspark.server.request_stream import EngineFailed, RequestStream, StreamPacer
from dspark.server.wire import (
    EngineInfo,
    EngineState,
    EngineStats,
    decode_output,
    merge_stats,
    prompt_logprobs_of,
)

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1
STOP_TIMEOUT_S = 30.0  # an engine that has not stopped by then is killed
EXIT_WAIT_S = 5.0  # how long a process whose pipe closed may take to report its exit status
READ_SIZE = 1 << 20  # bytes a read of the engine pipe takes at most
# the reader logs where its time went when nothing is in flight, once it has read this many
# messages since it last did (about one a step: a benchmark level, not each idle moment)
LOG_EVERY_MESSAGES = 500


@dataclass(frozen=True)
class SubRequest:
    """One engine request of an HTTP request (one prompt x one of its n choices)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    prompt_text: str | None = None


class EngineLoop:
    def __init__(
        self,
        engine_factory: Callable,
        max_queued_requests: int,
        max_queued_tokens: int,
        stream_budget: float | None = None,
        decode_streams: bool = False,
    ) -> None:
        self._factory = engine_factory  # called in the engine process: it must pickle
        self.pacer = StreamPacer(stream_budget)  # shared by the streaming requests
        # streams without stop strings decoded here, not in the engine's step loop
        self.decode_streams = decode_streams
        self.max_queued_requests = max_queued_requests
        self.max_queued_tokens = max_queued_tokens
        self.state = EngineState.LOADING
        self.failure: str | None = None  # why the engine died
        self.load_failure: str | None = None  # why it died before it ever served, if it did
        self.info: EngineInfo | None = None  # sent by the engine once built
        self.stats = EngineStats()
        self.process: multiprocessing.process.BaseProcess | None = None
        self._conn = None
        self._frames = wire.FrameReader()  # the engine's messages, from the bytes read
        self._routes: dict[str, tuple[RequestStream, int]] = {}  # request id -> (stream, index)
        self._pending: dict[int, tuple[asyncio.Future, tuple[SubRequest, ...], int]] = {}
        # the engine requests and prompt tokens of _pending, kept as it changes: admission
        # reads them per submission, and a wave of 256 simultaneous requests has up to 256
        # pending (summing them each time cost ~60 us a request on the development CPU)
        self._num_pending_requests = self._num_pending_tokens = 0
        self._ack_ids = itertools.count()
        self._stopped: asyncio.Future | None = None  # set when the engine process has ended
        self.is_draining = False  # shutting down: no new request; the open ones end by a deadline
        self._drain_timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.read_times = PhaseTimes()  # the pipe's messages: receiving, then routing each
        self.gc_pauses = GCPauses()  # the server process's collections, logged beside those
        self.loop_lag = LoopLag()  # how late the event loop runs, logged beside those too

    # ---- the engine process -----------------------------------------------------------------

    def start(self, other_servers: tuple[Connection, ...] = ()) -> None:
        """Spawn the engine process. `other_servers`: the engine's ends of the pipes of the
        other API processes (`dspark serve --api-server-count`), handed to it and closed here
        (so that each pipe closes when either of its two processes ends)."""
        self._loop = asyncio.get_running_loop()
        self._stopped = self._loop.create_future()
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        levels = (logging.getLogger().level, logging.getLogger("dspark").getEffectiveLevel())
        # (a factory whose engine starts processes: engine_process.EngineFactory)
        daemon = not getattr(self._factory, "starts_processes", False)
        self.process = context.Process(
            target=run_engine_process, args=(self._factory, (child_conn, *other_servers), levels),
            name="dspark-engine", daemon=daemon,
        )  # fmt: skip
        self.process.start()
        for conn in (child_conn, *other_servers):  # only the child holds them now
            conn.close()
        self._watch()

    def attach(self, conn: Connection) -> None:
        """Use an engine process another API process started (the main server's, for a
        worker of `--api-server-count`): `conn` is this process's pipe to it. Stopping
        detaches this process only; the engine ends with the main server."""
        self._loop = asyncio.get_running_loop()
        self._stopped = self._loop.create_future()
        self._conn = conn
        self._watch()

    def _watch(self) -> None:
        import_backend()  # now, while the engine loads, not on the loop at READY
        self._loop.add_reader(self._conn.fileno(), self._read)
        self.gc_pauses.install()
        self.loop_lag.start()

    def _read(self) -> None:
        """The bytes that have arrived, and every message they complete; the pipe's end is the
        process's end."""
        times = self.read_times
        times.restart()
        try:
            fd = self._conn.fileno()
            if not os.get_blocking(fd):  # set by the event loop (module docstring)
                os.set_blocking(fd, True)
            while self._conn.poll(0):  # (so the read below returns what is there at once)
                data = os.read(fd, READ_SIZE)
                if not data:
                    raise EOFError
                messages = self._frames.feed(data)
                times.lap("receive")
                for message in messages:
                    self._dispatch(message)
                    times.lap("message")
            if not self._routes and times.counts["message"] >= LOG_EVERY_MESSAGES:
                self._log_read_times()
        except (EOFError, OSError) as e:
            if not isinstance(e, EOFError):  # not the pipe's end: say what it was
                logger.error("reading the engine's pipe failed: %s: %s", type(e).__name__, e)
            self._loop.remove_reader(self._conn.fileno())
            asyncio.ensure_future(self._reap())

    def _log_read_times(self) -> None:
        """Where the reader's time went since it last said, with the collections meanwhile
        (the clocks start again)."""
        logger.info(
            "engine pipe, read by the server: %s; %s; %s",
            self.read_times.take().summary("message"), self.gc_pauses.take().summary(),
            self.loop_lag.take().summary(),
        )  # fmt: skip

    def _log_start_up(self, freeze_s: float) -> None:
        """The server loop's start-up, apart from what serving logs after it: the READY
        message (its receive time is the tokenizer's unpickling, on this loop), the collection
        and freeze after it, the collections and the loop's lag while the engine loaded. The
        clocks start again for serving."""
        reads = self.read_times.take()
        logger.info(
            "engine process %d ready: serving; the server's start-up: %d reads of the engine's "
            "pipe, %.0f ms in all; collect and freeze %.0f ms; %s; %s", self.info.pid,
            reads.counts["receive"], 1e3 * reads.seconds["receive"], 1e3 * freeze_s,
            self.gc_pauses.take().summary(), self.loop_lag.restart().summary(),
        )  # fmt: skip
        self.read_times.restart()  # (the READY message's routing lap, the freeze, not counted)

    def _dispatch(self, message: tuple) -> None:
        tag = message[0]
        if tag == wire.STEP:
            self._deliver(message[1], message[2])
        elif tag == wire.ADDED:
            self._acknowledge(message[1], message[2])
        elif tag == wire.READY:
            self.info = message[1]
            if self.state == EngineState.LOADING:
                self.state = EngineState.SERVING
            # what exists by now (the app, its routes, the tokenizer the engine sent) lives as
            # long as the server: frozen, full collections skip it, and young collections are
            # rarer (the engine process does the same; vLLM freezes its heap after start-up too)
            start = perf_counter()
            steady_collector_for_good()
            self._log_start_up(perf_counter() - start)
        elif tag == wire.FAILED:
            self._die(message[1])
        else:
            assert tag == wire.STOPPED, f"unknown message {tag!r}"
            if self.process is None and not self._stopped.done():  # attached: detached now
                self._stopped.set_result(None)

    async def _reap(self) -> None:
        """The engine process ended (its pipe closed): why, and every open stream ends with
        an error."""
        process = self.process
        if process is None:  # attached to another process's engine
            if self.state not in (EngineState.DEAD, EngineState.STOPPING):
                self._die("the engine process closed this server's pipe (it exited)")
            if not self._stopped.done():
                self._stopped.set_result(None)
            return
        await asyncio.to_thread(process.join, EXIT_WAIT_S)
        if self.state not in (EngineState.DEAD, EngineState.STOPPING):  # (stop() fails all)
            self._die(f"the engine process exited unexpectedly ({_exit_status(process)})")
        self._stopped.set_result(process.exitcode)

    def _send(self, message: tuple) -> None:
        try:
            self._conn.send(message)
        except (BrokenPipeError, OSError):  # the process is gone: _read will say so
            pass

    async def stop(self) -> None:
        """Abort whatever this server still runs, then wait for the engine process to exit
        (attached: for the engine to detach this server)."""
        if self._drain_timer is not None:
            self._drain_timer.cancel()
        if self._conn is None:
            return
        if self.state == EngineState.LOADING and self.process is not None:
            self.process.kill()  # loading: it would only read the stop once loaded
        elif self.state == EngineState.SERVING:
            self._send((wire.STOP,))
        if self.state in (EngineState.LOADING, EngineState.SERVING):
            self.state = EngineState.STOPPING
        try:
            await asyncio.wait_for(asyncio.shield(self._stopped), STOP_TIMEOUT_S)
        except TimeoutError:
            if self.process is not None:
                logger.error("the engine process did not stop in %.0f s: killed", STOP_TIMEOUT_S)
                self.process.kill()
                await self._stopped
            else:
                logger.error("the engine did not detach this server in %.0f s", STOP_TIMEOUT_S)
        if self.process is None:
            self._loop.remove_reader(self._conn.fileno())
        self._conn.close()
        if self.read_times.counts["message"]:
            self._log_read_times()
        self.gc_pauses.uninstall()
        self.loop_lag.stop()
        self._fail_all("the server shut down")

    # ---- requests -----------------------------------------------------------------------------

    @property
    def num_in_flight(self) -> int:
        """Engine requests the server still routes (running, waiting or being aborted)."""
        return len(self._routes)

    def drain(self, timeout_s: float) -> None:
        """Shutting down: refuse new requests, and abort the open ones still running in
        `timeout_s` (shutdown.py), so that each ends with its final output."""
        self.is_draining = True
        if self._loop is not None and self._drain_timer is None:
            self._drain_timer = self._loop.call_later(timeout_s, self._abort_all)

    def _abort_all(self) -> None:
        if self._routes:
            logger.warning("shutting down: aborting the %d request(s) still running",
                           len(self._routes))  # fmt: skip
            self.abort(list(self._routes))

    def check_serving(self) -> None:
        if self.state == EngineState.SERVING and not self.is_draining:
            return
        if self.state == EngineState.SERVING:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        if self.state == EngineState.LOADING:
            raise APIError(
                503,
                "the model is still loading; retry shortly",
                code="loading",
                retry_after_s=RETRY_AFTER_S,
            )
        reason = f": {self.failure}" if self.failure else ""
        raise APIError(503, f"the engine is {self.state.value}{reason}", code="unavailable")

    def _check_capacity(self, num_requests: int, num_tokens: int) -> None:
        """Refuse (503) when the requests that would wait for a seat pass the limits.

        The engine's waiting requests, those sent but not yet acknowledged and this one would
        all queue, less the seats free after the last step: a burst that arrives at an idle
        engine is not refused while seats would take it. Their prompt tokens count only when
        some of them will wait (which of them cannot be told here)."""
        stats = self.stats
        free_seats = max(0, self.info.max_num_seqs - stats.num_running)
        queued_requests = stats.num_waiting + self._num_pending_requests
        queued_tokens = stats.num_waiting_tokens + self._num_pending_tokens
        num_waiting = queued_requests + num_requests - free_seats
        if num_waiting > self.max_queued_requests or (
            num_waiting > 0 and queued_tokens + num_tokens > self.max_queued_tokens
        ):
            raise APIError(
                503,
                f"the server is at its queue limit ({queued_requests} requests and "
                f"{queued_tokens} prompt tokens waiting; limits {self.max_queued_requests} and "
                f"{self.max_queued_tokens}); retry after {RETRY_AFTER_S} s",
                code="queue_full",
                retry_after_s=RETRY_AFTER_S,
            )

    async def submit(
        self, subs: list[SubRequest], arrival_time: float | None = None
    ) -> RequestStream:
        """Send a group of engine requests; returns once the engine has accepted all of them
        (400 if it refused one, 503 if the server cannot take them now). `arrival_time`: when
        the HTTP request reached its handler (the engine's latency metrics start there)."""
        self.check_serving()
        num_tokens = sum(len(s.prompt_ids) for s in subs)
        if len(subs) > self.max_queued_requests or num_tokens > self.max_queued_tokens:
            raise bad_request(
                f"this request alone ({len(subs)} requests, {num_tokens} prompt tokens) exceeds "
                f"the server's queue limits ({self.max_queued_requests} requests, "
                f"{self.max_queued_tokens} prompt tokens): it could never be admitted"
            )
        self._check_capacity(len(subs), num_tokens)
        is_streaming = subs[0].params.output_kind == "delta"
        decoders = None
        if is_streaming and self.decode_streams and not subs[0].params.stop_strings:
            subs = [replace(s, params=replace(s.params, output_kind="delta_tokens")) for s in subs]
            decoders = [
                Detokenizer(self.info.tokenizer, s.params.skip_special_tokens) for s in subs
            ]
        stream = RequestStream(
            [s.request_id for s in subs], self.abort, self.pacer if is_streaming else None,
            decoders,
        )  # fmt: skip
        for index, sub in enumerate(subs):
            self._routes[sub.request_id] = (stream, index)
        done, ack_id = self._loop.create_future(), next(self._ack_ids)
        self._pending[ack_id] = (done, tuple(subs), num_tokens)
        self._num_pending_requests += len(subs)
        self._num_pending_tokens += num_tokens
        encoded = tuple(
            (s.request_id, s.prompt_ids, s.params, s.prompt_text, arrival_time) for s in subs
        )
        self._send((wire.ADD, ack_id, encoded))
        try:
            await done
        except asyncio.CancelledError:  # the client left while the engine was adding it
            stream.close()
            raise
        except ValueError as e:  # refused by the engine (already unrouted on acknowledgement)
            stream.close()  # (its pacer stops counting it; the engine has nothing to abort)
            raise bad_request(str(e)) from None
        return stream

    def is_routed(self, request_id: str) -> bool:
        """Whether an engine request of this id is in flight from this process."""
        return request_id in self._routes

    def count_rejected(self, reason: str) -> bool:
        """Count a 503 with the engine's request metrics (so every API process's /metrics
        shows it); False when no engine can take it (loading, stopping, dead)."""
        if self.state != EngineState.SERVING:
            return False
        self._send((wire.REJECTED, reason))
        return True

    def abort(self, request_ids: list[str]) -> None:
        """Ask the engine to abort these requests (their pages are freed at its next
        iteration); their final outputs still come back for the metrics."""
        if request_ids and self.state in (EngineState.SERVING, EngineState.STOPPING):
            self._send((wire.ABORT, tuple(request_ids)))

    def _acknowledge(self, acks: tuple, stats: tuple) -> None:
        self.stats = merge_stats(self.stats, stats)
        for ack_id, error in acks:
            done, subs, num_tokens = self._pending.pop(ack_id)
            self._num_pending_requests -= len(subs)
            self._num_pending_tokens -= num_tokens
            if error is not None:
                for sub in subs:  # even when its submitter left meanwhile
                    self._routes.pop(sub.request_id, None)
            if done.done():  # cancelled by its client meanwhile
                continue
            if error is None:
                done.set_result(None)
            elif error[0] == wire.INVALID:
                done.set_exception(ValueError(error[1]))
            else:
                done.set_exception(RuntimeError(f"the engine failed to add it: {error[1]}"))

    def _deliver(self, outputs: list[tuple], stats: tuple) -> None:
        """One step's outputs (one message per step)."""
        self.stats = merge_stats(self.stats, stats)
        routes, now = self._routes, self._loop.time()
        for encoded in outputs:
            route = routes.get(encoded[0])
            if route is None:
                continue
            out = decode_output(encoded)
            if out.final is not None:
                del routes[out.request_id]
            stream, index = route
            if (prompt_logprobs := prompt_logprobs_of(encoded)) is not None:
                stream.prompt_logprobs[index] = prompt_logprobs
            stream.put(index, out, now)

    def _die(self, reason: str) -> None:
        logger.error("the engine is dead: %s", reason)
        self.failure = reason
        if self.state == EngineState.LOADING:
            self.load_failure = reason
        self.state = EngineState.DEAD
        # nothing runs, waits or holds a page any more; the request counters stay
        self.stats = replace(self.stats, num_running=0, num_waiting=0, num_waiting_tokens=0,
                             num_kv_pages_used=0)  # fmt: skip
        self._fail_all(reason)

    def _fail_all(self, reason: str) -> None:
        now = self._loop.time()
        for stream, index in self._routes.values():
            stream.put(index, EngineFailed(reason), now)
        self._routes.clear()
        for done, _, _ in self._pending.values():
            if not done.done():
                done.set_exception(APIError(503, f"the engine is unavailable: {reason}"))
        self._pending.clear()
        self._num_pending_requests = self._num_pending_tokens = 0


def _exit_status(process: multiprocessing.process.BaseProcess) -> str:
    code = process.exitcode
    if code is None:
        return "still running after its pipe closed"
    if code < 0:
        return f"killed by signal {-code}"
    return f"exit status {code}"
