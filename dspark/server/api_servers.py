"""`dspark serve --api-server-count N`: N HTTP server processes in front of one engine process.

One event loop does all of a server's HTTP work: parsing requests, validating them, rendering chat
templates and tokenizing, writing every stream's chunks. At a few hundred streams it is busy most of
the time, and requests that arrive together (those that replace the requests one engine step
finished) wait for it before their handlers run: on the H200 ~100 ms of a 200 ms time to first token
at 256 streams, and the engine ran 70-80% of its seats. vLLM answers the same way (`--api-server-
count`): several processes share the listening socket, and the kernel spreads the connections.

    main process    binds the socket; spawns the workers, then (its app's start-up) the engine
                    with one pipe per API process; serves HTTP itself
    workers 1..N-1  serve HTTP on the same socket, each attached to the engine by its pipe
    engine process  one step loop for every API process (engine_process.EngineServer): each
                    request's outputs go back to the process that added it, stats to all

Every process answers every route. /metrics is the whole server's in each: the request
figures are recorded in the engine process and sent with its stats (metrics.py). /health is
each process's view of the one engine.

Lifetime: SIGTERM (or Ctrl-C) to the main process stops the workers first (each aborts what it
still serves and detaches), then the main server's own requests and the engine. A worker exits
when the main process is gone; a worker that dies has its requests aborted by the engine,
and the others serve on (it is not restarted).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
import socket
from collections.abc import Callable
from multiprocessing.connection import Connection

from dspark import envs
from dspark.server.config import ServerConfig
from dspark.server.engine_process import watch_parent

logger = logging.getLogger(__name__)

# past its graceful shutdown (shutdown.py: the timeout, then the aborts' grace), a worker is
# killed
WORKER_STOP_MARGIN_S = 5.0


def serve_with_workers(
    config: ServerConfig, engine_factory: Callable, uvicorn_options: dict
) -> str | None:
    """Run the main server here and config.api_server_count - 1 workers, until stopped;
    returns why the engine failed to load, if it did (the server stops then)."""
    import uvicorn

    from dspark.server.app import build_app
    from dspark.server.shutdown import ABORT_GRACE_S, GracefulServer

    context = multiprocessing.get_context("spawn")
    sock = uvicorn.Config(None, host=config.host, port=config.port).bind_socket()
    levels = (logging.getLogger().level, logging.getLogger("dspark").getEffectiveLevel())
    workers, engine_ends = [], []
    for index in range(1, config.api_server_count):
        worker_end, engine_end = context.Pipe()
        worker = context.Process(
            target=run_worker, args=(index, config, worker_end, sock, uvicorn_options, levels),
            name=f"dspark-api-{index}",
        )  # fmt: skip
        worker.start()
        worker_end.close()  # the worker's now: its exit closes the pipe
        workers.append(worker)
        engine_ends.append(engine_end)

    stop_timeout_s = config.shutdown_timeout_s + ABORT_GRACE_S + WORKER_STOP_MARGIN_S

    async def stop_workers() -> None:
        await asyncio.to_thread(_stop_workers, workers, stop_timeout_s)

    app = build_app(config, engine_factory, other_servers=tuple(engine_ends),
                    before_stop=stop_workers)  # fmt: skip
    logger.info("serving with %d API processes (this one and %d workers)",
                config.api_server_count, len(workers))  # fmt: skip
    server = GracefulServer(app, config.shutdown_timeout_s, **uvicorn_options)
    try:
        server.run(sockets=[sock])
        return server.load_failure
    finally:
        _stop_workers(workers, stop_timeout_s)  # (already stopped, unless start-up failed)


def _stop_workers(workers: list[multiprocessing.process.BaseProcess], timeout_s: float) -> None:
    """SIGTERM to every worker still running, then wait for them (killing stragglers)."""
    for worker in workers:
        if worker.is_alive():
            os.kill(worker.pid, signal.SIGTERM)
    for worker in workers:
        worker.join(timeout_s)
        if worker.is_alive():
            logger.error("API worker %s did not stop in %.0f s: killed", worker.name,
                         timeout_s)  # fmt: skip
            worker.kill()
            worker.join()


def run_worker(
    index: int,
    config: ServerConfig,
    conn: Connection,
    sock: socket.socket,
    uvicorn_options: dict,
    log_levels: tuple[int, int],
) -> None:
    """A worker's entry point: the app, attached to the main server's engine, on the shared
    socket."""
    from dspark.server.app import build_app
    from dspark.server.shutdown import GracefulServer

    root_level, dspark_level = log_levels
    logging.basicConfig(level=root_level,
                        format=f"%(levelname)s %(name)s (api {index}): %(message)s")  # fmt: skip
    logging.getLogger("dspark").setLevel(dspark_level)
    watch_parent()  # (the main server gone, so is the engine: nobody is left to answer)
    if envs.ENVS.server_profile:  # each process its own profile, not the main's path
        os.environ["DSPARK_SERVER_PROFILE"] = f"{envs.ENVS.server_profile}.api{index}"
        envs.reread()
    app = build_app(config, None, attach=conn)
    GracefulServer(app, config.shutdown_timeout_s, **uvicorn_options).run(sockets=[sock])
