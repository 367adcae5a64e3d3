"""The FastAPI application: routes, authentication, and the engine's lifetime.

    POST /v1/completions        POST /v1/chat/completions    (API key checked, if one is set:
    GET  /v1/models                                            auth.py, before the body is read)
    POST /tokenize              POST /detokenize             (likewise; at the root, as vLLM's:
                                                               tokenize.py)
    GET  /health                200 serving, 503 loading / stopping / dead (with the reason)
    GET  /metrics               Prometheus text (metrics.py; the key checked if asked for)
    GET  /version

The engine is built by its own process when the application starts (engine_loop.py,
engine_process.py), so the server answers /health while a large model loads; generation routes
answer 503 until it is ready. On shutdown (SIGTERM: open requests may finish for up to
ServerConfig.shutdown_timeout_s, then the engine aborts those left, so each still ends with its
final output: shutdown.py) the engine process aborts whatever is left and exits.
"""

from __future__ import annotations

import cProfile
import os
import time
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from multiprocessing.connection import Connection

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse

import dspark
from dspark import envs
from dspark.server.auth import ApiKeyMiddleware
from dspark.server.body_limit import BodyLimitMiddleware
from dspark.server.config import ServerConfig
from dspark.server.engine_loop import EngineLoop, EngineState
from dspark.server.engine_process import report_profile
from dspark.server.errors import APIError, bad_request, error_responses, install_error_handlers
from dspark.server.event_stream import EventStreamResponse
from dspark.server.metrics import ServerMetrics
from dspark.server.protocol import ChatCompletionRequest, CompletionRequest
from dspark.server.request_trace import SCOPE_KEY, StampMiddleware, tracer_from_env
from dspark.server.serving import (
    Prepared,
    base_request_id,
    full_response,
    prepare_chat,
    prepare_completion,
    stream_response,
)
from dspark.server.tokenize import DetokenizeRequest, TokenizeRequest, detokenize, tokenize

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# /openapi.json for the generation routes: a JSON body, or with "stream": true server-sent events
GENERATION_RESPONSES = {
    200: {"content": {"application/json": {}, "text/event-stream": {"schema": {"type": "string"}}},
          "description": "the whole response, or with stream: true its chunks as SSE"},
    **error_responses(400, 401, 404, 413, 503),
}  # fmt: skip


class ServerState:
    """What the routes share: the config, the engine loop and the metrics."""

    def __init__(self, config: ServerConfig, engine_factory: Callable) -> None:
        self.config = config
        self.metrics = ServerMetrics(config.served_model_name)
        self.tracer = tracer_from_env()  # DSPARK_REQUEST_TRACE: per-request timestamps
        self.engine_loop = EngineLoop(
            engine_factory,
            config.max_queued_requests,
            config.max_queued_tokens,
            stream_budget=config.stream_budget,
            decode_streams=config.stream_detokenize == "server",
        )
        self.created = int(time.time())

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.served_model_name:
            raise APIError(
                404,
                f"the model {model!r} does not exist; this server serves "
                f"{self.config.served_model_name!r}",
                "model",
                "model_not_found",
            )


def build_app(
    config: ServerConfig,
    engine_factory: Callable | None,
    *,
    other_servers: tuple[Connection, ...] = (),
    attach: Connection | None = None,
    before_stop: Callable[[], Awaitable[None]] | None = None,
) -> FastAPI:
    """engine_factory builds the LLMEngine in the engine process: it must pickle (a module
    function or a functools.partial of one, e.g. engine_process.engine_factory(config)).

    With `--api-server-count` (api_servers.py) the main server's app also hands the engine
    the pipes of the other API processes (`other_servers`) and stops them first at shut-down
    (`before_stop`); each of those attaches to the engine through its pipe (`attach`, no
    factory)."""
    state = ServerState(config, engine_factory)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # DSPARK_SERVER_PROFILE: the process under cProfile from start-up to shut-down
        # (uvicorn re-raises SIGTERM once this returns, so the report is written here)
        profile_path = envs.ENVS.server_profile
        profiler = cProfile.Profile() if profile_path else None
        if profiler is not None:
            profiler.enable()
        if attach is not None:
            state.engine_loop.attach(attach)
        else:
            state.engine_loop.start(other_servers)
        yield
        if before_stop is not None:
            await before_stop()
        await state.engine_loop.stop()
        if state.tracer is not None:
            state.tracer.close()
        if profiler is not None:
            profiler.disable()
            report_profile(profiler, profile_path, "the server process")

    app = FastAPI(title="dspark", version=dspark.__version__, lifespan=lifespan)
    app.state.server = state
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_request_bytes)
    if config.api_key:  # (outside the body's limit: a request without the key is not read)
        app.add_middleware(
            ApiKeyMiddleware, api_key=config.api_key,
            protect_metrics=config.require_api_key_for_metrics,
        )  # fmt: skip
    # outside the key's check: a browser's preflight (OPTIONS) carries no key, and a 401
    # needs the CORS headers for the page to read it
    app.add_middleware(
        CORSMiddleware, allow_origins=config.allowed_origins,
        allow_methods=config.allowed_methods, allow_headers=config.allowed_headers,
        allow_credentials=config.allow_credentials,
    )  # fmt: skip
    if state.tracer is not None:  # (added last: the outermost, called first)
        app.add_middleware(StampMiddleware)
    _add_generation_routes(app, state)
    _add_info_routes(app, state)
    return app


def _add_generation_routes(app: FastAPI, state: ServerState) -> None:
    loop = state.engine_loop

    async def run(prep_fn, body, request: Request):
        arrival = time.monotonic()  # (vLLM's arrival time: the latency metrics start here)
        state.check_model(body.model)
        base_id = base_request_id(request.headers.get("x-request-id"))
        try:
            loop.check_serving()
            prep: Prepared = prep_fn(body, loop.info.tokenizer, base_id)
            if loop.is_routed(prep.subs[0].request_id):
                raise bad_request(
                    f"the X-Request-Id {base_id!r} is the id of a request still running; "
                    "send a unique one", "X-Request-Id",
                )  # fmt: skip
            trace = None
            if state.tracer is not None and prep.stream:
                trace = {"id": prep.request_id, "pid": os.getpid(),
                         "asgi": request.scope.get(SCOPE_KEY)}  # fmt: skip
            stream = await loop.submit(prep.subs, arrival)
            if trace is not None:
                trace["acked"] = time.monotonic()
        except APIError as e:
            if e.status == 503 and not loop.count_rejected(reason := e.code or "unavailable"):
                state.metrics.rejected_here[reason] += 1
            raise
        model, id_header = state.config.served_model_name, {"X-Request-Id": base_id}
        if prep.stream:
            events = stream_response(prep, stream, model, trace, state.tracer)
            return EventStreamResponse(events, stream.close, SSE_HEADERS | id_header)
        result = await full_response(prep, stream, request, model)
        if result is None:
            return JSONResponse({}, status_code=499)
        return JSONResponse(result, headers=id_header)

    @app.post("/v1/completions", responses=GENERATION_RESPONSES)
    async def completions(body: CompletionRequest, request: Request):
        return await run(prepare_completion, body, request)

    @app.post("/v1/chat/completions", responses=GENERATION_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await run(prepare_chat, body, request)

    @app.get("/v1/models", responses=error_responses(401))
    async def models():
        info = loop.info
        card = {
            "id": state.config.served_model_name,
            "object": "model",
            "created": state.created,
            "owned_by": "dspark",
            "max_model_len": info.max_model_len if info is not None else None,
        }
        return {"object": "list", "data": [card]}

    @app.post("/tokenize", responses=error_responses(400, 401, 404, 503))
    async def tokenize_route(body: TokenizeRequest):
        state.check_model(body.model)
        loop.check_serving()
        return tokenize(body, loop.info.tokenizer, loop.info.max_model_len)

    @app.post("/detokenize", responses=error_responses(400, 401, 404, 503))
    async def detokenize_route(body: DetokenizeRequest):
        state.check_model(body.model)
        loop.check_serving()
        return detokenize(body, loop.info.tokenizer)


def _add_info_routes(app: FastAPI, state: ServerState) -> None:
    loop = state.engine_loop

    @app.get("/health")
    async def health():
        if loop.state == EngineState.SERVING:
            return {"status": "serving"}
        body = {"status": loop.state.value, "reason": loop.failure}
        return JSONResponse(body, status_code=503)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        text = state.metrics.render(loop.stats, loop.state.value)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.get("/version")
    async def version():
        return {"version": dspark.__version__}
