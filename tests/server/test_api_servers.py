"""`dspark serve --api-server-count 2`: two HTTP processes on one port in front of one engine
process. Every request is answered, /metrics counts every process's requests in each process,
SIGTERM stops all three processes, and a worker that dies leaves the others serving."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from tests.server.conftest import is_running
from tests.server.test_load import NUM_REQUESTS, _finished_by_reason, _run_load

REPO = Path(__file__).resolve().parents[2]
NUM_STREAMS = 24
NUM_TOKENS = 6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


def _children(pid: int) -> list[int]:
    """The process's direct children (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(stat[1]) == pid:
                found.append(int(entry.name))
    return found


@pytest.fixture
def two_servers(tiny_llama_dir, tmp_path):
    port = _free_port()
    log = open(tmp_path / "serve.log", "w")
    main = subprocess.Popen(
        [sys.executable, "-m", "dspark.cli", "serve", str(tiny_llama_dir), "--port", str(port),
         "--api-server-count", "2", "--dtype", "float32", "--device", "cpu",
         "--max-model-len", "256", "--num-kv-pages", "2048", "--disable-access-log",
         "--served-model-name", "tiny"],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert main.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.3)
    yield main, url, tmp_path / "serve.log"
    if main.poll() is None:
        main.kill()
        main.wait(timeout=10)
    log.close()


async def _streams(url: str, n: int) -> list[tuple[int, str]]:
    """n streamed completions at once, each on its own connection: (tokens, finish reason)."""

    async def one(i: int) -> tuple[int, str]:
        body = {"model": "tiny", "prompt": f"Request {i}:", "max_tokens": NUM_TOKENS,
                "ignore_eos": True, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        async with httpx.AsyncClient(timeout=60) as client:  # (a connection of its own)
            finish, tokens = None, 0
            async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
                assert response.status_code == 200, await response.aread()
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        chunk = httpx.Response(200, content=line[6:]).json()
                        for choice in chunk["choices"]:
                            finish = choice.get("finish_reason") or finish
                        if chunk.get("usage"):
                            tokens = chunk["usage"]["completion_tokens"]
            return tokens, finish

    return await asyncio.gather(*(one(i) for i in range(n)))


def _gauge(url: str, name: str) -> float:
    """The value of the first /metrics sample starting with `name` (on a new connection)."""
    text = httpx.get(f"{url}/metrics", headers={"Connection": "close"}).text
    return float(next(s for s in text.splitlines() if s.startswith(name)).split()[-1])


def _finished(url: str) -> float:
    return _gauge(url, 'vllm:request_success_total{model_name="tiny",finished_reason="length"')


def test_two_api_processes_serve_count_together_and_stop_together(two_servers):
    main, url, log = two_servers
    workers_and_engine = _children(main.pid)
    results = asyncio.run(_streams(url, NUM_STREAMS))
    assert results == [(NUM_TOKENS, "length")] * NUM_STREAMS
    # any process's page counts every process's requests (recorded in the engine process),
    # and none still shows a request running once the engine is idle
    assert [_finished(url) for _ in range(6)] == [float(NUM_STREAMS)] * 6
    assert [_gauge(url, "vllm:num_requests_running{") for _ in range(6)] == [0.0] * 6
    main.send_signal(signal.SIGTERM)
    main.wait(timeout=60)
    deadline = time.monotonic() + 20
    while any(is_running(pid) for pid in workers_and_engine):
        assert time.monotonic() < deadline, f"{workers_and_engine} outlived the server"
        time.sleep(0.1)
    text = log.read_text()
    assert "serving with 2 API processes" in text and "engine ready: serving 2" in text
    # each API process logs its start-up apart from serving (the tokenizer's READY message)
    assert text.count("ready: serving; the server's start-up: ") == 2, text


def test_a_worker_that_dies_leaves_the_main_server_serving(two_servers):
    main, url, log = two_servers
    engine_pid = int(log.read_text().split("engine process ")[1].split()[0])
    others = [pid for pid in _children(main.pid) if pid != engine_pid]
    worker = next(p for p in others if b"resource_tracker" not in _cmdline(p))
    os.kill(worker, signal.SIGKILL)
    time.sleep(0.5)
    results = asyncio.run(_streams(url, 8))  # (the main server accepts on the same socket)
    assert results == [(NUM_TOKENS, "length")] * 8
    assert httpx.get(f"{url}/health").status_code == 200
    assert is_running(engine_pid)
    assert "API process 1 closed its pipe" in log.read_text()


def test_load_with_cancellations_across_two_api_processes(two_servers):
    """test_load's 200 streams, a third cancelled mid-stream, each stream on its own connection
    (spread over both processes by the kernel): every abort reaches the engine from the process
    that owns the request, the rest end with their tokens, and every KV page is free after."""
    main, url, log = two_servers
    cancelled = set(random.Random(1).sample(range(NUM_REQUESTS), NUM_REQUESTS // 3))
    live = SimpleNamespace(url=url)  # what _run_load needs of a server
    results, statuses = asyncio.run(_run_load(live, cancelled))
    left = {r["index"] for r in results if r["index"] in cancelled and r["finish"] is None}
    assert len(left) >= len(cancelled) // 2, (len(left), len(cancelled))
    assert all(r["finish"] == "length" for r in results if r["index"] not in left)
    assert set(statuses) == {200}
    deadline = time.monotonic() + 30
    while _gauge(url, "dspark:kv_cache_pages_used{") or _gauge(url, "vllm:num_requests_running{"):
        assert time.monotonic() < deadline, "pages still in use after the load"
        time.sleep(0.1)
    finished = _finished_by_reason(live)
    assert finished.get("abort", 0) == len(left)
    assert finished.get("length", 0) == NUM_REQUESTS - len(left)
