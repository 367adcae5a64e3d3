"""One HTTP request's view of its engine requests: outputs in, coalesced updates out.

The engine reports each request cumulatively (the text and tokens so far), so when a consumer
falls behind only the latest output per choice matters: `updates()` drains whatever has
arrived and yields {choice index: latest output}. A slow client therefore gets several tokens
per chunk instead of a growing backlog, and nothing is lost or repeated: each chunk is the
difference between two cumulative outputs.

    arrived:  (0, "He")  (1, "A")  (0, "Hello")     -> one update {0: "Hello", 1: "A"}

`close()` is the one exit path (normal end, client gone, server error): it asks the engine to
abort every choice that has not finished, so a disconnected client's pages are freed at the
engine's next iteration.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from dspark.outputs import RequestOutput


class EngineFailed:
    """Delivered in place of an output when the engine stopped serving the request."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


Update = RequestOutput | EngineFailed


class RequestStream:
    def __init__(self, request_ids: list[str], abort: Callable[[list[str]], None]) -> None:
        self.request_ids = request_ids
        self._abort = abort
        self._queue: asyncio.Queue[tuple[int, Update]] = asyncio.Queue()
        self._ended: set[int] = set()  # choices whose final output (or failure) was consumed
        self._closed = False

    def put(self, index: int, update: Update) -> None:
        if not self._closed:
            self._queue.put_nowait((index, update))

    @property
    def is_done(self) -> bool:
        return len(self._ended) == len(self.request_ids)

    async def updates(self) -> AsyncIterator[dict[int, Update]]:
        """Yield the latest update per choice until every choice has ended."""
        while not self.is_done:
            index, update = await self._queue.get()
            batch = {index: update}
            while not self._queue.empty():
                index, update = self._queue.get_nowait()
                batch[index] = update  # cumulative: the newer output holds the older one
            for index, update in batch.items():
                if isinstance(update, EngineFailed) or update.finished:
                    self._ended.add(index)
            yield batch

    def close(self) -> None:
        """Abort the choices still running (idempotent; a no-op once all have ended)."""
        if self._closed:
            return
        self._closed = True
        unfinished = [rid for i, rid in enumerate(self.request_ids) if i not in self._ended]
        if unfinished:
            self._abort(unfinished)
