"""Shut-down that completes every response: uvicorn's server, with the engine's requests
aborted at the grace period's end.

On SIGTERM uvicorn stops accepting connections and waits for the open requests to finish; at
its own deadline it cancels their tasks, which answers a whole request with a plain-text 500,
cuts a stream without its finish reason or `data: [DONE]`, and logs a traceback per request.
So the deadline the user sets (`--shutdown-timeout-s`) is the engine's, not uvicorn's:

    SIGTERM ........ shutdown_timeout_s ........ + ABORT_GRACE_S
    open requests    every request still          uvicorn cancels what is left
    run on           running is aborted through   (only a step slower than the grace
                     the engine                   period leaves anything)

An aborted request ends as any other: a whole response is the envelope with finish_reason
"abort", a stream sends its final chunk and `[DONE]`.

A model that cannot load stops the server too (`load_failure`, and `dspark serve` exits
non-zero): a server that stays up answering 503 for ever looks alive to a process supervisor
and hides the error in its log, where an exit lets the supervisor report and restart it.
"""

from __future__ import annotations

import socket

import uvicorn
from fastapi import FastAPI

# seconds from the abort to uvicorn's deadline: the abort reaches the engine at its next
# iteration (one step, seconds at most for a long prefill on the CPU), the final outputs
# come back and the responses are written
ABORT_GRACE_S = 10.0


class GracefulServer(uvicorn.Server):
    """uvicorn.Server whose shutdown aborts the engine's requests at `shutdown_timeout_s`."""

    def __init__(self, app: FastAPI, shutdown_timeout_s: float, **uvicorn_options) -> None:
        options = uvicorn_options | {
            "timeout_graceful_shutdown": shutdown_timeout_s + ABORT_GRACE_S
        }
        super().__init__(uvicorn.Config(app, **options))
        self.engine_loop = app.state.server.engine_loop
        self.shutdown_timeout_s = shutdown_timeout_s

    @property
    def load_failure(self) -> str | None:
        """Why the engine failed to load, if it did."""
        return self.engine_loop.load_failure

    async def on_tick(self, counter: int) -> bool:
        if self.load_failure is not None:
            self.should_exit = True
        return await super().on_tick(counter)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.engine_loop.drain(self.shutdown_timeout_s)
        await super().shutdown(sockets)
