"""`dspark serve [MODEL]`: parse options (flags over a --config YAML file over defaults), build
the EngineConfig and ServerConfig, and run the application under uvicorn.

Every option is also a key of the YAML file, spelled like the flag with or without dashes:

    # serve.yaml                              dspark serve --config serve.yaml --port 9000
    model: path/to/model.gguf
    max-model-len: 4096
    api_key: secret                           (a flag given on the command line wins)
    speculative-config: {method: dspark, model: path/to/drafter}
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from dspark.config import DTYPE_CHOICES
from dspark.server.config import DEFAULT_HOST, DEFAULT_PORT, STREAM_DETOKENIZE, ServerConfig
from dspark.spec.synthetic import SYNTHETIC_REFUSED

# Served, a step's token budget bounds how long every running stream waits for a token while a
# long prompt is prefilled: each step carries every decode row and one chunk of the prompt, and
# lasts as long as the chunk. 2048 is vLLM's online value (V1, below H100 class): on the GPU a
# prefill step is host-bound (~10 ms at 2,048 or 8,192 tokens on the H200), so chunks cost a
# long prompt little there; offline (EngineConfig's 8192) no stream waits. On the 2-core
# development CPU (SmolLM2-135M, docs/SERVING.md, Prefill and running streams) the longest
# silence of a running stream while an 8,191-token prompt arrived fell from 486 s to 88 s.
SERVE_MAX_NUM_BATCHED_TOKENS = 2048

# option -> default; the flags default to None so a value from the file is told apart
ENGINE_OPTIONS: dict[str, Any] = {
    "model": "default",
    "revision": None,
    "dtype": "auto",
    "device": "auto",
    "max_model_len": None,
    "max_num_seqs": 256,
    "max_num_batched_tokens": SERVE_MAX_NUM_BATCHED_TOKENS,  # not EngineConfig's 8192: below
    "kv_cache_memory_gb": None,
    "num_kv_pages": None,
    "seed": 0,
    # 8, not EngineConfig's 1: served at 256 streams, 0.64x offline against 0.42x (H200),
    # for chunks of 8 tokens (7.5 ms apart at one stream)
    "stream_interval": 8,
    "mixed_prefill_tokens": 256,  # EngineConfig's default
    "enable_prefix_caching": True,  # EngineConfig's default
    "speculative_config": None,
    "tensor_parallel_size": 1,
    "distributed_port": None,
}
SERVER_OPTIONS: dict[str, Any] = {
    "host": DEFAULT_HOST,
    "port": DEFAULT_PORT,
    "api_key": None,
    "require_api_key_for_metrics": False,
    "served_model_name": None,  # None: the model argument
    "max_queued_requests": ServerConfig.max_queued_requests,
    "max_queued_tokens": ServerConfig.max_queued_tokens,
    "max_request_bytes": ServerConfig.max_request_bytes,
    "shutdown_timeout_s": ServerConfig.shutdown_timeout_s,
    "stream_budget": ServerConfig.stream_budget,
    "stream_detokenize": ServerConfig.stream_detokenize,
    "api_server_count": ServerConfig.api_server_count,
    "allowed_origins": list(ServerConfig.allowed_origins),
    "allowed_methods": list(ServerConfig.allowed_methods),
    "allowed_headers": list(ServerConfig.allowed_headers),
    "allow_credentials": ServerConfig.allow_credentials,
    "disable_access_log": False,
}
CORS_LISTS = ("allowed_origins", "allowed_methods", "allowed_headers")


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="serve the OpenAI API over HTTP (docs/SERVING.md)")
    p.add_argument(
        "model", nargs="?", default=None, help="'default', a .gguf file, a HF dir or 'org/name'"
    )
    p.add_argument("--revision", default=None, help="of a Hub model: branch, tag or commit")
    p.add_argument("--config", type=Path, default=None, help="a YAML file of these options")
    p.add_argument("--dtype", default=None, choices=DTYPE_CHOICES)
    p.add_argument("--device", default=None, help="auto, cpu, cuda or cuda:N")
    for flag, kind in (
        ("--max-model-len", int),
        ("--max-num-seqs", int),
        ("--max-num-batched-tokens", int),
        ("--kv-cache-memory-gb", float),
        ("--num-kv-pages", int),
        ("--seed", int),
        ("--mixed-prefill-tokens", int),
    ):
        p.add_argument(flag, type=kind, default=None)
    p.add_argument(
        "-tp",
        "--tensor-parallel-size",
        type=int,
        default=None,
        help="ranks the model is sharded over, one GPU each (default 1)",
    )
    p.add_argument("--distributed-port", type=int, default=None,
                   help="the port the ranks meet on (default: a free one)")  # fmt: skip
    p.add_argument(
        "--stream-interval",
        type=int,
        default=None,
        help="output tokens a stream gathers per chunk (default 8; its first token and its "
        "end are sent at once): fewer, larger chunks cost the engine and the server less; "
        "1 sends every token as it is made",
    )
    p.add_argument(
        "--speculative-config",
        type=json.loads,
        default=None,
        help='JSON, the keys of LLM(speculative_config=...): \'{"method": "dspark"}\' (the '
        'drafter shipped for the model) or \'{"method": "dspark", "model": "path/to/drafter"}\'',
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="reuse the KV pages of prompts' common prefixes (default on; "
        "--no-enable-prefix-caching turns it off)",
    )
    p.add_argument("--host", default=None, help=f"default {DEFAULT_HOST} (loopback only)")
    p.add_argument("--port", type=int, default=None, help=f"default {DEFAULT_PORT}")
    p.add_argument("--api-key", default=None, help="required as 'Authorization: Bearer KEY'")
    p.add_argument(
        "--require-api-key-for-metrics",
        action="store_true",
        default=None,
        help="/metrics asks for the API key too (default: open, like /health)",
    )
    p.add_argument("--served-model-name", default=None, help="default: the model argument")
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=None,
        help="waiting requests beyond this are answered 503",
    )
    p.add_argument(
        "--max-queued-tokens",
        type=int,
        default=None,
        help="waiting prompt tokens beyond this are answered 503",
    )
    p.add_argument("--max-request-bytes", type=int, default=None, help="larger bodies get 413")
    p.add_argument(
        "--shutdown-timeout-s",
        type=float,
        default=None,
        help="on SIGTERM, how long in-flight requests may take to finish before they are aborted "
        "(each still ends with its finish reason)",
    )
    p.add_argument(
        "--stream-budget",
        type=float,
        default=None,
        help=f"share of the event loop's time SSE chunks may take (default "
        f"{ServerConfig.stream_budget}); under load a chunk then carries several tokens",
    )
    p.add_argument(
        "--stream-detokenize",
        default=None,
        choices=STREAM_DETOKENIZE,
        help=f"who decodes streamed text (default {ServerConfig.stream_detokenize}): the server, "
        "once per chunk, or the engine, once per report inside its step loop (streams with "
        "stop strings: the engine either way)",
    )
    p.add_argument(
        "--api-server-count",
        type=int,
        default=None,
        help="HTTP server processes sharing the port, each with its own pipe to the one engine "
        f"process (default {ServerConfig.api_server_count}); more keep up with more streams",
    )
    for flag, example in (
        ("--allowed-origins", "https://app.example"),
        ("--allowed-methods", "POST"),
        ("--allowed-headers", "Authorization"),
    ):
        p.add_argument(
            flag, type=json.loads, default=None,
            help=f'CORS: a JSON list, e.g. \'["{example}"]\' (default ["*"])',
        )  # fmt: skip
    p.add_argument(
        "--allow-credentials",
        action="store_true",
        default=None,
        help="CORS: allow cookies and Authorization headers from the allowed origins",
    )
    p.add_argument("--disable-access-log", action="store_true", default=None)
    p.set_defaults(func=cmd_serve)
    return p


def read_config_file(path: Path) -> dict[str, Any]:
    """The YAML file's options, keys normalised to underscores; unknown keys are refused."""
    import yaml

    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of options, got {type(data).__name__}")
    options = {str(k).replace("-", "_"): v for k, v in data.items()}
    if "synthetic_acceptance" in options:
        raise ValueError(f"{path}: {SYNTHETIC_REFUSED}")
    known = ENGINE_OPTIONS | SERVER_OPTIONS
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"{path}: unknown option(s) {unknown}; allowed: {sorted(known)}")
    return options


# the type a file's value must have (the flags' own types check the command line)
OPTION_TYPES = {"max_model_len": int, "max_num_seqs": int, "max_num_batched_tokens": int,
                "kv_cache_memory_gb": float, "num_kv_pages": int, "seed": int, "port": int,
                "stream_interval": int, "mixed_prefill_tokens": int,
                "max_queued_requests": int, "max_queued_tokens": int, "max_request_bytes": int,
                "shutdown_timeout_s": float, "stream_budget": float, "api_server_count": int,
                "disable_access_log": bool, "require_api_key_for_metrics": bool,
                "enable_prefix_caching": bool, "allow_credentials": bool,
                "allowed_origins": list, "allowed_methods": list,
                "allowed_headers": list, "tensor_parallel_size": int,
                "distributed_port": int}  # fmt: skip


def _from_file(name: str, value: Any) -> Any:
    kind = OPTION_TYPES.get(name, str)
    if name == "speculative_config" and isinstance(value, (dict, str)):
        return json.loads(value) if isinstance(value, str) else value
    if value is None or isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
        return value
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    raise ValueError(f"config file option {name}: expected {kind.__name__}, got {value!r}")


def resolve_options(args: argparse.Namespace) -> dict[str, Any]:
    """Flag if given, else the file's value, else the default."""
    from_file = read_config_file(args.config) if args.config else {}
    resolved = {}
    for name, default in (ENGINE_OPTIONS | SERVER_OPTIONS).items():
        flag = getattr(args, name, None)
        if flag is not None:
            resolved[name] = flag
        else:
            resolved[name] = _from_file(name, from_file[name]) if name in from_file else default
    return resolved


def build_configs(options: dict[str, Any]):
    from dspark.config import EngineConfig

    engine = EngineConfig(**{k: options[k] for k in ENGINE_OPTIONS})
    server_keys = [k for k in SERVER_OPTIONS if k != "disable_access_log"]
    for name in CORS_LISTS:
        if not isinstance(options[name], list):
            raise ValueError(f"{name} must be a JSON list of strings, got {options[name]!r}")
    server = ServerConfig(
        **(
            {k: options[k] for k in server_keys}
            | {"served_model_name": options["served_model_name"] or options["model"]}
            | {name: tuple(options[name]) for name in CORS_LISTS}
        )
    )
    return engine, server


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        from dspark.server.app import build_app
        from dspark.server.shutdown import GracefulServer
    except ImportError as e:
        message = f"dspark serve needs the serve extra ({e}): pip install 'dspark[serve]'"
        raise ValueError(message) from None
    from dspark.server.engine_process import engine_factory

    options = resolve_options(args)
    engine_config, server_config = build_configs(options)
    uvicorn_options = {
        "access_log": not options["disable_access_log"],
        "log_level": "info",
    }
    if server_config.api_server_count > 1:
        from dspark.server.api_servers import serve_with_workers

        failure = serve_with_workers(server_config, engine_factory(engine_config), uvicorn_options)
    else:
        app = build_app(server_config, engine_factory(engine_config))
        server = GracefulServer(
            app, server_config.shutdown_timeout_s, host=server_config.host,
            port=server_config.port, **uvicorn_options,
        )  # fmt: skip
        server.run()
        failure = server.load_failure
    if failure is not None:  # (the server stopped itself: nothing can be served)
        print(f"dspark: error: the model could not be loaded: {failure}", file=sys.stderr)
        return 1
    return 0
