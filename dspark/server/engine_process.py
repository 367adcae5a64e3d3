"""The engine's own process: it builds the engine and runs the step loop (vLLM's "engine core").

The server process (engine_loop.py) starts it with the `spawn` method (CUDA cannot be used in a
forked child) and talks to it over a multiprocessing Pipe, in wire.py's messages: one pipe per
API process (`dspark serve --api-server-count`, api_servers.py; usually one). Apart, the
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
on it and decides when the engine stops: STOP aborts that server's requests, reports them and
detaches it; the process exits once no server is attached).
SIGTERM ends the process, as vLLM's engine core (send it to the server, which stops the engine
in order; multiprocessing's exit handler terminates a daemon child the server left behind).
The process ends on its own when its parent is gone: a watchdog thread waits on the parent's
sentinel (also while the model loads), and a closed pipe detaches its server (the only one:
the loop ends). If the engine fails to load or a step raises, FAILED carries the reason and
the process exits.
"""

from __future__ import annotations

import cProfile
import functools
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

from dspark import envs
from dspark.engine.collector import steady_collector_for_good
from dspark.outputs import FinalInfo
from dspark.server import wire
from dspark.server.metrics import RequestMetrics
from dspark.server.output_sender import OutputSender
from dspark.server.phase_times import PhaseTimes
from dspark.server.wire import EngineInfo, encode_outputs, stats_of

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.5  # an idle engine wakes at least this often
# the stats' speculative part (LLMEngine.get_metrics, a dict built and pickled) goes with a
# step's stats at most this often, and when a request ends with nothing left to run (so a lone
# request's usage and /metrics agree); the request metrics' snapshot (cheap) also goes with every
# step where a request ends (/metrics counts a request by the time its response ends); /metrics
# reads both
METRICS_INTERVAL_S = 0.1
# with several API processes, one whose requests did not advance in a step gets that step's
# stats alone at most this often (admission control reads them: 10 ms stale is fine)
STATS_ONLY_INTERVAL_S = 0.01
PARENT_GONE_EXIT = 3  # the exit status of an engine whose server died
LOAD_FAILED_EXIT = 1  # and of one that failed to load (its servers were told why first)
# DSPARK_ENGINE_PROFILE (dspark/envs.py): the step loop runs under cProfile, written there (and
# its top logged) at stop; it slows the loop's Python, so it says where host time goes, not how
# fast the loop is. DSPARK_SERVER_PROFILE does the same for an API process (app.py).
PROFILE_TOP = 30


def build_engine(config):
    """The usual factory: LLMEngine(config) (a module function, so it pickles for spawn)."""
    from dspark.engine.engine import LLMEngine

    return LLMEngine(config)


class EngineFactory(functools.partial):
    """build_engine(config), knowing whether the engine starts processes of its own (tensor
    parallelism's worker ranks): a daemon process may not, so the engine process is then
    started as a non-daemon one (EngineLoop.start); it still exits with its parent
    (watch_parent), and its workers with it."""

    @property
    def starts_processes(self) -> bool:
        return self.args[0].tensor_parallel_size > 1


def engine_factory(config) -> Callable:
    return EngineFactory(build_engine, config)


def run_engine_process(
    factory: Callable, conns: tuple[Connection, ...], log_levels: tuple[int, int]
) -> None:
    """The spawned process's entry point: one pipe per API process (`dspark serve
    --api-server-count`), the first of them the main server's."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    root_level, dspark_level = log_levels
    logging.basicConfig(level=root_level, format="%(levelname)s %(name)s (engine): %(message)s")
    logging.getLogger("dspark").setLevel(dspark_level)
    watch_parent()
    try:
        engine = factory()
    except BaseException as e:  # noqa: BLE001 - any load failure is reported, not raised
        logger.exception("the engine failed to load")
        reason = f"the engine failed to load: {type(e).__name__}: {e}"
        for conn in conns:
            _send_quietly(conn, (wire.FAILED, reason))
        # as the served path ends below: no interpreter teardown, which after a failed load
        # (torch and transformers imported) outlived a stopping test server's 45 s wait on
        # this 2-core VM, in CI and in an earlier session's run
        logging.shutdown()
        os._exit(LOAD_FAILED_EXIT)
    info = EngineInfo(
        engine.tokenizer, engine.max_model_len, engine.scheduler.max_num_seqs, os.getpid()
    )
    for conn in conns:
        _send_quietly(conn, (wire.READY, info))
    # what exists now (modules, weights' wrappers, the tokenizer) lives as long as the
    # process: frozen, the oldest generation's collections skip it (a full collection of this
    # heap paused the step loop ~0.27 s every few seconds under load on the CPU; vLLM freezes
    # it too), and young collections are rarer (dspark/engine/collector.py)
    steady_collector_for_good()
    # one API process: its pipe closing means the server is gone, and the process exits at
    # once; with several, a closed pipe detaches that one API process (EngineServer)
    exit_status = PARENT_GONE_EXIT if len(conns) == 1 else None
    senders = [OutputSender(conn, exit_status) for conn in conns]
    profile_path = envs.ENVS.engine_profile
    profiler = cProfile.Profile() if profile_path else None
    if profiler is not None:
        profiler.enable()
    server = EngineServer(engine, conns, senders)
    server.serve()
    if profiler is not None:
        profiler.disable()
        report_profile(profiler, profile_path, "the engine loop")
    for sender in senders:
        sender.drain(timeout=30.0)
    engine.shutdown()  # (tensor parallelism: the worker ranks stop before the exit below)
    # done: skip the interpreter's teardown (seconds of collecting a frozen heap, and Triton's
    # bindings report their objects as leaked when finalised); nothing is left to flush but logs
    logging.shutdown()
    os._exit(PARENT_GONE_EXIT if server.lost_every_server else 0)


def _send_quietly(conn: Connection, message: tuple) -> None:
    try:
        conn.send(message)
    except OSError:  # that API process is gone already
        pass


def report_profile(profiler: cProfile.Profile, path: str, what: str) -> None:
    """A loop's profile (DSPARK_ENGINE_PROFILE, DSPARK_SERVER_PROFILE): written to `path` for
    pstats, its top functions by own time logged."""
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


def watch_parent() -> None:
    """Exit this spawned process as soon as the process that spawned it is gone (a watchdog
    thread: also while a model loads); no cleanup to wait for, nobody is left to answer."""

    def exit_with_parent() -> None:
        wait([multiprocessing.parent_process().sentinel])
        os._exit(PARENT_GONE_EXIT)

    threading.Thread(target=exit_with_parent, name="dspark-parent-watch", daemon=True).start()


class EngineServer:
    """The step loop over one pipe per API process (see the module docstring).

    Each request belongs to the API process that added it: its acknowledgement and outputs go
    back on that pipe only, while every pipe gets the stats. STOP from an API process aborts
    its requests; once their final outputs are sent it gets STOPPED and is detached. A pipe
    that closes (its process died) detaches at once, its requests aborted. The loop ends when
    no API process is attached.
    """

    def __init__(self, engine, conns: list[Connection], senders: list[OutputSender]) -> None:
        self.engine = engine
        self.conns = list(conns)  # commands in, one pipe per API process
        self.senders = list(senders)  # messages out, on the same pipes
        self._attached = set(range(len(conns)))  # API processes still served
        self._stopping: set[int] = set()  # asked to stop: detached once their requests end
        self._owner: dict[str, int] = {}  # unfinished request -> its API process
        self._stats_due = [0.0] * len(conns)  # when each process gets counts alone again
        self.lost_every_server = False  # every pipe closed without a STOP
        self.times = PhaseTimes()  # where the loop's wall time goes, logged per busy period
        self.mix = StepMix(engine)  # what the steps of a busy period carried, logged beside it
        self._metrics_due = 0.0  # when the metrics part of the stats goes out again (monotonic)
        self.requests = RequestMetrics()  # every request's end, for /metrics

    def serve(self) -> None:
        engine = self.engine
        first = stats_of(engine, self.requests)
        for i in self._attached:
            self.senders[i].send((wire.ADDED, (), first))  # the first stats snapshot
        logger.info("engine ready: serving %d API process(es)", len(self.conns))
        times = self.times
        times.restart()
        while self._attached:
            if not engine.has_unfinished_requests():
                ready = wait([self.conns[i] for i in self._attached], IDLE_POLL_S)
                times.lap("idle")
                if not ready:
                    if times.counts["step"]:  # a busy period ended: where its time went
                        self._log_times()
                    continue
            self._apply_commands()
            self._detach_stopped()
            times.lap("commands")
            if not engine.has_unfinished_requests():
                continue
            self.mix.before_step()
            try:
                outputs = self._step()
            except Exception as e:
                logger.exception("engine step failed")
                reason = f"an engine step failed: {type(e).__name__}: {e}"
                for i in self._attached:
                    self.senders[i].send((wire.FAILED, reason))
                return
            times.lap("step")
            self._post(outputs)
            self._detach_stopped()
            times.lap("post")
        if times.counts["step"]:
            self._log_times()

    def _log_times(self) -> None:
        """Where the busy period that just ended spent its time (each level of a benchmark is
        one such period); the clocks start again."""
        logger.info("engine loop: %s; %s", self.times.take().summary("step"), self.mix.take())
        for i, sender in enumerate(self.senders):
            logger.info("output sender %d: %s", i, sender.times.take().summary("message"))

    def _apply_commands(self) -> None:
        """Apply every command that arrived, on every attached pipe. The pipe's checks are
        timed apart ("poll"): a check releases the interpreter lock, and the output sender's
        thread takes it to pickle and send what the last step posted, so the check's time is
        mostly the sender's work (on the development CPU at 256 streams, 0.081 ms a step
        against the sender's 0.085)."""
        times = self.times
        for i in list(self._attached):
            conn, acks, rejected = self.conns[i], [], False
            try:
                while True:
                    times.lap("commands")
                    ready = conn.poll(0)
                    times.lap("poll")
                    if not ready:
                        break
                    command = conn.recv()
                    if command[0] == wire.ADD:
                        acks.append((command[1], self._add(command[2], i)))
                    elif command[0] == wire.ABORT:
                        for request_id in command[1]:
                            self.engine.abort_request(request_id)
                    elif command[0] == wire.REJECTED:
                        self.requests.rejected[command[1]] += 1
                        rejected = True
                    else:
                        assert command[0] == wire.STOP, f"unknown command {command[0]!r}"
                        self._stop(i)
            except (EOFError, OSError):  # the API process is gone
                self._detach(i, stopped=False)
                continue
            if acks or rejected:  # (a rejection's count goes out at once, with the metrics)
                self.senders[i].send((wire.ADDED, acks, self._stats(requests_changed=rejected)))

    def _stop(self, i: int) -> None:
        """API process i stops: abort its requests (their final outputs still go to it)."""
        self._stopping.add(i)
        for request_id, owner in self._owner.items():
            if owner == i:
                self.engine.abort_request(request_id)

    def _detach_stopped(self) -> None:
        """STOPPED to each stopping API process whose requests have all ended."""
        for i in list(self._stopping):
            if i in self._attached and i not in self._owner.values():
                self._detach(i, stopped=True)

    def _detach(self, i: int, stopped: bool) -> None:
        self._attached.discard(i)
        self._stopping.discard(i)
        if stopped:
            self.senders[i].send((wire.STOPPED,))
        else:  # gone: nobody reads its requests' outputs
            logger.warning("API process %d closed its pipe: its requests are aborted", i)
            for request_id, owner in list(self._owner.items()):
                if owner == i:
                    self.engine.abort_request(request_id)
                    del self._owner[request_id]
            self.lost_every_server = not self._attached and not self._stopping

    def _add(self, subs: tuple, owner: int) -> tuple[str, str] | None:
        """Validate the whole group, then add it: a refused request queues none of its group.
        None, or the error as (kind, message)."""
        engine = self.engine
        try:
            for request_id, prompt_ids, params, *_ in subs:
                engine.validate_request(request_id, prompt_ids, params)
            for request_id, prompt_ids, params, prompt_text, arrival_time in subs:
                engine.add_request(request_id, prompt_ids, params, prompt_text, arrival_time)
                self._owner[request_id] = owner
        except Exception as e:  # noqa: BLE001 - handed to the submitter, who answers it
            for request_id, *_ in subs:
                engine.abort_request(request_id)
                self._owner.pop(request_id, None)
            kind = wire.INVALID if isinstance(e, (ValueError, TypeError)) else type(e).__name__
            return kind, str(e)
        return None

    def _stats(self, requests_changed: bool = False) -> tuple:
        """stats_of the engine: its speculative part when due (or when nothing is left to
        run after a request changed the request metrics), the request metrics when due or
        changed (a request ended, a rejection counted). With a drafting policy the
        speculative part took ~0.12 ms to build on the development CPU; a step at 256 streams
        ends a request nearly every time, and it used to be forced by each of them."""
        now = monotonic()
        due = now >= self._metrics_due
        if due:
            self._metrics_due = now + METRICS_INTERVAL_S
        with_spec = due or (requests_changed and not self.engine.scheduler.has_unfinished)
        return stats_of(self.engine, self.requests, with_spec, with_spec or requests_changed)

    def _step(self) -> list[tuple]:
        return encode_outputs(self.engine.step())

    def _post(self, outputs: list[tuple]) -> None:
        """Record the requests that ended, then each output to its request's API process and
        the stats (with the request metrics when a request ended) to every one."""
        owner, routed = self._owner, [[] for _ in self.conns]
        single = len(self.conns) == 1  # (the usual case: nothing to route)
        ended = False
        for out in outputs:
            if out[4] is not None:  # a final output: the request ended
                ended = True
                self.requests.record(FinalInfo(*out[4]))
                i = owner.pop(out[0], None)
            else:
                i = None if single else owner.get(out[0])
            if not single and i is not None:
                routed[i].append(out)
        stats = self._stats(requests_changed=ended)
        if single:
            self.senders[0].post_step(outputs, stats)
            return
        # a process none of whose requests advanced gets the counts at most every
        # STATS_ONLY_INTERVAL_S (each post wakes a sender thread, which takes the interpreter
        # lock from this loop); a metrics part goes to every process, and so do the counts
        # once the engine has nothing left to run (no later step would correct them)
        now, idle = monotonic(), not self.engine.has_unfinished_requests()
        has_metrics = stats[-2] is not None or stats[-1] is not None
        for i in self._attached:
            if routed[i] or idle or has_metrics or now >= self._stats_due[i]:
                self.senders[i].post_step(routed[i], stats)
                self._stats_due[i] = now + STATS_ONLY_INTERVAL_S
