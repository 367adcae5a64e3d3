"""The server's lifecycle: loading and a dead engine, the queue limit, clients that leave, a
request that fails alone, and `dspark serve` stopped by SIGTERM."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from dspark.benchmarks.serve_bench import free_port
from dspark.server import serving
from dspark.server.app import build_app
from dspark.server.config import ServerConfig
from dspark.server.engine_process import engine_factory
from tests.server.conftest import (
    MODEL,
    LiveServer,
    auth,
    engine_config,
    is_running,
    start_server,
)
from tests.server.engine_factories import gated_engine

LONG = 4000  # tokens: a request that runs for seconds on the tiny model


@pytest.fixture(scope="module")
def small_server(long_llama_dir):
    """Two running requests at most, three waiting at most, long contexts."""
    config = engine_config(long_llama_dir, max_model_len=4096, max_num_seqs=2)
    live = start_server(config, max_queued_requests=3, max_queued_tokens=60)
    yield live
    live.stop()


def _body(prompt: str, max_tokens: int, **extra) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, **extra}  # fmt: skip


def _count(live, reason: str) -> float:
    text = httpx.get(f"{live.url}/metrics").text
    match = re.search(rf'^vllm:request_success_total{{.*finished_reason="{reason}"}} (\S+)$',
                      text, re.M)  # fmt: skip
    return float(match[1]) if match else 0.0


def _wait_for(condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_health_is_503_while_loading_then_200(tiny_llama_dir, tmp_path):
    gate = tmp_path / "gate"
    slow_engine = gated_engine(gate, engine_config(tiny_llama_dir))
    live = LiveServer(build_app(ServerConfig(served_model_name=MODEL), slow_engine))
    live.start(wait_healthy=False)
    try:
        health = httpx.get(f"{live.url}/health")
        assert health.status_code == 503 and health.json()["status"] == "loading"
        busy = httpx.post(f"{live.url}/v1/completions", json=_body("Hi", 2))
        assert busy.status_code == 503 and busy.json()["error"]["code"] == "loading"
        assert busy.headers["retry-after"] == "1"
        assert (
            'dspark:engine_serving{model_name="tiny"} 0.0' in httpx.get(f"{live.url}/metrics").text
        )
        gate.touch()
        assert live.wait_for_health(200).status_code == 200
        done = httpx.post(f"{live.url}/v1/completions", json=_body("Hi", 2))
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 2
    finally:
        gate.touch()
        live.stop()


def test_health_is_503_with_the_reason_when_the_engine_died(tmp_path):
    config = engine_config(tmp_path / "no_such_model")
    live = LiveServer(build_app(ServerConfig(), engine_factory(config))).start(False)
    try:
        health = live.wait_for_health(503)
        while health.json()["status"] == "loading":
            health = httpx.get(f"{live.url}/health")
        assert health.json()["status"] == "dead" and "no_such_model" in health.json()["reason"]
        refused = httpx.post(f"{live.url}/v1/completions", json={"prompt": "Hi"})
        assert refused.status_code == 503 and "failed to load" in refused.json()["error"]["message"]
    finally:
        live.stop()


async def _open_stream(client: httpx.AsyncClient, url: str, body: dict):
    request = client.build_request("POST", url, json={**body, "stream": True})
    response = await client.send(request, stream=True)
    assert response.status_code == 200
    return response


def test_queue_limit_answers_503_and_recovers(small_server):
    url = f"{small_server.url}/v1/completions"
    loop = small_server.state.engine_loop

    async def scenario():
        async with httpx.AsyncClient(timeout=30) as client:
            streams = [await _open_stream(client, url, _body(f"Request {i}", LONG))
                       for i in range(5)]  # fmt: skip
            _wait_for(lambda: loop.stats.num_running == 2 and loop.stats.num_waiting == 3)
            full = await client.post(url, json=_body("One more", 4))
            too_big = await client.post(url, json=_body("word " * 70, 4))
            for response in streams:
                await response.aclose()  # the clients leave: their requests are aborted
            return full, too_big

    aborted = _count(small_server, "abort")
    full, too_big = asyncio.run(scenario())
    assert full.status_code == 503 and full.headers["retry-after"] == "1"
    assert full.json()["error"]["code"] == "queue_full"
    assert "3 requests" in full.json()["error"]["message"]
    assert too_big.status_code == 400 and "could never be admitted" in too_big.text
    small_server.wait_idle()
    assert _count(small_server, "abort") == aborted + 5
    assert 'dspark:requests_rejected_total{model_name="tiny",reason="queue_full"} 1.0' in (
        httpx.get(f"{small_server.url}/metrics").text
    )
    ok = httpx.post(url, json=_body("Now there is room", 4))
    assert ok.status_code == 200


def test_a_burst_takes_the_free_seats_and_only_what_waits_counts_as_queued(small_server):
    """Two seats and three places in the queue: of six requests sent at once, five are
    admitted (the two that take the seats never wait) and the sixth is refused."""
    url = f"{small_server.url}/v1/completions"

    async def scenario():
        async with httpx.AsyncClient(timeout=120) as client:
            bodies = [_body(f"Burst {i}", 150) for i in range(6)]
            return await asyncio.gather(*(client.post(url, json=body) for body in bodies))

    small_server.wait_idle()
    statuses = sorted(response.status_code for response in asyncio.run(scenario()))
    assert statuses == [200] * 5 + [503], statuses
    small_server.wait_idle()


def test_a_client_that_leaves_a_whole_response_aborts_it(small_server):
    aborted = _count(small_server, "abort")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{small_server.url}/v1/completions", json=_body("Hi", LONG), timeout=0.3)
    _wait_for(lambda: _count(small_server, "abort") == aborted + 1)
    small_server.wait_idle()
    small_server.assert_pages_free()


def test_a_failing_request_ends_with_error_and_the_others_finish(server, monkeypatch):
    """A request whose formatting raises (injected for the prompt marked FAIL) ends with
    finish_reason "error" and an error event; its neighbours stream to the end."""
    real_delta = serving.StreamWriter.delta

    def delta(self, index, out):
        if "FAIL" in (self.prep.subs[index].prompt_text or ""):
            raise RuntimeError("injected formatting failure")
        return real_delta(self, index, out)

    monkeypatch.setattr(serving.StreamWriter, "delta", delta)

    async def read(client, prompt):
        body = _body(prompt, 30 if "FAIL" in prompt else 6, stream=True)
        url = f"{server.url}/v1/completions"
        async with client.stream("POST", url, json=body, headers=auth()) as response:
            return [line async for line in response.aiter_lines() if line.startswith("data: ")]

    async def scenario():
        async with httpx.AsyncClient(timeout=30) as client:
            prompts = ["one", "two", "FAIL here", "three", "four"]
            return await asyncio.gather(*(read(client, p) for p in prompts))

    aborted = _count(server, "abort")
    results = asyncio.run(scenario())
    failed = results.pop(2)
    assert failed[-1] == "data: [DONE]"
    final = json.loads(failed[-3].removeprefix("data: "))
    assert final["choices"][0]["finish_reason"] == "error"
    assert "injected" in json.loads(failed[-2].removeprefix("data: "))["error"]["message"]
    for lines in results:
        assert lines[-1] == "data: [DONE]"
        last = json.loads(lines[-2].removeprefix("data: "))
        assert last["choices"][0]["finish_reason"] == "length"
    server.wait_idle()
    assert _count(server, "abort") == aborted + 1
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_dspark_serve_finishes_in_flight_requests_on_sigterm(long_llama_dir, tmp_path):
    """The CLI end to end: options from a YAML file (a flag overrides one), SIGTERM while a
    stream runs: the stream completes, new connections are refused, the application shuts
    down cleanly."""
    (tmp_path / "serve.yaml").write_text(
        f"model: {long_llama_dir}\ndevice: cpu\ndtype: float32\nmax-model-len: 2048\n"
        "num_kv_pages: 256\napi-key: from-file\nserved-model-name: yaml-name\nport: 1\n"
        "shutdown-timeout-s: 300\n"  # the 1,500-token stream must finish on a loaded CPU too
    )
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "dspark.cli", "serve", "--config", str(tmp_path / "serve.yaml"),
         "--port", str(port), "--disable-access-log"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for(lambda: _healthy(url, process), timeout=120)
        children = _children(process.pid)  # the engine process (and multiprocessing's tracker)
        assert children
        headers = {"Authorization": "Bearer from-file"}
        body = {**_body("Hi", 1500), "model": "yaml-name", "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers,
                          timeout=60) as response:  # fmt: skip
            assert response.status_code == 200
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            process.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        chunks = [json.loads(line.removeprefix("data: ")) for line in [first, *rest[:-1]]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        # uvicorn re-raises the signal once shut down, the exit status a supervisor expects
        assert process.wait(timeout=30) in (0, -signal.SIGTERM)
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health")
        _wait_for(lambda: not any(is_running(pid) for pid in children), timeout=10)
    finally:
        if process.poll() is None:
            process.kill()
        output = process.communicate()[0]
    assert "Application shutdown complete" in output, output[-2000:]


def _children(pid: int) -> list[int]:
    tasks = Path(f"/proc/{pid}/task").iterdir()
    return [int(child) for task in tasks for child in (task / "children").read_text().split()]


def _healthy(url: str, process: subprocess.Popen) -> bool:
    assert process.poll() is None, process.communicate()[0][-3000:]
    try:
        return httpx.get(f"{url}/health").status_code == 200
    except httpx.HTTPError:
        return False


def test_sigterm_past_the_grace_period_aborts_requests_with_complete_responses(
    long_llama_dir, tmp_path
):
    """Requests still running at --shutdown-timeout-s are aborted through the engine: a whole
    response is the envelope with finish_reason "abort", a stream ends with its final chunk and
    [DONE], and the log has no traceback."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "dspark.cli", "serve", str(long_llama_dir), "--device", "cpu",
         "--dtype", "float32", "--max-model-len", "4096", "--num-kv-pages", "600",
         "--served-model-name", MODEL, "--port", str(port), "--shutdown-timeout-s", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}/v1/completions"

    async def scenario():
        async with httpx.AsyncClient(timeout=120) as client:
            whole = asyncio.ensure_future(client.post(url, json=_body("Whole", 4000)))
            stream = await _open_stream(client, url, _body("Streamed", 4000))
            lines = stream.aiter_lines()
            first = await anext(line async for line in lines if line.startswith("data: "))
            process.send_signal(signal.SIGTERM)
            rest = [line async for line in lines if line.startswith("data: ")]
            return await whole, [first, *rest]

    try:
        _wait_for(lambda: _healthy(f"http://127.0.0.1:{port}", process), timeout=120)
        whole, lines = asyncio.run(scenario())
        assert whole.status_code == 200, whole.text
        assert whole.json()["choices"][0]["finish_reason"] == "abort"
        assert lines[-1] == "data: [DONE]"
        last = json.loads(lines[-2].removeprefix("data: "))
        assert last["choices"][0]["finish_reason"] == "abort"
        assert process.wait(timeout=30) in (0, -signal.SIGTERM)
    finally:
        if process.poll() is None:
            process.kill()
        output = process.communicate()[0]
    assert "Traceback" not in output, output[-3000:]
    assert "Application shutdown complete" in output, output[-2000:]
