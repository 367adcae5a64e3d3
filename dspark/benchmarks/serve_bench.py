"""`dspark bench serve`: load an OpenAI-compatible server over HTTP and measure what users see.

Without --base-url it starts `dspark serve` itself (the engine options below go to it), waits for
/health, runs, and stops it with SIGTERM; with --base-url it loads any server that speaks the
API (vLLM, SGLang, another dspark). Each level sends --num-prompts streamed requests, real
prompts from the offline bench's sources (prompts.py), either

    --concurrency 1,8,32       at most C requests in flight, the next sent as one finishes, or
    --request-rate 2,8,inf     Poisson arrivals at R requests/s (inf: all at once), optionally
                               capped by --max-concurrency,

and reports TTFT, TPOT, ITL (median, p99), output tokens/s and goodput under the given SLOs,
plus the acceptance length when the server exposes vLLM's speculative counters on /metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import re
import shlex
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from dspark.benchmarks.prompts import (
    PROMPT_SPLITS,
    SOURCES,
    default_prompts_dir,
    load_prompts,
    output_lengths,
)
from dspark.benchmarks.report import git_state
from dspark.benchmarks.serve_client import ConnectionPool, RequestRecord, stream_request
from dspark.benchmarks.serve_report import format_table, plot_results, summarize

if TYPE_CHECKING:  # httpx (the serve extra) is imported where a run needs it: the CLI loads
    import httpx  # this module to register `bench serve` even without it

SPEC_COUNTERS = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_accepted_tokens_total")
HEALTH_TIMEOUT_S = 900.0
CLIENT_BOUND_FRACTION = 0.9  # of one core: above it a level warns that it may be client-bound


def parse_levels(text: str, kind: type, name: str) -> list:
    try:
        levels = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--{name} must be comma-separated numbers, got {text!r}") from None
    if not levels or min(levels) <= 0:
        raise ValueError(f"--{name} levels must be > 0, got {text!r}")
    return levels


def add_serve_bench_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="HTTP load generator against an OpenAI API server")
    p.add_argument("--base-url", default=None, help="default: start `dspark serve` and use it")
    p.add_argument("--model", default=None, help="served model name (default: /v1/models' first)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--endpoint", default="chat", choices=("chat", "completions"))
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--concurrency", default=None, help="levels, e.g. 1,8,32 (default 8)")
    mode.add_argument("--request-rate", default=None, help="Poisson levels in req/s, e.g. 2,inf")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap in --request-rate mode")
    p.add_argument("--num-prompts", type=int, default=64, help="requests per level")
    p.add_argument("--output-len", type=int, default=128, help="max_tokens per request")
    p.add_argument(
        "--output-len-spread",
        type=float,
        default=0.0,
        help="seeded max_tokens in output-len * [1 - S, 1 + S], as `dspark bench`'s option: the "
        "same lengths for the same --num-prompts and --seed, so requests end at different steps",
    )
    p.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="let requests stop at EOS (ignore_eos is a vLLM extension)",
    )
    p.add_argument(
        "--no-preconnect",
        action="store_true",
        help="open each level's connections as its requests go out, inside its clock (by "
        "default a level of C streams, or a rate level capped at C, opens its C connections "
        "first)",
    )
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--slo-e2e-ms", type=float, default=None)
    p.add_argument("--prompts-dir", type=Path, default=None)
    p.add_argument("--sources", default=",".join(SOURCES))
    p.add_argument("--prompt-split", default="eval", choices=PROMPT_SPLITS)
    p.add_argument("--seed", type=int, default=0, help="prompt order and arrival times")
    p.add_argument("--out", type=Path, default=Path("serve_bench_results.json"))
    p.add_argument("--plot", type=Path, default=None, help="default: --out with .png")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument(
        "--save-requests",
        action="store_true",
        help="keep each request's response id, send time (the monotonic clock), TTFT, e2e "
        "and tokens in --out, for bench/serving.py phases",
    )
    p.add_argument(
        "--server-args",
        default="",
        help="extra `dspark serve` arguments when the bench starts the server, e.g. "
        "'MODEL --speculative-config {...} --max-model-len 2048'",
    )
    p.set_defaults(func=cmd_bench_serve)
    return p


def _levels(args: argparse.Namespace) -> tuple[str, list[dict]]:
    """('concurrency' | 'request_rate', [{label, value, concurrency, rate}, ...])."""
    if args.request_rate is not None:
        rates = parse_levels(args.request_rate, float, "request-rate")
        cap = args.max_concurrency
        return "request_rate", [
            {"label": f"{r:g}/s", "value": r, "concurrency": cap, "rate": r} for r in rates
        ]
    levels = parse_levels(args.concurrency or "8", int, "concurrency")
    return "concurrency", [
        {"label": f"C={c}", "value": c, "concurrency": c, "rate": math.inf} for c in levels
    ]


def _payload(args, model: str, conversation: list[dict], max_tokens: int) -> dict:
    body = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if not args.no_ignore_eos:
        body["ignore_eos"] = True
    if args.endpoint == "chat":
        body["messages"] = conversation
    else:
        body["prompt"] = conversation[0]["content"]
    return body


async def run_level(
    pool: ConnectionPool,
    path: str,
    payloads: list[dict],
    headers: dict,
    concurrency: int | None,
    rate: float,
    seed: int,
) -> tuple[list[RequestRecord], float]:
    """Send every payload, arrivals Poisson at `rate` (inf: at once), at most `concurrency` in
    flight; returns the records in payload order and the wall time."""
    gate = asyncio.Semaphore(concurrency or len(payloads))
    arrivals = random.Random(seed)

    async def one(payload: dict) -> RequestRecord:
        async with gate:
            return await stream_request(pool, path, payload, headers)

    start = time.perf_counter()
    tasks = []
    for payload in payloads:
        tasks.append(asyncio.create_task(one(payload)))
        if math.isfinite(rate):
            await asyncio.sleep(arrivals.expovariate(rate))
    records = await asyncio.gather(*tasks)
    return list(records), time.perf_counter() - start


async def read_spec_counters(client: httpx.AsyncClient, base_url: str) -> dict[str, float]:
    """vLLM's speculative counters from /metrics (summed over label sets); {} if there are none."""
    import httpx

    try:
        text = (await client.get(f"{base_url}/metrics")).text
    except httpx.HTTPError:
        return {}
    totals: dict[str, float] = {}
    for name in SPEC_COUNTERS:
        for match in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M):
            totals[name] = totals.get(name, 0.0) + float(match.group(1))
    return totals


def _acceptance(before: dict, after: dict) -> dict | None:
    drafts_key, accepted_key = SPEC_COUNTERS
    if drafts_key not in after:
        return None
    drafts = after[drafts_key] - before.get(drafts_key, 0.0)
    accepted = after[accepted_key] - before.get(accepted_key, 0.0)
    tau = 1 + accepted / drafts if drafts else None
    return {"num_drafts": drafts, "num_accepted_tokens": accepted, "mean_acceptance_length": tau}


async def run_bench(args: argparse.Namespace, base_url: str) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(None, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        model = args.model or await _first_model(client, base_url, headers)
        conversations = load_prompts(
            args.prompts_dir or default_prompts_dir(),
            tuple(args.sources.split(",")),
            args.seed,
            args.prompt_split,
        )
        lengths = output_lengths(
            args.num_prompts, args.output_len, args.output_len_spread, args.seed
        )
        payloads = [
            _payload(args, model, conversations[i % len(conversations)], lengths[i])
            for i in range(args.num_prompts)
        ]
        path = f"/v1/{'chat/completions' if args.endpoint == 'chat' else 'completions'}"
        pool = ConnectionPool(base_url)
        slos = {name: getattr(args, f"slo_{name}_ms") for name in ("ttft", "tpot", "e2e")}
        slos = {k: v for k, v in slos.items() if v is not None}
        level_name, levels = _levels(args)
        for level in levels:
            before = await read_spec_counters(client, base_url)
            if not args.no_preconnect and level["concurrency"] is not None:  # (its clients)
                level["preconnected"] = await pool.fill(min(level["concurrency"], len(payloads)))
            cpu_start = time.process_time()
            records, wall = await run_level(
                pool, path, payloads, headers, level["concurrency"], level["rate"], args.seed
            )
            level["summary"] = summarize(records, wall, slos)
            if args.save_requests:
                level["requests"] = [
                    {"id": r.response_id, "start": r.start, "sent": r.sent, "ttft": r.ttft,
                     "e2e": r.e2e, "output_tokens": r.output_tokens, "ok": r.ok}
                    for r in records
                ]  # fmt: skip
            level["client_cpu_s"] = time.process_time() - cpu_start
            level["speculation"] = _acceptance(before, await read_spec_counters(client, base_url))
            level["rate"] = None if math.isinf(level["rate"]) else level["rate"]
            tok_s = level["summary"]["output_tokens_per_s"]
            print(f"{level['label']}: {tok_s or 0:.1f} output tok/s", file=sys.stderr, flush=True)
            _warn_if_client_bound(level["client_cpu_s"], wall)
        pool.close()
    return {
        "base_url": base_url,
        "model": model,
        "endpoint": args.endpoint,
        "output_len": args.output_len,
        "output_len_spread": args.output_len_spread,
        "num_prompts": args.num_prompts,
        "ignore_eos": not args.no_ignore_eos,
        "slos_ms": slos,
        "level_name": level_name,
        "levels": levels,
        **git_state(),
    }


def _warn_if_client_bound(cpu_s: float, wall_s: float) -> None:
    """The load generator is one process on one core: near 100% of it, its own parsing, not
    the server, may be what the level measured."""
    if wall_s > 0 and cpu_s / wall_s > CLIENT_BOUND_FRACTION:
        print(
            f"warning: the load generator used {cpu_s / wall_s:.0%} of a core at this level; "
            "the figures may be its limit, not the server's",
            file=sys.stderr,
            flush=True,
        )


async def _first_model(client: httpx.AsyncClient, base_url: str, headers: dict) -> str:
    response = await client.get(f"{base_url}/v1/models", headers=headers)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def started_server(server_args: str, api_key: str | None):
    """`dspark serve` on a free loopback port, until healthy; stopped with SIGTERM after."""
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "dspark.cli",
        "serve",
        *shlex.split(server_args),
        "--port",
        str(port),
        "--disable-access-log",
    ]
    if api_key:
        command += ["--api-key", api_key]
    process = subprocess.Popen(command)
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base_url, process)
        yield base_url
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()


def wait_healthy(base_url: str, process: subprocess.Popen | None = None) -> None:
    import httpx

    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise ValueError(f"`dspark serve` exited with code {process.returncode} before ready")
        try:
            if httpx.get(f"{base_url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise ValueError(f"{base_url}/health did not answer 200 within {HEALTH_TIMEOUT_S:.0f} s")


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from dspark.benchmarks.report import write_results

    try:
        import httpx  # noqa: F401
    except ImportError:
        raise ValueError("dspark bench serve needs httpx: pip install 'dspark[serve]'") from None
    if args.num_prompts < 1 or args.output_len < 1:
        raise ValueError("--num-prompts and --output-len must be >= 1")
    if not 0.0 <= args.output_len_spread < 1.0:
        raise ValueError(f"--output-len-spread must be in [0, 1), got {args.output_len_spread}")
    _levels(args)  # refuse bad levels before starting anything
    if args.base_url is not None:
        results = asyncio.run(run_bench(args, args.base_url.rstrip("/")))
    else:
        with started_server(args.server_args, args.api_key) as base_url:
            results = asyncio.run(run_bench(args, base_url))
    results["command"] = shlex.join(["dspark", *sys.argv[1:]])
    plot = None if args.no_plot else (args.plot or args.out.with_suffix(".png"))
    write_results(results, args.out, plot, draw=plot_results)
    print(format_table(results))
    return 0
