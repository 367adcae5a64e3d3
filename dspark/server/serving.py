"""One HTTP generation request, from its body to its response: prompts -> engine requests ->
a whole response or a stream of SSE chunks.

A request with P prompts and n choices becomes P x n engine requests; choice i * n + j is
prompt i's j-th sample. Streaming requests are "delta" engine requests: each chunk sends what a
choice gained since the last one (several steps' worth when the client or the event loop fell
behind: see request_stream.py), and the stream ends with an optional usage chunk and
`data: [DONE]`. (Text a stop string might still cut is held back by the engine:
dspark/engine/delta.py.) Whole responses are "final_only": one output per choice, at its end.

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
from dspark.outputs import DeltaOutput, FinalInfo
from dspark.sampling_params import StructuredOutputsParams
from dspark.server.engine_loop import SubRequest
from dspark.server.errors import APIError, bad_request, error_body
from dspark.server.prompt_logprobs import PromptLogprobs
from dspark.server.protocol import ChatCompletionRequest, CompletionRequest
from dspark.server.request_stream import EngineFailed, RequestStream
from dspark.server.request_trace import RequestTracer
from dspark.server.responses import (
    ChatFormat,
    CompletionFormat,
    Delta,
    envelope,
    to_json,
    usage,
)
from dspark.server.structured_outputs import requested_constraint
from dspark.server.tool_calls import tool_calling

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


def _encode_text(tokenizer: Tokenizer, text: str, param: str) -> list[int]:
    try:
        return tokenizer.encode(text)
    except Exception as e:  # noqa: BLE001 - unencodable text (lone surrogates) is bad input
        raise bad_request(f"{param} could not be tokenized: {e}", param) from None


def _fan_out(
    body,
    request_id: str,
    prompts: list[tuple[list[int], str | None]],
    max_tokens,
    num_logprobs,
    constraint: StructuredOutputsParams | None,
) -> list[SubRequest]:
    params = [body.sampling_params(max_tokens, num_logprobs, j, constraint) for j in range(body.n)]
    return [
        SubRequest(f"{request_id}-{i * body.n + j}", ids, params[j], text)
        for i, (ids, text) in enumerate(prompts)
        for j in range(body.n)
    ]


MAX_REQUEST_ID_CHARS = 128


def base_request_id(header: str | None) -> str:
    """The request's id: the client's X-Request-Id if it sent one (printable ASCII without
    spaces, at most MAX_REQUEST_ID_CHARS, so it can be logged and echoed as it came), else a
    fresh one. The response's "id" is it behind the object's prefix (cmpl-, chatcmpl-), as
    vLLM's; its engine requests add the choice's index."""
    if header is None:
        return uuid.uuid4().hex
    if not 1 <= len(header) <= MAX_REQUEST_ID_CHARS or not all("!" <= c <= "~" for c in header):
        raise bad_request(
            f"the X-Request-Id header must be 1 to {MAX_REQUEST_ID_CHARS} printable ASCII "
            f"characters without spaces, got {header[:MAX_REQUEST_ID_CHARS]!r}",
            "X-Request-Id",
        )
    return header


def prepare_completion(body: CompletionRequest, tokenizer: Tokenizer, base_id: str) -> Prepared:
    body.check_supported()
    request_id = f"cmpl-{base_id}"
    prompts = []
    for prompt in body.prompts():
        if isinstance(prompt, str):
            prompts.append((_encode_text(tokenizer, prompt, "prompt"), prompt))
        else:
            prompts.append((list(prompt), None))
    requested = requested_constraint(body.response_format, body.structured_outputs)
    constraint = requested[0] if requested else None
    subs = _fan_out(body, request_id, prompts, body.max_tokens, body.logprobs, constraint)
    echo = None
    if body.echo:  # (a token-id prompt echoes as its text)
        echo = [text if text is not None else tokenizer.decode(ids, skip_special_tokens=False)
                for ids, text in prompts]  # fmt: skip
    prompt_logprobs = _prompt_logprobs(body, tokenizer)
    fmt = CompletionFormat(tokenizer, body.return_token_ids, body.logprobs, echo, body.n,
                           prompt_logprobs, [ids for ids, _ in prompts])  # fmt: skip
    return _prepared(body, request_id, subs, sum(len(ids) for ids, _ in prompts), fmt)


def _prompt_logprobs(body, tokenizer: Tokenizer) -> PromptLogprobs | None:
    computed = body.engine_prompt_logprobs
    if computed is None:
        return None

    def text(token_id: int) -> str:
        return tokenizer.decode([token_id], skip_special_tokens=False)

    return PromptLogprobs(computed, body.prompt_logprobs, text)


def prepare_chat(body: ChatCompletionRequest, tokenizer: Tokenizer, base_id: str) -> Prepared:
    body.check_supported()
    request_id = f"chatcmpl-{base_id}"
    tools = tool_calling(body.tools, body.tool_choice, body.parallel_tool_calls)
    requested = requested_constraint(body.response_format, body.structured_outputs)
    constraint = tools.constraint() if tools is not None else None
    if constraint is not None and requested is not None:
        raise bad_request(
            f"tool_choice {tools.mode!r} holds the output to tool calls; it cannot be combined "
            f"with {requested[1]} (which 'auto' and 'none' allow)",
            "tool_choice",
        )
    constraint = constraint or (requested[0] if requested else None)
    ids = _render_chat(body, tokenizer, body.template_kwargs())
    if tools is not None and tools.mode == "auto":
        if ids == _render_chat(body, tokenizer, body.template_kwargs(with_tools=False)):
            raise bad_request(
                "tools: the model's chat template does not render tools (it has no tool "
                "format), so with tool_choice 'auto' the model would never see them; use "
                "tool_choice 'required' or a named function (which hold the output to a call), "
                "or a model whose template renders tools",
                "tools",
            )
    subs = _fan_out(body, request_id, [(ids, None)], body.effective_max_tokens, body.num_logprobs,
                    constraint)  # fmt: skip
    fmt = ChatFormat(tokenizer, body.return_token_ids, body.num_logprobs,
                     _prompt_logprobs(body, tokenizer), [ids], tools)  # fmt: skip
    return _prepared(body, request_id, subs, len(ids), fmt)


def _render_chat(body: ChatCompletionRequest, tokenizer: Tokenizer, kwargs: dict) -> list[int]:
    try:
        return tokenizer.apply_chat_template(body.conversation(), body.add_generation_prompt,
                                             kwargs)  # fmt: skip
    except Exception as e:  # noqa: BLE001 - the template's own checks (role order, ...)
        raise bad_request(
            f"messages could not be rendered by the chat template: {e}", "messages"
        ) from None


def _prepared(body, request_id, subs, num_prompt_tokens, fmt) -> Prepared:
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return Prepared(request_id, subs, num_prompt_tokens, fmt, body.stream, include_usage)


# ---- whole responses ------------------------------------------------------------------------


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def full_response(prep: Prepared, stream: RequestStream, request: Request, model: str):
    """Wait for every choice; a client that leaves first gets its requests aborted."""
    finals: dict[int, DeltaOutput] = {}  # each choice's one output, all of it

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
    wholes = [_whole(finals[i], stream.prompt_logprobs.get(i)) for i in sorted(finals)]
    choices = [prep.fmt.choice(i, whole) for i, whole in zip(sorted(finals), wholes, strict=True)]
    body = envelope(prep.fmt.object_name, prep.request_id, int(time.time()), model, choices)
    body.update(prep.fmt.response_fields(wholes))
    body["usage"] = usage([finals[i].final for i in sorted(finals)], prep.num_prompt_tokens)
    return body


def _whole(out: DeltaOutput, prompt_logprobs: list | None) -> Delta:
    final = out.final
    return Delta(out.text, out.token_ids, out.logprobs, final.finish_reason, final.stop_reason,
                 prompt_logprobs)  # fmt: skip


# ---- streams --------------------------------------------------------------------------------


@dataclass
class _Cursor:
    """Where one choice's stream is."""

    is_started: bool = False
    is_ended: bool = False
    final: FinalInfo | None = None  # for the usage chunk


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

    def delta(self, index: int, out: DeltaOutput) -> str | None:
        """The choice's chunk for what it gained, or None when there is nothing to send."""
        cursor = self.cursors.get(index)
        if cursor is None:
            cursor = self.cursors[index] = _Cursor()
        final, fmt = out.final, self.prep.fmt
        if cursor.is_started and final is None and not fmt.wants_tokens and fmt.streams_text_as_is:
            if not out.text:
                return None
            chunk = fmt.text_delta_json(index, out.text)
        else:
            reason, stop_reason = (
                (final.finish_reason, final.stop_reason) if final else (None, None)
            )
            delta = Delta(out.text, out.token_ids, out.logprobs, reason, stop_reason)
            if not (delta.text or final or (delta.token_ids and fmt.wants_tokens)):
                return None
            body = fmt.delta_choice(index, delta, is_first=not cursor.is_started)
            if body is None:  # (its text held back: tool calling)
                return None
            chunk = to_json(body)
        cursor.is_started, cursor.is_ended, cursor.final = True, final is not None, final
        return chunk

    def trailing(self) -> str:
        """The event due after the current one (a tool call's finish), or ""."""
        choices = self.prep.fmt.take_trailing()
        return self.sse([to_json(choice) for choice in choices]) if choices else ""

    def failed(self, reason: str) -> str:
        """Every unfinished choice ends with finish_reason "error", then an error event."""
        indices = range(len(self.prep.subs))
        choices = [
            to_json(self.prep.fmt.delta_choice(i, Delta("", [], None, "error"), is_first=False))
            for i in indices
            if not self.cursors.get(i, _Cursor()).is_ended
        ]
        error = error_body(500, reason, code="request_failed")
        return f"{self.sse(choices)}{self.trailing()}data: {json.dumps(error)}\n\n"

    def usage_chunk(self) -> str:
        finals = [c.final for c in self.cursors.values() if c.final is not None]
        return self.sse([], usage(finals, self.prep.num_prompt_tokens))


async def stream_response(
    prep: Prepared,
    stream: RequestStream,
    model: str,
    trace: dict | None = None,
    tracer: RequestTracer | None = None,
) -> AsyncIterator[str]:
    """SSE text for one request; closing it (client gone) aborts what is still running.
    `trace` (DSPARK_REQUEST_TRACE): the request's timestamps so far, completed here and
    written by `tracer` when the stream ends."""
    writer = StreamWriter(prep, model)
    last = ""  # the last choices' event, sent with the usage and [DONE] in one write
    try:
        try:
            async for batch in stream.updates():
                failure = next((u for u in batch.values() if isinstance(u, EngineFailed)), None)
                if failure is not None:
                    raise RuntimeError(f"the engine stopped serving this request: {failure.reason}")
                choices = [writer.delta(i, out) for i, out in sorted(batch.items())]
                choices = [c for c in choices if c is not None]
                if trace is not None:
                    _trace_batch(trace, batch, bool(choices))
                if choices and stream.is_done:
                    last = writer.sse(choices) + writer.trailing()
                elif choices:
                    yield writer.sse(choices) + writer.trailing()
        except Exception as e:  # noqa: BLE001 - this request fails alone; others go on
            logger.exception("request %s failed while streaming", prep.request_id)
            stream.close()
            last += writer.failed(f"{type(e).__name__}: {e}")
        # each yield is one write through h11 and the socket (some 30-50 us of the event
        # loop's time): the stream's end goes out as one
        usage_chunk = writer.usage_chunk() if prep.include_usage else ""
        yield f"{last}{usage_chunk}data: [DONE]\n\n"
        if trace is not None:
            trace["last_chunk"] = time.monotonic()
            tracer.write(trace)
    finally:
        stream.close()


def _trace_batch(trace: dict, batch: dict, has_chunk: bool) -> None:
    """The first chunk's time, and the engine's times from the first choice to end."""
    if has_chunk and "first_chunk" not in trace:
        trace["first_chunk"] = time.monotonic()
    for update in batch.values():
        final = getattr(update, "final", None)
        if final is not None and "arrival" not in trace:
            m = final.metrics
            trace.update(arrival=m["arrival_time"], added=m.get("added_time"),
                         first_token=m.get("first_token_time"),
                         finished=m.get("finished_time"))  # fmt: skip
