"""`dspark bench serve`: the CLI beside the offline `dspark bench`, and real runs against the
test servers (concurrency levels, Poisson rates) and against a server it starts itself."""

from __future__ import annotations

import json

import pytest

from dspark.cli import build_parser, main
from tests.server.conftest import API_KEY, MODEL


def test_bench_serve_is_a_mode_of_bench():
    from dspark.benchmarks.offline import cmd_bench
    from dspark.benchmarks.serve_bench import cmd_bench_serve

    parser = build_parser()
    assert parser.parse_args(["bench", "--concurrency", "1,4"]).func is cmd_bench
    args = parser.parse_args(["bench", "serve", "--concurrency", "2", "--num-prompts", "3"])
    assert args.func is cmd_bench_serve and args.concurrency == "2"
    with pytest.raises(SystemExit):  # one mode at a time
        parser.parse_args(["bench", "serve", "--concurrency", "2", "--request-rate", "3"])
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:1", "--concurrency", "0"]) == 2
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:1",
                 "--output-len-spread", "1.5"]) == 2  # fmt: skip


def _run(tmp_path, *args: str) -> dict:
    out = tmp_path / "serve.json"
    # the short prompts' sources: every prompt fits the tiny model's 512-token context
    assert main(["bench", "serve", "--num-prompts", "6", "--output-len", "6", "--out", str(out),
                 "--sources", "gsm8k,vicuna,alpaca", *args]) == 0  # fmt: skip
    assert out.with_suffix(".png").stat().st_size > 0
    return json.loads(out.read_text())


def test_concurrency_levels_against_the_speculative_server(spec_server, tmp_path, capsys):
    results = _run(tmp_path, "--base-url", spec_server.url, "--api-key", API_KEY,
                   "--concurrency", "1,4", "--slo-ttft-ms", "60000", "--save-requests")  # fmt: skip
    assert results["model"] == MODEL and results["level_name"] == "concurrency"
    # each level starts with its clients connected: C = 4 finds C = 1's connection open
    assert [level["preconnected"] for level in results["levels"]] == [1, 3]
    for record in results["levels"][1]["requests"]:
        assert record["start"] <= record["sent"] <= record["start"] + record["e2e"]
    for level in results["levels"]:
        s = level["summary"]
        assert s["num_completed"] == 6 and s["output_tokens"] == 36, s
        assert s["ttft_ms"]["median"] > 0 and s["tpot_ms"]["p99"] > 0 and s["itl_ms"]["median"]
        assert s["goodput_requests_per_s"] == pytest.approx(s["requests_per_s"])
        assert level["speculation"]["num_drafts"] > 0
        assert level["speculation"]["mean_acceptance_length"] >= 1
    table = capsys.readouterr().out
    assert "C=1" in table and "C=4" in table


def test_poisson_rates_on_the_completions_endpoint(spec_server, tmp_path):
    from dspark.benchmarks.prompts import output_lengths

    results = _run(tmp_path, "--base-url", spec_server.url, "--api-key", API_KEY, "--endpoint",
                   "completions", "--request-rate", "40,inf", "--slo-tpot-ms", "0.001",
                   "--output-len-spread", "0.5")  # fmt: skip
    assert [lv["label"] for lv in results["levels"]] == ["40/s", "inf/s"]
    assert "preconnected" not in results["levels"][0]  # (no cap: no fixed number of clients)
    lengths = output_lengths(6, 6, 0.5, seed=0)  # the offline bench's lengths, e.g. [5, 8, ...]
    assert len(set(lengths)) > 1 and results["output_len_spread"] == 0.5
    for level in results["levels"]:
        assert level["summary"]["num_completed"] == 6
        assert level["summary"]["output_tokens"] == sum(lengths)
        assert level["summary"]["goodput_requests_per_s"] == 0  # nobody meets 1 us per token


def test_a_bad_key_is_recorded_as_failures(server, tmp_path):
    results = _run(tmp_path, "--base-url", server.url, "--api-key", "wrong", "--model", MODEL,
                   "--no-preconnect")  # fmt: skip
    assert "preconnected" not in results["levels"][0]
    summary = results["levels"][0]["summary"]
    assert summary["num_failed"] == 6 and "HTTP 401" in summary["errors"][0]
    assert results["levels"][0]["speculation"] is None  # a plain server has no such counters


def test_bench_serve_starts_dspark_serve_by_default(tiny_llama_dir, tmp_path):
    server_args = f"{tiny_llama_dir} --device cpu --dtype float32 --max-model-len 256 " \
                  "--num-kv-pages 64"  # fmt: skip
    results = _run(tmp_path, "--server-args", server_args, "--concurrency", "2")
    assert results["base_url"].startswith("http://127.0.0.1:")
    assert results["levels"][0]["summary"]["num_completed"] == 6


class _Transport:
    def __init__(self) -> None:
        self.written = b""

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        pass


def _feed(response: bytes, split: int):
    """An HTTPConnection given `response` in two reads cut at `split`; its events and state."""
    import asyncio

    from dspark.benchmarks.serve_client import HTTPConnection

    async def scenario():
        connection = HTTPConnection()
        connection.connection_made(_Transport())
        connection.post("h:1", "/v1/x", b"{}", {"Authorization": "Bearer k"})
        connection.data_received(response[:split])
        connection.data_received(response[split:])
        events = [data async for _, data in connection.events()]
        return connection, events

    return asyncio.run(scenario())


def test_the_bench_client_parses_chunked_events_cut_anywhere():
    events = [b'data: {"a": 1}\n\n', b'data: {"b": 2}\n\ndata: [DONE]\n\n']
    body = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"
    response = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + body
    for split in range(len(response) + 1):
        connection, data = _feed(response, split)
        assert data == [b'{"a": 1}', b'{"b": 2}', b"[DONE]"], split
        assert connection.status == 200 and connection.is_reusable
    written = connection.transport.written
    assert written.startswith(b"POST /v1/x HTTP/1.1\r\nHost: h:1\r\n")
    assert b"Content-Length: 2\r\nAuthorization: Bearer k\r\n\r\n{}" in written


def test_the_bench_client_reads_a_sized_error_body():
    import asyncio

    body = b'{"error": {"message": "no"}}'
    response = b"HTTP/1.1 401 Unauthorized\r\ncontent-length: %d\r\n" % len(body)
    response += b"connection: close\r\n\r\n" + body
    connection, events = _feed(response, 20)
    assert connection.status == 401 and events == [] and not connection.is_reusable
    assert asyncio.run(connection.read_body()) == body
