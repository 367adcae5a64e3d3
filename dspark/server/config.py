"""`ServerConfig`: the HTTP side's settings (the engine's are an EngineConfig), validated once."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_HOST = "127.0.0.1"  # loopback: exposing the server is an explicit choice (--host)
DEFAULT_PORT = 8000
STREAM_DETOKENIZE = ("server", "engine")
MAX_API_SERVERS = 64


@dataclass(frozen=True)
class ServerConfig:
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    api_key: str | None = None  # None: no authentication
    # /metrics asks for the key too (it shows request counts and the served model's name)
    require_api_key_for_metrics: bool = False
    served_model_name: str = "default"  # the name clients pass as "model"
    # admission: requests (and their prompt tokens) waiting for the scheduler beyond these are
    # answered 503 with Retry-After instead of queueing without bound
    max_queued_requests: int = 1024
    max_queued_tokens: int = 1_000_000
    max_request_bytes: int = 2 * 1024 * 1024  # a larger body is answered 413
    # SIGTERM: in-flight requests get this long to finish, then are aborted (shutdown.py)
    shutdown_timeout_s: float = 30.0
    # the share of the event loop's time SSE chunks may take; under load a chunk then carries
    # several tokens (request_stream.py). None: unpaced (a chunk per step, unless behind)
    stream_budget: float | None = 0.1
    # who decodes a stream's text: "server" (this process, once per chunk; the engine sends
    # tokens only, output_kind "delta_tokens") or "engine" (once per report, inside its step
    # loop). Streams with stop strings are decoded by the engine either way: it must find them
    stream_detokenize: str = "server"
    # HTTP processes sharing the port, each with its own pipe to the one engine process
    # (vLLM's --api-server-count): one event loop saturates at a few hundred streams
    api_server_count: int = 1
    # CORS (FastAPI's CORSMiddleware), vLLM's flags and defaults: any origin, method and header,
    # no credentials. Browsers' preflight requests are answered before the API key is checked
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False

    def __post_init__(self) -> None:
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            value = getattr(self, name)
            if not isinstance(value, tuple) or not all(isinstance(v, str) and v for v in value):
                raise ValueError(f"{name} must be a list of non-empty strings, got {value!r}")
        checks = [
            (0 <= self.port <= 65535, f"port must be in 0..65535, got {self.port}"),
            (self.api_key is None or self.api_key != "", "api_key must not be empty"),
            (
                self.api_key is not None or not self.require_api_key_for_metrics,
                "require_api_key_for_metrics needs an api_key (--api-key)",
            ),
            (self.served_model_name != "", "served_model_name must not be empty"),
            (
                self.max_queued_requests >= 1,
                f"max_queued_requests must be >= 1, got {self.max_queued_requests}",
            ),
            (
                self.max_queued_tokens >= 1,
                f"max_queued_tokens must be >= 1, got {self.max_queued_tokens}",
            ),
            (
                self.max_request_bytes >= 1024,
                f"max_request_bytes must be >= 1024, got {self.max_request_bytes}",
            ),
            (
                self.shutdown_timeout_s >= 0,
                f"shutdown_timeout_s must be >= 0, got {self.shutdown_timeout_s}",
            ),
            (
                self.stream_detokenize in STREAM_DETOKENIZE,
                f"stream_detokenize must be one of {STREAM_DETOKENIZE}, got "
                f"{self.stream_detokenize!r}",
            ),
            (
                1 <= self.api_server_count <= MAX_API_SERVERS,
                f"api_server_count must be in 1..{MAX_API_SERVERS}, got {self.api_server_count}",
            ),
            (
                self.stream_budget is None or 0 < self.stream_budget <= 1,
                f"stream_budget must be in (0, 1] or None, got {self.stream_budget}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
