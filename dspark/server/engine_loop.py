"""The bridge between the synchronous engine and the asyncio server: one engine thread.

The engine is not thread-safe and its step() blocks, so exactly one thread owns it: it builds
the engine (the server answers /health 503 meanwhile), then loops

    apply queued commands (add, abort, stop)   # the only way other threads reach the engine
    step() once if anything is unfinished
    post the step's outputs and a stats snapshot to the event loop (one call_soon_threadsafe)

and blocks on the command queue while idle. On the event loop, `submit` registers a
`RequestStream` per HTTP request before its add command is queued, so no output can arrive
unrouted; outputs are routed by request id until each request's final output, which is also
where the server's metrics see every request, aborted ones included. A stream keeps only each
choice's latest output and sends it when its pacing allows (request_stream.py): under load a
chunk carries the tokens of several steps, so the loop's share of the interpreter lock, which
the engine's host loop needs too, stays bounded.

The tokenizer is the one thing both threads touch: prompts are encoded (with default settings,
so nothing in it is reconfigured) on the event loop while the engine thread decodes outputs;
each call into the Rust tokenizer holds the GIL, so the two never interleave inside it.

Admission control lives on the event loop: a submission is refused with 503 when the requests
(or prompt tokens) waiting for the scheduler, plus those queued but not yet added, would pass
the configured limits. A group of sub-requests (n choices, several prompts) is added atomically:
all are validated before any is queued.

Failures: a request the engine refuses (ValueError: prompt too long, ...) fails its submission
with a 400. If step() raises, the engine's state is unknown: the loop stops, every open stream
ends with EngineFailed (finish_reason "error") and /health answers 503 with the reason.
"""

from __future__ import annotations

import asyncio
import enum
import gc
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from dspark.engine.engine import LLMEngine
from dspark.outputs import RequestOutput
from dspark.sampling_params import SamplingParams
from dspark.server.errors import APIError, bad_request
from dspark.server.request_stream import EngineFailed, RequestStream, StreamPacer

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.5  # an idle engine thread wakes at least this often (to notice a stop)
RETRY_AFTER_S = 1


class EngineState(str, enum.Enum):
    LOADING = "loading"
    SERVING = "serving"
    STOPPING = "stopping"
    DEAD = "dead"


@dataclass(frozen=True)
class EngineStats:
    """What the engine looked like after its last step (read by /metrics and admission)."""

    num_running: int = 0
    num_waiting: int = 0
    num_waiting_tokens: int = 0  # tokens the waiting requests still have to prefill
    num_kv_pages_used: int = 0
    num_kv_pages: int = 0
    num_preemptions: int = 0
    spec: dict = field(default_factory=dict)  # LLMEngine.get_metrics()


@dataclass(frozen=True)
class SubRequest:
    """One engine request of an HTTP request (one prompt x one of its n choices)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    prompt_text: str | None = None


@dataclass(frozen=True)
class _Add:
    subs: tuple[SubRequest, ...]
    done: asyncio.Future


@dataclass(frozen=True)
class _Abort:
    request_ids: tuple[str, ...]


class _Stop:
    pass


def stats_of(engine: LLMEngine) -> EngineStats:
    sched, alloc = engine.scheduler, engine.allocator
    return EngineStats(
        num_running=len(sched.running),
        num_waiting=len(sched.waiting),
        num_waiting_tokens=sum(r.num_tokens - r.num_computed_tokens for r in sched.waiting),
        num_kv_pages_used=alloc.num_usable - alloc.num_free,
        num_kv_pages=alloc.num_usable,
        num_preemptions=sched.num_preemptions,
        spec=engine.get_metrics(),
    )


class EngineLoop:
    def __init__(
        self,
        engine_factory: Callable[[], LLMEngine],
        max_queued_requests: int,
        max_queued_tokens: int,
        on_finished: Callable[[RequestOutput], None] = lambda out: None,
        stream_budget: float | None = None,
    ) -> None:
        self._factory = engine_factory
        self.pacer = StreamPacer(stream_budget)  # shared by the streaming requests
        self.max_queued_requests = max_queued_requests
        self.max_queued_tokens = max_queued_tokens
        self._on_finished = on_finished
        self.state = EngineState.LOADING
        self.failure: str | None = None  # why the engine died
        self.engine: LLMEngine | None = None  # set by the engine thread once built
        self.stats = EngineStats()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._routes: dict[str, tuple[RequestStream, int]] = {}  # request id -> (stream, index)
        self._pending: dict[asyncio.Future, tuple[int, int]] = {}  # adds not yet acknowledged
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._live: set[str] = set()  # the engine thread's own record of unfinished requests

    # ---- the event loop's side --------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="dspark-engine", daemon=True)
        self._thread.start()

    @property
    def num_in_flight(self) -> int:
        """Engine requests the server still routes (running, waiting or being aborted)."""
        return len(self._routes)

    def check_serving(self) -> None:
        if self.state == EngineState.SERVING:
            return
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
        queued_requests = self.stats.num_waiting + sum(n for n, _ in self._pending.values())
        queued_tokens = self.stats.num_waiting_tokens + sum(t for _, t in self._pending.values())
        if (
            queued_requests + num_requests > self.max_queued_requests
            or queued_tokens + num_tokens > self.max_queued_tokens
        ):
            raise APIError(
                503,
                f"the server is at its queue limit ({queued_requests} requests and "
                f"{queued_tokens} prompt tokens waiting; limits {self.max_queued_requests} and "
                f"{self.max_queued_tokens}); retry after {RETRY_AFTER_S} s",
                code="queue_full",
                retry_after_s=RETRY_AFTER_S,
            )

    async def submit(self, subs: list[SubRequest]) -> RequestStream:
        """Queue a group of engine requests; returns once the engine has accepted all of them
        (400 if it refused one, 503 if the server cannot take them now)."""
        self.check_serving()
        num_tokens = sum(len(s.prompt_ids) for s in subs)
        if len(subs) > self.max_queued_requests or num_tokens > self.max_queued_tokens:
            raise bad_request(
                f"this request alone ({len(subs)} requests, {num_tokens} prompt tokens) exceeds "
                f"the server's queue limits ({self.max_queued_requests} requests, "
                f"{self.max_queued_tokens} prompt tokens): it could never be admitted"
            )
        self._check_capacity(len(subs), num_tokens)
        is_streaming = subs[0].params.output_kind == "cumulative"
        stream = RequestStream(
            [s.request_id for s in subs], self.abort, self.pacer if is_streaming else None
        )
        for index, sub in enumerate(subs):
            self._routes[sub.request_id] = (stream, index)
        done = self._loop.create_future()
        self._pending[done] = (len(subs), num_tokens)
        self._commands.put(_Add(tuple(subs), done))
        try:
            await done
        except asyncio.CancelledError:  # the client left while the engine was adding it
            stream.close()
            raise
        except ValueError as e:  # refused by the engine (already unrouted on acknowledgement)
            stream.close()  # (its pacer stops counting it; the engine has nothing to abort)
            raise bad_request(str(e)) from None
        return stream

    def _unroute(self, subs: tuple[SubRequest, ...]) -> None:
        for sub in subs:
            self._routes.pop(sub.request_id, None)

    def abort(self, request_ids: list[str]) -> None:
        """Ask the engine to abort these requests (their pages are freed at its next
        iteration); their final outputs still come back for the metrics."""
        if request_ids and self.state in (EngineState.SERVING, EngineState.STOPPING):
            self._commands.put(_Abort(tuple(request_ids)))

    async def stop(self) -> None:
        """Abort whatever is still running, then end the engine thread."""
        if self._thread is None:
            return
        if self.state in (EngineState.LOADING, EngineState.SERVING):
            self.state = EngineState.STOPPING
        self._commands.put(_Stop())
        await asyncio.to_thread(self._thread.join)
        self._fail_all("the server shut down")

    def _acknowledge(self, acks: list[tuple[_Add, BaseException | None]], stats) -> None:
        self.stats = stats
        for command, error in acks:
            self._pending.pop(command.done, None)
            if error is not None:
                self._unroute(command.subs)  # even when its submitter left meanwhile
            if command.done.done():  # cancelled by its client meanwhile
                continue
            if error is None:
                command.done.set_result(None)
            else:
                command.done.set_exception(error)

    def _deliver(self, outputs: list[RequestOutput], stats: EngineStats) -> None:
        """One step's outputs, in one call (the engine thread posts one per step)."""
        self.stats = stats
        routes, now = self._routes, self._loop.time()
        for out in outputs:
            route = routes.get(out.request_id)
            if route is None:
                continue
            if out.finished:
                del routes[out.request_id]
                self._on_finished(out)
            stream, index = route
            stream.put(index, out, now)

    def _fail_all(self, reason: str) -> None:
        now = self._loop.time()
        for stream, index in self._routes.values():
            stream.put(index, EngineFailed(reason), now)
        self._routes.clear()
        for done in self._pending:
            if not done.done():
                done.set_exception(APIError(503, f"the engine is unavailable: {reason}"))
        self._pending.clear()

    # ---- the engine thread ------------------------------------------------------------------

    def _post(self, callback, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the event loop is closed: nobody is left to tell
            pass

    def _run(self) -> None:
        try:
            engine = self._factory()
        except BaseException as e:  # noqa: BLE001 - any load failure is reported, not raised
            logger.exception("the engine failed to load")
            self._die(f"the engine failed to load: {type(e).__name__}: {e}")
            return
        self.engine = engine
        # what exists now (modules, weights' wrappers, the tokenizer) lives as long as the
        # server: frozen, the oldest generation's collections skip it (a full collection of
        # this heap paused both threads ~0.27 s every few seconds under load on the CPU; vLLM
        # freezes it too). Unfrozen at the end, so the exit's collection still frees it.
        gc.collect()
        gc.freeze()
        try:
            self._serve(engine)
        finally:
            gc.unfreeze()

    def _serve(self, engine: LLMEngine) -> None:
        if self.state == EngineState.LOADING:
            self.state = EngineState.SERVING
        self._post(self._deliver, [], stats_of(engine))
        logger.info("engine ready: serving")
        while self._apply_commands(engine, block=not engine.has_unfinished_requests()):
            if not engine.has_unfinished_requests():
                continue
            try:
                outputs = self._step(engine)
            except Exception as e:
                logger.exception("engine step failed")
                self._die(f"an engine step failed: {type(e).__name__}: {e}")
                return
            self._post(self._deliver, outputs, stats_of(engine))
        self._abort_everything(engine)

    def _apply_commands(self, engine: LLMEngine, block: bool) -> bool:
        """Apply every queued command; False once a stop was asked for."""
        commands = []
        try:
            commands.append(self._commands.get(timeout=IDLE_POLL_S if block else 0))
            while True:
                commands.append(self._commands.get_nowait())
        except queue.Empty:
            pass
        acks, keep_running = [], True
        for command in commands:
            if isinstance(command, _Add):
                acks.append((command, self._add(engine, command.subs)))
            elif isinstance(command, _Abort):
                for request_id in command.request_ids:
                    engine.abort_request(request_id)
            else:
                keep_running = False
        if acks:
            self._post(self._acknowledge, acks, stats_of(engine))
        return keep_running

    def _add(self, engine: LLMEngine, subs: tuple[SubRequest, ...]) -> BaseException | None:
        """Validate the whole group, then add it: a refused request queues none of its group."""
        try:
            for sub in subs:
                engine.validate_request(sub.request_id, sub.prompt_ids, sub.params)
            for sub in subs:
                engine.add_request(sub.request_id, sub.prompt_ids, sub.params, sub.prompt_text)
                self._live.add(sub.request_id)
        except Exception as e:  # noqa: BLE001 - handed to the submitter, who answers it
            for sub in subs:
                engine.abort_request(sub.request_id)
            return e
        return None

    def _step(self, engine: LLMEngine) -> list[RequestOutput]:
        outputs = engine.step()
        self._live.difference_update(out.request_id for out in outputs if out.finished)
        return outputs

    def _abort_everything(self, engine: LLMEngine) -> None:
        """At stop: abort what is left and hand back its final outputs (an aborted request
        reports at the next step; an in-flight step needs one more to be collected)."""
        for request_id in self._live:
            engine.abort_request(request_id)
        outputs = self._step(engine)
        for _ in range(2):
            if engine.has_unfinished_requests():
                outputs += self._step(engine)
        self._post(self._deliver, outputs, stats_of(engine))

    def _die(self, reason: str) -> None:
        self.failure = reason
        self.state = EngineState.DEAD
        self._post(self._fail_all, reason)
