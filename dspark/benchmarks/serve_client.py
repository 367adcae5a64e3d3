"""One streamed request against an OpenAI-compatible server, timed chunk by chunk.

    sent ──── TTFT ────> first text chunk ── ITL ──> chunk ── ITL ──> ... last chunk ─> [DONE]
    └──────────────────────────────── e2e ──────────────────────────────────────────┘

TTFT is the time to the first chunk carrying text; ITL the gaps between later text chunks (a
server that sends several tokens per chunk has fewer, longer gaps, as in vLLM's bench); TPOT is
(e2e - TTFT) / (output tokens - 1), with the output tokens from the usage chunk when the server
sends one (stream_options.include_usage), else one per text chunk.

The load generator must cost less per event than the server it measures. httpx spends about
40 us of CPU per SSE event (its line iterator over httpcore, h11 and anyio), which capped one
client process near 25k events/s on a 2-core VM, below the server it was measuring. So the
streams go over a minimal HTTP/1.1 client: one keep-alive connection per request in flight, an
asyncio.Protocol that parses the chunked body from whole socket reads and stamps every event of
a read with the read's arrival time (about 8 us per event). It speaks what the bench needs and
no more: a JSON POST, a chunked or sized response, http or https.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit

CONNECT_TIMEOUT_S = 30.0


@dataclass
class RequestRecord:
    ok: bool = False
    error: str | None = None
    start: float = 0.0  # perf_counter when sent (on Linux the server's time.monotonic clock)
    sent: float | None = None  # ... once its bytes were written (a connection had to be had)
    response_id: str | None = None  # the chunks' "id": the server's request id
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2e: float | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None
    finish_reason: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def chunk_text(chunk: dict) -> str:
    """The text of a completions or chat chunk's first choice ('' when it has none)."""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    return choice.get("text") or ""


class HTTPConnection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; one request at a time.

    The bytes of a response are parsed as they arrive: the head (status, headers), then the
    body, chunked or of a declared length. The body is split into server-sent events; their
    `data:` payloads wait in `_events` with their arrival time until `events()` takes them.
    """

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._waiter: asyncio.Future | None = None
        self._error: Exception | None = None
        self._reset()

    def _reset(self) -> None:
        self._buffer = bytearray()  # received, not yet parsed
        self._body = bytearray()  # body bytes not yet split into events
        self._events: list[tuple[float, bytes]] = []
        self.status: int | None = None
        self._is_chunked = False
        self._remaining = 0  # body bytes still due (a sized body)
        self._keep_alive = True
        self.is_complete = False

    # ---- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        self._parse(time.perf_counter())
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.is_complete:
            self._error = exc or ConnectionResetError("the server closed the connection")
        self.transport = None
        self._wake()

    # ---- the caller's side --------------------------------------------------------------------

    @property
    def is_reusable(self) -> bool:
        return self.transport is not None and self.is_complete and self._keep_alive

    def post(self, host: str, path: str, body: bytes, headers: dict[str, str]) -> None:
        self._reset()
        lines = [
            f"POST {path} HTTP/1.1",
            f"Host: {host}",
            "Content-Type: application/json",
            f"Content-Length: {len(body)}",
            *(f"{k}: {v}" for k, v in headers.items()),
        ]
        self.transport.write("\r\n".join(lines).encode() + b"\r\n\r\n" + body)

    async def wait_status(self) -> int:
        while self.status is None:
            await self._wait()
        return self.status

    async def read_body(self) -> bytes:
        """The whole body (of a response that is not a stream of events)."""
        while not self.is_complete:
            await self._wait()
        return bytes(self._body)

    async def events(self) -> AsyncIterator[tuple[float, bytes]]:
        """(arrival time, data payload) of every event, until the response ends."""
        while True:
            events, self._events = self._events, []
            for event in events:
                yield event
            if self.is_complete:
                return
            await self._wait()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    # ---- parsing ------------------------------------------------------------------------------

    async def _wait(self) -> None:
        if self._error is not None:
            raise self._error
        self._waiter = asyncio.get_running_loop().create_future()
        await self._waiter
        if self._error is not None:
            raise self._error

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _parse(self, now: float) -> None:
        buffer = self._buffer
        while not self.is_complete:
            if self.status is None:
                end = buffer.find(b"\r\n\r\n")
                if end < 0:
                    return
                self._read_head(bytes(buffer[:end]))
                del buffer[: end + 4]
            elif self._is_chunked:  # "<hex size>\r\n<data>\r\n" ... "0\r\n\r\n"
                end = buffer.find(b"\r\n")
                if end < 0:
                    return
                size = int(buffer[:end].split(b";")[0], 16)
                if len(buffer) < end + 2 + size + 2:
                    return
                self._add_body(buffer[end + 2 : end + 2 + size], now)
                del buffer[: end + 4 + size]
                self.is_complete = size == 0
            else:
                taken = buffer[: self._remaining]
                self._remaining -= len(taken)
                del buffer[: len(taken)]
                self._add_body(taken, now)
                self.is_complete = self._remaining == 0
                return

    def _read_head(self, head: bytes) -> None:
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        self.status = int(status_line.split(" ", 2)[1])
        headers = {}
        for line in header_lines:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip().lower()
        self._is_chunked = "chunked" in headers.get("transfer-encoding", "")
        self._remaining = int(headers.get("content-length", 0))
        self._keep_alive = headers.get("connection") != "close"
        self.is_complete = not self._is_chunked and self._remaining == 0

    def _add_body(self, data: bytearray, now: float) -> None:
        """Body bytes; each complete event's `data: ` lines become payloads."""
        body = self._body
        body += data
        while (end := body.find(b"\n\n")) >= 0:
            for line in body[:end].split(b"\n"):
                if line.startswith(b"data: "):
                    self._events.append((now, bytes(line[6:])))
            del body[: end + 2]


class ConnectionPool:
    """Keep-alive connections to one server, reused as requests finish."""

    def __init__(self, base_url: str) -> None:
        parts = urlsplit(base_url)
        self.host, self.is_tls = parts.hostname or "127.0.0.1", parts.scheme == "https"
        self.port = parts.port or (443 if self.is_tls else 80)
        self.netloc = parts.netloc
        self._idle: list[HTTPConnection] = []

    async def acquire(self) -> HTTPConnection:
        while self._idle:
            connection = self._idle.pop()
            if connection.transport is not None:
                return connection
        return await self._connect()

    async def _connect(self) -> HTTPConnection:
        tls = ssl.create_default_context() if self.is_tls else None
        connect = asyncio.get_running_loop().create_connection(
            HTTPConnection, self.host, self.port, ssl=tls
        )
        _, connection = await asyncio.wait_for(connect, CONNECT_TIMEOUT_S)
        return connection

    async def fill(self, num_connections: int) -> int:
        """Open connections until this many are idle; returns how many were opened (one that
        fails is left to the request that needs it, which records the error).

        A level runs with its clients connected: C connections opened together cost the
        load generator's event loop ~0.1 ms each (18-27 ms for 256 on the 2-core development
        VM, before the first request is written), which is the client's cost, not the
        server's, and a level after a smaller one would otherwise find some already open."""
        self._idle = [c for c in self._idle if c.transport is not None]
        missing = num_connections - len(self._idle)
        if missing <= 0:
            return 0
        opened = await asyncio.gather(
            *(self._connect() for _ in range(missing)), return_exceptions=True
        )
        connections = [c for c in opened if isinstance(c, HTTPConnection)]
        self._idle.extend(connections)
        return len(connections)

    def release(self, connection: HTTPConnection) -> None:
        if connection.is_reusable:
            self._idle.append(connection)
        else:
            connection.close()

    def close(self) -> None:
        for connection in self._idle:
            connection.close()
        self._idle.clear()


async def stream_request(
    pool: ConnectionPool, path: str, payload: dict, headers: dict[str, str]
) -> RequestRecord:
    """POST one streaming request and time it; failures are recorded, never raised."""
    record = RequestRecord(start=time.perf_counter())
    connection = None
    try:
        connection = await pool.acquire()
        connection.post(pool.netloc, path, json.dumps(payload).encode(), headers)
        record.sent = time.perf_counter()
        if await connection.wait_status() != 200:
            body = (await connection.read_body()).decode(errors="replace")
            record.error = f"HTTP {connection.status}: {body[:200]}"
            return record
        await _read_stream(connection, record)
    except (OSError, ValueError, asyncio.TimeoutError) as e:  # JSONDecodeError is a ValueError
        record.error = f"{type(e).__name__}: {e}"
        return record
    finally:
        if connection is not None:
            pool.release(connection)
    return record


async def _read_stream(connection: HTTPConnection, record: RequestRecord) -> None:
    last, num_text_chunks = record.start, 0
    async for now, data in connection.events():
        if data == b"[DONE]":
            continue  # the response ends right after it
        chunk = json.loads(data)
        record.response_id = record.response_id or chunk.get("id")
        if "error" in chunk:
            record.error = str(chunk["error"].get("message"))
            return
        if chunk_text(chunk):
            if record.ttft is None:
                record.ttft = now - record.start
            else:
                record.itl.append(now - last)
            last = now
            num_text_chunks += 1
        for choice in chunk.get("choices") or []:
            record.finish_reason = choice.get("finish_reason") or record.finish_reason
        if chunk.get("usage"):
            record.output_tokens = chunk["usage"].get("completion_tokens", 0)
            record.prompt_tokens = chunk["usage"].get("prompt_tokens")
    record.e2e = time.perf_counter() - record.start
    record.output_tokens = record.output_tokens or num_text_chunks
    record.ok = record.finish_reason not in (None, "error")
    if not record.ok:
        record.error = f"finish_reason {record.finish_reason!r}"
