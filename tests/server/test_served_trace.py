"""The step trace (DSPARK_POLICY_TRACE) from `dspark serve`'s engine process: the variable is
inherited by the spawned process, and its lines reach the file although a multiprocessing
child ends without running atexit (the trace writes line by line)."""

from __future__ import annotations

import json

import httpx

from tests.server.conftest import MODEL, engine_config, start_server


def test_the_engine_process_writes_its_trace(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_POLICY_TRACE", str(tmp_path / "traces"))  # (the engine process)
    live = start_server(engine_config(tiny_llama_dir))
    try:
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 8, "ignore_eos": True}
        response = httpx.post(f"{live.url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200
    finally:
        live.stop()
    (path,) = (tmp_path / "traces").iterdir()
    lines = [json.loads(text) for text in path.read_text().splitlines()]
    # plain decoding, no policy: a line per step, the request's 8 tokens among them
    assert len(lines) >= 8 and not any(line["drafting"] for line in lines)
    assert max(line["R"] for line in lines) == 1
