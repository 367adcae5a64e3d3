"""One HTTP generation request, from its body to its response: prompts -> engine requests ->
a whole response or a stream of SSE chunks.

A request with P prompts and n choices becomes P x n engine requests; choice i * n + j is
prompt i's j-th sample. Streaming sends, per chunk, what each choice gained since the last one
(several tokens when the client or the event loop fell behind: see request_stream.py) and ends
with an optional usage chunk and `data: [DONE]`.

Stop strings and streaming: the engine cuts a choice's text before a stop string once the
string is complete, but its first characters may have arrived a step earlier. So while a
choice with stop strings runs, its last (longest stop - 1) characters are held back:

    stop ["END"], text so far "abcEN"  -> sent "abc"; next step "abcEND" is cut to "abc": no
    character that the final text lacks was ever sent.

A failure while streaming one request (its engine died, or formatting it raised) ends that
request's unfinished choices with finish_reason "error" and an error event; other requests
are untouched. Non-streaming failures are answered with the error envelope.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request

from dspark.models.tokenizer import Tokenizer
from dspark.outputs import RequestOutput
from dspark.server.engine_loop import SubRequest
from dspark.server.errors import APIError, bad_request, error_body
from dspark.server.protocol import ChatCompletionRequest, CompletionRequest
from dspark.server.request_stream import EngineFailed, RequestStream
from dspark.server.responses import (
    ChatFormat,
    CompletionFormat,
    Delta,
    envelope,
    to_json,
    usage,
)

logger = logging.getLogger(__name__)


@dataclass
class Prepared:
    """A validated request, ready for the engine."""

    request_id: str
    subs: list[SubRequest]
    num_prompt_tokens: int  # once per prompt, not per choice (OpenAI's usage)
    fmt: CompletionFormat | ChatFormat
    stream: bool
    include_usage: bool
    holdback: int  # characters held back while a choice runs (see the module docstring)


def _encode_text(tokenizer: Tokenizer, text: str, param: str) -> list[int]:
    try:
        return tokenizer.encode(text)
    except Exception as e:  # noqa: BLE001 - unencodable text (lone surrogates) is bad input
        raise bad_request(f"{param} could not be tokenized: {e}", param) from None


def _holdback(body: CompletionRequest | ChatCompletionRequest) -> int:
    stops = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
    if not body.stream or not stops or body.include_stop_str_in_output:
        return 0
    return max(len(s) for s in stops) - 1


def _fan_out(
    body, request_id: str, prompts: list[tuple[list[int], str | None]], max_tokens, num_logprobs
) -> list[SubRequest]:
    params = [body.sampling_params(max_tokens, num_logprobs, j) for j in range(body.n)]
    return [
        SubRequest(f"{request_id}-{i * body.n + j}", ids, params[j], text)
        for i, (ids, text) in enumerate(prompts)
        for j in range(body.n)
    ]


def prepare_completion(body: CompletionRequest, tokenizer: Tokenizer) -> Prepared:
    body.check_supported()
    request_id = f"cmpl-{uuid.uuid4().hex}"
    prompts = []
    for prompt in body.prompts():
        if isinstance(prompt, str):
            prompts.append((_encode_text(tokenizer, prompt, "prompt"), prompt))
        else:
            prompts.append((list(prompt), None))
    subs = _fan_out(body, request_id, prompts, body.max_tokens, body.logprobs)
    fmt = CompletionFormat(tokenizer, body.return_token_ids, body.logprobs)
    return _prepared(body, request_id, subs, sum(len(ids) for ids, _ in prompts), fmt)


def prepare_chat(body: ChatCompletionRequest, tokenizer: Tokenizer) -> Prepared:
    body.check_supported()
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    try:
        ids = tokenizer.apply_chat_template(body.conversation(), body.add_generation_prompt)
    except Exception as e:  # noqa: BLE001 - the template's own checks (role order, ...)
        raise bad_request(
            f"messages could not be rendered by the chat template: {e}", "messages"
        ) from None
    subs = _fan_out(body, request_id, [(ids, None)], body.effective_max_tokens, body.num_logprobs)
    fmt = ChatFormat(tokenizer, body.return_token_ids, body.num_logprobs)
    return _prepared(body, request_id, subs, len(ids), fmt)


def _prepared(body, request_id, subs, num_prompt_tokens, fmt) -> Prepared:
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return Prepared(
        request_id, subs, num_prompt_tokens, fmt, body.stream, include_usage, _holdback(body)
    )


# ---- whole responses ------------------------------------------------------------------------


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def full_response(prep: Prepared, stream: RequestStream, request: Request, model: str):
    """Wait for every choice; a client that leaves first gets its requests aborted."""
    finals: dict[int, RequestOutput] = {}

    async def collect() -> None:
        async for batch in stream.updates():
            for index, update in batch.items():
                if isinstance(update, EngineFailed):
                    raise APIError(
                        503,
                        f"the engine stopped serving this request: {update.reason}",
                        code="engine_failed",
                    )
                if update.finished:
                    finals[index] = update

    watcher = asyncio.ensure_future(_until_disconnected(request))
    try:
        collector = asyncio.ensure_future(collect())
        await asyncio.wait({watcher, collector}, return_when=asyncio.FIRST_COMPLETED)
        if not collector.done():  # the client is gone: nobody reads the answer
            collector.cancel()
            return None
        collector.result()  # raises the collector's error, if any
    finally:
        watcher.cancel()
        stream.close()
    choices = [prep.fmt.choice(i, _whole(finals[i])) for i in sorted(finals)]
    body = envelope(prep.fmt.object_name, prep.request_id, int(time.time()), model, choices)
    body["usage"] = usage([finals[i] for i in sorted(finals)], prep.num_prompt_tokens)
    return body


def _whole(out: RequestOutput) -> Delta:
    c = out.outputs[0]
    return Delta(c.text, list(c.token_ids), c.logprobs, c.finish_reason, c.stop_reason)


# ---- streams --------------------------------------------------------------------------------


@dataclass
class _Cursor:
    """How much of one choice was already sent."""

    num_chars: int = 0
    num_tokens: int = 0
    is_started: bool = False
    is_ended: bool = False
    latest: RequestOutput | None = None


@dataclass
class StreamWriter:
    """A stream's SSE text: chunks are the envelope's fixed head, the choices' JSON, a tail.

    Most chunks carry new text only (not a first chunk, no finish, no per-token fields); those
    are rendered from the format's template, the rest from their dicts."""

    prep: Prepared
    model: str
    created: int = field(default_factory=lambda: int(time.time()))
    cursors: dict[int, _Cursor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        fmt = self.prep.fmt
        fixed = envelope(fmt.chunk_object_name, self.prep.request_id, self.created, self.model, [])
        del fixed["choices"]
        self._head = f'data: {to_json(fixed)[:-1]}, "choices": ['  # without its closing brace

    def sse(self, choices: list[str], usage_body: dict | None = None) -> str:
        """One event: the envelope around these choices' JSON (and the usage, if asked for)."""
        usage_text = f', "usage": {to_json(usage_body)}' if self.prep.include_usage else ""
        return f"{self._head}{', '.join(choices)}]{usage_text}}}\n\n"

    def delta(self, index: int, out: RequestOutput) -> str | None:
        """The choice's chunk for its newest output, or None when there is nothing to send."""
        cursor = self.cursors.get(index)
        if cursor is None:
            cursor = self.cursors[index] = _Cursor()
        cursor.latest = out
        c, fmt = out.outputs[0], self.prep.fmt
        end = (
            len(c.text) if out.finished else max(cursor.num_chars, len(c.text) - self.prep.holdback)
        )
        if cursor.is_started and not out.finished and not fmt.wants_tokens:
            if end == cursor.num_chars:
                return None
            chunk = fmt.text_delta_json(index, c.text[cursor.num_chars : end])
        else:
            delta = Delta(
                c.text[cursor.num_chars : end],
                list(c.token_ids[cursor.num_tokens :]),
                c.logprobs[cursor.num_tokens :] if c.logprobs is not None else None,
                c.finish_reason,
                c.stop_reason,
            )
            if not (delta.text or out.finished or (delta.token_ids and fmt.wants_tokens)):
                return None
            chunk = to_json(fmt.delta_choice(index, delta, is_first=not cursor.is_started))
        cursor.num_chars, cursor.num_tokens = end, len(c.token_ids)
        cursor.is_started, cursor.is_ended = True, out.finished
        return chunk

    def failed(self, reason: str) -> list[str]:
        """Every unfinished choice ends with finish_reason "error", then an error event."""
        indices = range(len(self.prep.subs))
        choices = [
            to_json(self.prep.fmt.delta_choice(i, Delta("", [], None, "error"), is_first=False))
            for i in indices
            if not self.cursors.get(i, _Cursor()).is_ended
        ]
        error = error_body(500, reason, code="request_failed")
        return [self.sse(choices), f"data: {json.dumps(error)}\n\n"]

    def usage_chunk(self) -> str:
        outputs = [c.latest for c in self.cursors.values() if c.latest is not None]
        return self.sse([], usage(outputs, self.prep.num_prompt_tokens))


async def stream_response(prep: Prepared, stream: RequestStream, model: str) -> AsyncIterator[str]:
    """SSE text for one request; closing it (client gone) aborts what is still running."""
    writer = StreamWriter(prep, model)
    try:
        try:
            async for batch in stream.updates():
                failure = next((u for u in batch.values() if isinstance(u, EngineFailed)), None)
                if failure is not None:
                    raise RuntimeError(f"the engine stopped serving this request: {failure.reason}")
                choices = [writer.delta(i, out) for i, out in sorted(batch.items())]
                choices = [c for c in choices if c is not None]
                if choices:
                    yield writer.sse(choices)
        except Exception as e:  # noqa: BLE001 - this request fails alone; others go on
            logger.exception("request %s failed while streaming", prep.request_id)
            stream.close()
            for text in writer.failed(f"{type(e).__name__}: {e}"):
                yield text
        if prep.include_usage:
            yield writer.usage_chunk()
        yield "data: [DONE]\n\n"
    finally:
        stream.close()
