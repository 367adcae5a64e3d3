"""DSPARK_REQUEST_TRACE: one line per finished stream with the HTTP side's and the engine's
timestamps, in order, joined with the load generator's records by bench/serving.py phases."""

from __future__ import annotations

import json
import time

import httpx

from tests.helpers import bench_module
from tests.server.conftest import MODEL, engine_config, start_server


def test_a_traced_stream_has_every_timestamp_in_order(tiny_llama_dir, tmp_path, set_envs):
    set_envs(request_trace=tmp_path / "trace")  # (the API side runs in this process)
    live = start_server(engine_config(tiny_llama_dir))
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 5, "ignore_eos": True,
            "stream": True}  # fmt: skip
    start = time.monotonic()
    response_id, ttft = None, None
    with httpx.stream("POST", f"{live.url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                response_id = response_id or json.loads(line[6:])["id"]
                ttft = ttft or time.monotonic() - start
    e2e = time.monotonic() - start
    httpx.post(f"{live.url}/v1/completions", json={**body, "stream": False}, timeout=60)
    live.stop()  # (closes the trace file)
    [path] = tmp_path.glob("trace.*")
    [trace] = [json.loads(line) for line in path.read_text().splitlines()]  # streams only
    assert trace["id"] == response_id
    order = ["asgi", "arrival", "added", "first_token", "first_chunk", "last_chunk"]
    assert [trace[k] for k in order] == sorted(trace[k] for k in order), trace
    assert trace["asgi"] <= trace["acked"] <= trace["first_chunk"]
    assert start <= trace["asgi"] and trace["first_token"] <= trace["finished"]
    client = tmp_path / "client.json"
    record = {"id": response_id, "start": start, "ttft": ttft, "e2e": e2e, "ok": True,
              "output_tokens": 5}  # fmt: skip
    client.write_text(json.dumps({"levels": [{"requests": [record]}]}))
    phases = bench_module("serving")
    joined = phases.joined_requests(str(client), str(tmp_path / "trace"), 0)
    assert [c["id"] for c, _ in joined] == [response_id]
    rows = phases.phases(joined)
    assert all(median >= 0 for name, median, _, _ in rows), rows
