"""A streamed response of server-sent events, with one asyncio task watching for the client
leaving.

Starlette's StreamingResponse, under an ASGI server of spec 2.3 (uvicorn: a send after the
client left returns silently rather than raising), runs the body and a disconnect listener in
an anyio task group: a cancel scope, a spawned task and the current-task lookups anyio makes at
each checkpoint, per request. This response does the same job with a plain watcher task:

    watcher:  receive() ... "http.disconnect"  -> on_close()  (aborts the engine requests now;
                                                  the stream's updates end, so does the body)
    request:  headers, one body message per event, the end           -> on_close() (idempotent)

The watcher also sees "http.disconnect" once the response is complete (uvicorn answers
receive() so then); by that time on_close has nothing left to abort.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Mapping

from starlette.responses import Response
from starlette.types import Receive, Scope, Send


class EventStreamResponse(Response):
    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncGenerator[str, None],
        on_close: Callable[[], None],  # called once the client left or the stream ended
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.events = events
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watcher = asyncio.ensure_future(self._close_on_disconnect(receive))
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": self.raw_headers})  # fmt: skip
            async for event in self.events:
                await send({"type": "http.response.body", "body": event.encode(),
                            "more_body": True})  # fmt: skip
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            watcher.cancel()
            self.on_close()
            await self.events.aclose()  # (a send that raised left it suspended: run its finally)

    async def _close_on_disconnect(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.on_close()
