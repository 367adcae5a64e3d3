"""Starting the worker ranks, and ending the job when any rank dies.

Rank 0 is the process that builds the engine (the user's, or the server's engine process); it
spawns ranks 1..N-1 (torch.multiprocessing, spawn), each of which builds the same engine on its
shard and follows rank 0's steps (LLMEngine.follow). Every rank runs every step, so a rank that
is gone stops the others inside their next collective:

  - a worker dies:  rank 0's next collective raises (gloo reports the closed connection at
    once); the engine turns that into WorkerDiedError naming the rank and its exit code, and
    ends the other workers. Over NCCL a collective with a peer gone does not fail: its kernel
    waits, and rank 0 with it (in the step's host sync) until the 10-minute collective
    timeout. So rank 0 watches its workers there (Workers.watch): a worker that exits while
    the job runs has the communicators aborted, and the stuck collective then fails.
  - rank 0 dies:    each worker's next collective raises, or its watchdog thread sees its
    parent gone within WATCHDOG_PERIOD_S; the worker exits.
  - a worker fails while starting (a bad checkpoint, no memory): rank 0 waits for the group
    in a thread and gives up as soon as a worker has exited, with its exit code.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.multiprocessing as mp

from dspark.distributed.parallel_state import TensorParallel, init_tensor_parallel

logger = logging.getLogger(__name__)

WATCHDOG_PERIOD_S = 0.5
JOIN_TIMEOUT_S = 10.0  # a worker told to stop that has not after this long is killed


class WorkerDiedError(RuntimeError):
    """A tensor-parallel rank ended while the job needed it."""


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: cuda:r (one GPU a rank, on one host), or the CPU."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


def pick_port(port: int | None) -> int:
    """`port` if free (ValueError if not), or a free one the kernel picks."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port or 0))
        except OSError as e:
            raise ValueError(
                f"distributed_port {port} is in use on 127.0.0.1 ({e.strerror}); give a free "
                "port or none (a free one is picked)"
            ) from None
        return s.getsockname()[1]


@dataclass
class Workers:
    """Ranks 1..N-1, as processes rank 0 started."""

    processes: list[mp.Process]
    _watching: threading.Event = field(default_factory=threading.Event)

    def watch(self, on_death: Callable[[int, int], None]) -> None:
        """Call on_death(rank, exit code) once, from a thread, when a worker exits while the
        job runs (checked every WATCHDOG_PERIOD_S); unwatch() ends the watch, before the
        workers are told to stop: they then exit on purpose."""
        self._watching.set()

        def watch() -> None:
            while self._watching.is_set():
                if (dead := self.dead()) is not None:
                    if self._watching.is_set():
                        on_death(*dead)
                    return
                time.sleep(WATCHDOG_PERIOD_S)

        threading.Thread(target=watch, name="dspark-tp-rank0-watchdog", daemon=True).start()

    def dead(self) -> tuple[int, int] | None:
        """(rank, exit code) of the first worker that has exited, None while all run."""
        for rank, p in enumerate(self.processes, start=1):
            if p.exitcode is not None:
                return rank, p.exitcode
        return None

    def error(self, cause: BaseException | None = None) -> WorkerDiedError:
        """The error to raise after a collective failed: which rank died, if one did."""
        deadline = time.monotonic() + 2.0  # (its exit may lag its closed sockets a little)
        while (dead := self.dead()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        self.stop()
        if dead is None:
            return WorkerDiedError(f"tensor-parallel collective failed: {cause}")
        rank, code = dead
        return WorkerDiedError(f"tensor-parallel rank {rank} exited with code {code}: {cause}")

    def unwatch(self) -> None:
        self._watching.clear()

    def stop(self) -> None:
        """Wait for the workers to leave (after the stop header), killing any that do not."""
        self.unwatch()
        for p in self.processes:
            p.join(JOIN_TIMEOUT_S if p.exitcode is None else 0)
            if p.exitcode is None:
                p.kill()
                p.join()


def start_workers(
    config, device: torch.device, worker_main: Callable
) -> tuple[TensorParallel, Workers]:
    """Spawn ranks 1..N-1 of `config` and join the group as rank 0. `worker_main(config, rank,
    port, parent_pid)` is a worker's life (LLMEngine's run_worker: passed, so that this
    module does not import the engine above it)."""
    size = config.tensor_parallel_size
    port = pick_port(config.distributed_port)
    ctx = mp.get_context("spawn")
    processes = []
    for rank in range(1, size):
        p = ctx.Process(target=worker_main, args=(config, rank, port, os.getpid()),
                        name=f"dspark-tp-rank{rank}", daemon=True)  # fmt: skip
        p.start()
        processes.append(p)
    workers = Workers(processes)
    return _join_group(size, port, rank_device(device, 0), workers), workers


def _join_group(size: int, port: int, device: torch.device, workers: Workers) -> TensorParallel:
    """init_tensor_parallel as rank 0, in a thread so that a worker failing at start ends the
    wait at once instead of at the rendezvous timeout."""
    result: list = []

    def join() -> None:
        try:
            result.append(init_tensor_parallel(0, size, port, device))
        except BaseException as e:  # (handed to the caller below)
            result.append(e)

    thread = threading.Thread(target=join, name="dspark-tp-join", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(WATCHDOG_PERIOD_S)
        if thread.is_alive() and (dead := workers.dead()) is not None:
            workers.stop()
            raise WorkerDiedError(
                f"tensor-parallel rank {dead[0]} exited with code {dead[1]} while starting"
            )
    if isinstance(result[0], BaseException):
        workers.stop()
        raise result[0]
    return result[0]


def join_as_worker(config, rank: int, port: int, parent_pid: int) -> TensorParallel:
    """A worker's start: its watchdog, its share of the host's threads, then the group."""
    _watch_parent(parent_pid)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(max(1, torch.get_num_threads() // config.tensor_parallel_size))
    device = rank_device(config.torch_device(), rank)
    return init_tensor_parallel(rank, config.tensor_parallel_size, port, device)


def _watch_parent(parent_pid: int) -> None:
    """Exit this worker as soon as rank 0's process is gone (it never stops a worker blocked
    outside a collective otherwise)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(WATCHDOG_PERIOD_S)
        os._exit(1)

    threading.Thread(target=watch, name="dspark-tp-watchdog", daemon=True).start()
