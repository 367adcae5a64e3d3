"""Per-request timestamps of a served stream, for finding where its time goes
(DSPARK_REQUEST_TRACE=path; off by default).

The engine's own latency metrics start when it adds a request, so they cannot see the HTTP
side: at 256 streams on the H200 a request waited ~100 ms before its handler ran, against 17-36
ms of engine time to first token. With the variable set,
each API process writes one JSON line per finished stream to `path.PID`, on the monotonic
clock, which on Linux is also `dspark bench serve --save-requests`' clock, so
bench/serving.py phases joins both by the response id:

    {"id": "cmpl-...", "pid": 4242,
     "asgi": 10.000,       the app was called (the outermost middleware)
     "arrival": 10.001,    the handler ran (the arrival time the engine's metrics start at)
     "added": 10.002,      the engine added it             (the engine's clock: same machine)
     "acked": 10.052,      the engine acknowledged the request (the handler may answer now)
     "first_token": 10.030,
     "first_chunk": 10.060, the first chunk with content was handed to the server
     "finished": 10.600,   the engine finished it
     "last_chunk": 10.610} the stream's last chunk was handed to the server
"""

from __future__ import annotations

import json
import os
import time

from dspark import envs

SCOPE_KEY = "dspark.asgi_time"  # where StampMiddleware puts the app's call time


class RequestTracer:
    """Appends one line per traced request to this process's file."""

    def __init__(self, path: str) -> None:
        self.path = f"{path}.{os.getpid()}"
        self._file = open(self.path, "a", buffering=1 << 16)  # noqa: SIM115 - closed at stop

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._file.close()


def tracer_from_env() -> RequestTracer | None:
    """A tracer writing to DSPARK_REQUEST_TRACE (dspark/envs.py), None when it is unset."""
    path = envs.ENVS.request_trace
    return RequestTracer(path) if path else None


class StampMiddleware:
    """The outermost middleware while tracing: the time the app was called, in the scope."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        scope[SCOPE_KEY] = time.monotonic()
        await self.app(scope, receive, send)
