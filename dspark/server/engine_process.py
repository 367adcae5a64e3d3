"""The engine's own process: it builds the engine and runs the step loop (vLLM's "engine core").

The server process (engine_loop.py) starts it with the `spawn` method (CUDA cannot be used in a
forked child) and talks to it over one multiprocessing Pipe, in wire.py's messages. Apart, the
two share no interpreter lock: the event loop's HTTP work no longer takes host time from the
engine's step loop, which on a GPU is what bounds throughput at large batches. The loop:

    apply the commands that arrived (add, abort, stop)    # acknowledged at once, with stats
    step() once if anything is unfinished
    post the step's outputs and a stats snapshot           # sent by output_sender.py's thread

and it waits on the pipe while idle. Requests are "delta" (streams: only what is new each step)
or "final_only" (whole responses): the per-step cost stays proportional to the new tokens.

Detokenization: a stream without stop strings arrives as output_kind "delta_tokens", and its
text is decoded by the server, once per chunk (engine_loop.py; `dspark serve
--stream-detokenize engine` keeps it here). Whole responses and streams with stop strings are
decoded here: the engine decodes those anyway to find stop strings (and which token completed
one, to drop the tokens after it), so their text is sent with the tokens.

Lifetime: SIGINT is ignored (a Ctrl-C reaches the whole process group; the server shuts down
on it and decides when the engine stops: STOP aborts what is left, reports it and exits).
SIGTERM ends the process, as vLLM's engine core (send it to the server, which stops the engine
in order; multiprocessing's exit handler terminates a daemon child the server left behind).
The process ends on its own when its parent is gone: a watchdog thread waits on the parent's
sentinel (also while the model loads), and a closed pipe ends the loop. If the engine fails to
load or a step raises, FAILED carries the reason and the process exits.
"""

from __future__ import annotations

import cProfile
import functools
import gc
import io
import logging
import multiprocessing
import os
import pstats
import signal
import threading
from collections import Counter
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from time import monotonic

from dspark.outputs import FinalInfo
from dspark.server import wire
from dspark.server.metrics import RequestMetrics
from dspark.server.output_sender import OutputSender
from dspark.server.phase_times import PhaseTimes
from dspark.server.wire import EngineInfo, encode_outputs, stats_of

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.5  # an idle engine wakes at least this often
# the stats' metrics part (LLMEngine.get_metrics, a dict built and pickled, and the request
# metrics' snapshot) goes with a step's stats at most this often, and with every step where a
# request ends; /metrics reads it
METRICS_INTERVAL_S = 0.1
PARENT_GONE_EXIT = 3  # the exit status of an engine whose server died
# a path here: the step loop runs under cProfile, written there (and its top logged) at stop;
# it slows the loop's Python, so it says where host time goes, not how fast the loop is
PROFILE_ENV = "DSPARK_ENGINE_PROFILE"
PROFILE_TOP = 30
# the same for the server process (its event loop: HTTP, routing, streaming), set by cli.py
SERVER_PROFILE_ENV = "DSPARK_SERVER_PROFILE"


def build_engine(config):
    """The usual factory: LLMEngine(config) (a module function, so it pickles for spawn)."""
    from dspark.engine.engine import LLMEngine

    return LLMEngine(config)


def engine_factory(config) -> Callable:
    return functools.partial(build_engine, config)


def run_engine_process(factory: Callable, conn: Connection, log_levels: tuple[int, int]) -> None:
    """The spawned process's entry point."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    root_level, dspark_level = log_levels
    logging.basicConfig(level=root_level, format="%(levelname)s %(name)s (engine): %(message)s")
    logging.getLogger("dspark").setLevel(dspark_level)
    threading.Thread(target=_exit_with_parent, name="dspark-parent-watch", daemon=True).start()
    try:
        engine = factory()
    except BaseException as e:  # noqa: BLE001 - any load failure is reported, not raised
        logger.exception("the engine failed to load")
        conn.send((wire.FAILED, f"the engine failed to load: {type(e).__name__}: {e}"))
        return
    conn.send((wire.READY, EngineInfo(engine.tokenizer, engine.max_model_len, os.getpid())))
    # what exists now (modules, weights' wrappers, the tokenizer) lives as long as the
    # process: frozen, the oldest generation's collections skip it (a full collection of this
    # heap paused the step loop ~0.27 s every few seconds under load on the CPU; vLLM freezes
    # it too)
    gc.collect()
    gc.freeze()
    sender = OutputSender(conn, PARENT_GONE_EXIT)
    profile_path = os.environ.get(PROFILE_ENV)
    profiler = cProfile.Profile() if profile_path else None
    try:
        if profiler is not None:
            profiler.enable()
        EngineServer(engine, conn, sender).serve()
    except (EOFError, OSError):  # the pipe closed under a receive: the server is gone
        logger.warning("the server closed the pipe: the engine process exits")
        os._exit(PARENT_GONE_EXIT)
    if profiler is not None:
        profiler.disable()
        report_profile(profiler, profile_path, "the engine loop")
    sender.drain(timeout=30.0)
    # done: skip the interpreter's teardown (seconds of collecting a frozen heap, and Triton's
    # bindings report their objects as leaked when finalised); nothing is left to flush but logs
    logging.shutdown()
    os._exit(0)


def report_profile(profiler: cProfile.Profile, path: str, what: str) -> None:
    """A loop's profile (PROFILE_ENV, SERVER_PROFILE_ENV): written to `path` for pstats, its
    top functions by own time logged."""
    profiler.dump_stats(path)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(PROFILE_TOP)
    logger.info("%s's profile (%s):\n%s", what, path, text.getvalue())


class StepMix:
    """What the steps of a busy period carried: the mean running and waiting requests before a
    step, and the runner's step counters since the last line (which path each step took).
    Served steps differ from offline ones in this mix (requests arrive spread out, so more
    steps admit a prefill): the line says so where a served step is dearer.

        steps: running 231.4, waiting 12.0 a step; graph_steps 900, mixed_decode_steps 180
    """

    def __init__(self, engine) -> None:
        self.engine = engine
        self.num_steps = self.running = self.waiting = 0
        self._counters = Counter(engine.runner.stats)

    def before_step(self) -> None:
        scheduler = self.engine.scheduler
        self.num_steps += 1
        self.running += len(scheduler.running)
        self.waiting += len(scheduler.waiting)

    def take(self) -> str:
        """The line for the steps since the last take; counting starts again."""
        counters = Counter(self.engine.runner.stats)
        counters.subtract(self._counters)
        self._counters = Counter(self.engine.runner.stats)
        n = max(self.num_steps, 1)
        paths = ", ".join(f"{k} {v:,}" for k, v in sorted(counters.items()) if v > 0)
        line = f"steps: running {self.running / n:.1f}, waiting {self.waiting / n:.1f} a step"
        self.num_steps = self.running = self.waiting = 0
        return f"{line}; {paths or 'no runner counters'}"


def _exit_with_parent() -> None:
    wait([multiprocessing.parent_process().sentinel])
    os._exit(PARENT_GONE_EXIT)  # no cleanup to wait for: nobody is left to answer


class EngineServer:
    """The step loop over one pipe (see the module docstring)."""

    def __init__(self, engine, conn: Connection, sender: OutputSender) -> None:
        self.engine = engine
        self.conn = conn  # commands in
        self.sender = sender  # messages out
        self._live: set[str] = set()  # unfinished requests, to abort at STOP
        self.times = PhaseTimes()  # where the loop's wall time goes, logged per busy period
        self.mix = StepMix(engine)  # what the steps of a busy period carried, logged beside it
        self._metrics_due = 0.0  # when the metrics part of the stats goes out again (monotonic)
        self.requests = RequestMetrics()  # every request's end, for /metrics

    def serve(self) -> None:
        engine, conn, sender = self.engine, self.conn, self.sender
        sender.send((wire.ADDED, (), stats_of(engine, self.requests)))  # the first snapshot
        logger.info("engine ready: serving")
        times = self.times
        times.restart()
        while True:
            idle = not engine.has_unfinished_requests() and not conn.poll(IDLE_POLL_S)
            times.lap("idle")
            if idle:
                if times.counts["step"]:  # a busy period ended: where its time went
                    self._log_times()
                continue
            if not self._apply_commands():
                break
            times.lap("commands")
            if not engine.has_unfinished_requests():
                continue
            self.mix.before_step()
            try:
                outputs = self._step()
            except Exception as e:
                logger.exception("engine step failed")
                sender.send((wire.FAILED, f"an engine step failed: {type(e).__name__}: {e}"))
                return
            times.lap("step")
            sender.post_step(outputs, self._stats(any(out[4] is not None for out in outputs)))
            times.lap("post")
        if times.counts["step"]:
            self._log_times()
        self._abort_everything()
        sender.send((wire.STOPPED,))

    def _log_times(self) -> None:
        """Where the busy period that just ended spent its time (each level of a benchmark is
        one such period); the clocks start again."""
        logger.info("engine loop: %s; %s", self.times.take().summary("step"), self.mix.take())
        logger.info("output sender: %s", self.sender.times.take().summary("message"))

    def _apply_commands(self) -> bool:
        """Apply every command that arrived; False once a stop was asked for."""
        conn, acks, keep_running, rejected = self.conn, [], True, False
        while conn.poll(0):
            command = conn.recv()
            if command[0] == wire.ADD:
                acks.append((command[1], self._add(command[2])))
            elif command[0] == wire.ABORT:
                for request_id in command[1]:
                    self.engine.abort_request(request_id)
            elif command[0] == wire.REJECTED:
                self.requests.rejected[command[1]] += 1
                rejected = True
            else:
                assert command[0] == wire.STOP, f"unknown command {command[0]!r}"
                keep_running = False
        if acks or rejected:  # (a rejection's count goes out at once, with the metrics)
            self.sender.send((wire.ADDED, acks, self._stats(force=rejected)))
        return keep_running

    def _add(self, subs: tuple) -> tuple[str, str] | None:
        """Validate the whole group, then add it: a refused request queues none of its group.
        None, or the error as (kind, message)."""
        engine = self.engine
        try:
            for request_id, prompt_ids, params, _ in subs:
                engine.validate_request(request_id, prompt_ids, params)
            for request_id, prompt_ids, params, prompt_text in subs:
                engine.add_request(request_id, prompt_ids, params, prompt_text)
                self._live.add(request_id)
        except Exception as e:  # noqa: BLE001 - handed to the submitter, who answers it
            for request_id, *_ in subs:
                engine.abort_request(request_id)
            kind = wire.INVALID if isinstance(e, (ValueError, TypeError)) else type(e).__name__
            return kind, str(e)
        return None

    def _stats(self, force: bool = False) -> tuple:
        """stats_of the engine, with its metrics part if due or forced."""
        now = monotonic()
        with_metrics = force or now >= self._metrics_due
        if with_metrics:
            self._metrics_due = now + METRICS_INTERVAL_S
        return stats_of(self.engine, self.requests, with_metrics)

    def _step(self) -> list[tuple]:
        outputs = encode_outputs(self.engine.step())
        for out in outputs:
            if out[4] is not None:  # a final output: the request ended
                self._live.discard(out[0])
                self.requests.record(FinalInfo(*out[4]))
        return outputs

    def _abort_everything(self) -> None:
        """At stop: abort what is left and send its final outputs (an in-flight step needs
        one more step to be collected)."""
        for request_id in self._live:
            self.engine.abort_request(request_id)
        outputs = []
        for _ in range(3):
            if self.engine.has_unfinished_requests():
                outputs += self._step()
        self.sender.post_step(outputs, stats_of(self.engine, self.requests))
