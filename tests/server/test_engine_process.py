"""The engine's own process: its death is noticed (open streams end with finish_reason "error",
/health answers 503 with the reason), it never outlives the server (stopped, or killed while
the engine loads), and validation that needs the engine still answers 400 before a stream
starts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx

from tests.server.conftest import MODEL, auth, engine_config, is_running, start_server

REPO = Path(__file__).resolve().parents[2]


def _wait_gone(pid: int, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while is_running(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_an_engine_killed_mid_stream_ends_the_stream_with_error(long_llama_dir):
    live = start_server(engine_config(long_llama_dir, max_model_len=4096))
    process = live.state.engine_loop.process
    try:
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 4000, "ignore_eos": True,
                "stream": True}  # fmt: skip
        with httpx.stream("POST", f"{live.url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            os.kill(process.pid, signal.SIGKILL)
            rest = [line for line in lines if line.startswith("data: ")]
        assert json.loads(first.removeprefix("data: "))["choices"][0]["finish_reason"] is None
        assert rest[-1] == "data: [DONE]"
        final = json.loads(rest[-3].removeprefix("data: "))["choices"][0]
        error = json.loads(rest[-2].removeprefix("data: "))["error"]
        assert final["finish_reason"] == "error" and "killed by signal 9" in error["message"]
        health = httpx.get(f"{live.url}/health")
        assert health.status_code == 503 and health.json()["status"] == "dead"
        assert "killed by signal 9" in health.json()["reason"]
        refused = httpx.post(f"{live.url}/v1/completions", json={"prompt": "Hi"})
        assert refused.status_code == 503 and "killed by signal 9" in refused.text
        # the gauges say what is running now (nothing), not what the dead engine last had
        metrics = httpx.get(f"{live.url}/metrics").text
        for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                      "dspark:kv_cache_pages_used", "dspark:engine_serving"):  # fmt: skip
            assert f'{gauge}{{model_name="tiny"}} 0.0' in metrics, gauge
        assert 'dspark:engine_state{model_name="tiny",state="dead"} 1.0' in metrics
        assert 'dspark:engine_state{model_name="tiny",state="serving"} 0.0' in metrics
    finally:
        live.stop()
    assert process.exitcode == -signal.SIGKILL


def test_an_invalid_stream_is_refused_before_it_starts(server):
    """Validation the engine does (a prompt token outside the vocabulary, a prompt past the
    context) is a 400 with the engine's message, not a stream that fails."""
    url = f"{server.url}/v1/completions"
    for prompt, message in (([1, 10**6], "outside the vocabulary"), ([1] * 200, "max_model_len")):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "stream": True}
        response = httpx.post(url, json=body, headers=auth())
        assert response.status_code == 400, response.text
        assert message in response.json()["error"]["message"]
    assert server.state.engine_loop.num_in_flight == 0


SERVER_SCRIPT = """
import asyncio, sys
from pathlib import Path
from dspark.server.engine_loop import EngineLoop
from tests.server.engine_factories import gated_engine

async def main():
    loop = EngineLoop(gated_engine(Path(sys.argv[1]), None), 8, 1024)
    loop.start()
    print(loop.process.pid, flush=True)
    await asyncio.sleep(120)

asyncio.run(main())
"""


def test_the_engine_process_exits_when_its_server_is_killed(tmp_path):
    """A server killed with SIGKILL (no shutdown at all) while its engine loads: the engine
    process notices its parent is gone and exits."""
    parent = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(SERVER_SCRIPT), str(tmp_path / "never")],
        cwd=REPO, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        engine_pid = int(parent.stdout.readline())
        assert is_running(engine_pid)
        time.sleep(0.5)  # (the engine process is past its start-up, in the factory)
        parent.kill()
        parent.wait(timeout=10)
        assert _wait_gone(engine_pid), f"engine process {engine_pid} outlived its server"
    finally:
        if parent.poll() is None:
            parent.kill()


def test_the_step_loop_is_profiled_when_asked(tiny_llama_dir, tmp_path, monkeypatch):
    """DSPARK_ENGINE_PROFILE: the engine process writes its loop's profile there at stop (the
    spawned process inherits the variable), naming the engine's step."""
    import pstats

    path = tmp_path / "engine.prof"
    monkeypatch.setenv("DSPARK_ENGINE_PROFILE", str(path))
    live = start_server(engine_config(tiny_llama_dir))
    try:
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 4, "ignore_eos": True}
        assert httpx.post(f"{live.url}/v1/completions", json=body, timeout=60).status_code == 200
    finally:
        live.stop()
    functions = {name for _, _, name in pstats.Stats(str(path)).stats}
    assert "step" in functions and "serve" in functions
