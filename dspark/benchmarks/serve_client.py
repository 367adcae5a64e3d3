"""One streamed request against an OpenAI-compatible server, timed chunk by chunk.

    sent ──── TTFT ────> first text chunk ── ITL ──> chunk ── ITL ──> ... last chunk ─> [DONE]
    └──────────────────────────────── e2e ──────────────────────────────────────────┘

TTFT is the time to the first chunk carrying text; ITL the gaps between later text chunks (a
server that sends several tokens per chunk has fewer, longer gaps, as in vLLM's bench); TPOT is
(e2e - TTFT) / (output tokens - 1), with the output tokens from the usage chunk when the server
sends one (stream_options.include_usage), else one per text chunk.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class RequestRecord:
    ok: bool = False
    error: str | None = None
    start: float = 0.0  # perf_counter when sent
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


async def stream_request(
    client: httpx.AsyncClient, url: str, payload: dict, headers: dict[str, str]
) -> RequestRecord:
    """POST one streaming request and time it; failures are recorded, never raised."""
    record = RequestRecord(start=time.perf_counter())
    last = record.start
    num_text_chunks = 0
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                record.error = f"HTTP {response.status_code}: {body[:200]}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    record.error = str(chunk["error"].get("message"))
                    return record
                now = time.perf_counter()
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
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        record.error = f"{type(e).__name__}: {e}"
        return record
    record.e2e = time.perf_counter() - record.start
    record.output_tokens = record.output_tokens or num_text_chunks
    record.ok = record.finish_reason not in (None, "error")
    if not record.ok:
        record.error = f"finish_reason {record.finish_reason!r}"
    return record
