"""Load: 200 concurrent streams, a random third cancelled mid-stream, on one real server."""

from __future__ import annotations

import asyncio
import json
import random
import re

import httpx

from tests.server.conftest import MODEL, auth

NUM_REQUESTS = 200
NUM_TOKENS = 8  # each completed stream's length (ignore_eos)
CANCELLED_TOKENS = 100  # long enough that a cancelled stream is still running when it leaves


def _finished_by_reason(live) -> dict[str, float]:
    text = httpx.get(f"{live.url}/metrics").text
    pattern = r'^vllm:request_success_total\{.*finished_reason="(\w+)"\} (\S+)$'
    return {m[1]: float(m[2]) for m in re.finditer(pattern, text, re.M)}


async def _stream(client: httpx.AsyncClient, url: str, index: int, cancel: bool) -> dict:
    body = {"model": MODEL, "prompt": f"Request number {index}:", "temperature": 0,
            "max_tokens": CANCELLED_TOKENS if cancel else NUM_TOKENS, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True}  # fmt: skip
    result = {"index": index, "text": "", "token_ids": [], "finish": None, "usage": None,
              "done": False, "ids": set()}  # fmt: skip
    async with client.stream("POST", url, json=body, headers=auth()) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                result["done"] = True
                break
            chunk = json.loads(line.removeprefix("data: "))
            result["ids"].add(chunk["id"])
            if not chunk["choices"]:
                result["usage"] = chunk["usage"]
                continue
            (choice,) = chunk["choices"]
            result["text"] += choice["text"]
            result["token_ids"] += choice["token_ids"]
            result["finish"] = choice["finish_reason"] or result["finish"]
            if cancel and result["token_ids"]:
                return result  # leaving the block closes the connection mid-stream
    return result


async def _watch_health(url: str, stop: asyncio.Event, statuses: list[int]) -> None:
    async with httpx.AsyncClient() as client:
        while not stop.is_set():
            statuses.append((await client.get(f"{url}/health")).status_code)
            await asyncio.sleep(0.05)


async def _run_load(live, cancelled: set[int]) -> tuple[list[dict], list[int]]:
    limits = httpx.Limits(max_connections=NUM_REQUESTS + 10)
    stop, statuses = asyncio.Event(), []
    async with httpx.AsyncClient(limits=limits, timeout=120) as client:
        watcher = asyncio.create_task(_watch_health(live.url, stop, statuses))
        url = f"{live.url}/v1/completions"
        results = await asyncio.gather(
            *(_stream(client, url, i, i in cancelled) for i in range(NUM_REQUESTS))
        )
        stop.set()
        await watcher
    return results, statuses


def test_concurrent_streams_with_a_third_cancelled(server):
    cancelled = set(random.Random(0).sample(range(NUM_REQUESTS), NUM_REQUESTS // 3))
    before = _finished_by_reason(server)
    results, statuses = asyncio.run(_run_load(server, cancelled))
    tokenizer = server.tokenizer
    # a stream to cancel whose first read already holds its whole output (chunks coalesce when
    # the client is slow to read) finished before its client could leave: it counts as completed
    left = {r["index"] for r in results if r["index"] in cancelled and r["finish"] is None}
    assert len(left) >= len(cancelled) // 2, (len(left), len(cancelled))
    for r in results:
        assert len(r["ids"]) == 1  # every chunk of a stream carries its one id
        if r["index"] in left:
            assert r["token_ids"]
            continue
        num_tokens = CANCELLED_TOKENS if r["index"] in cancelled else NUM_TOKENS
        assert r["finish"] == "length", r
        assert len(r["token_ids"]) == num_tokens, r
        if r["index"] in cancelled:
            continue  # it left on its first chunk, before the usage chunk
        assert r["done"] and r["usage"]["completion_tokens"] == NUM_TOKENS
        # nothing lost or repeated: the streamed pieces are exactly the tokens' text
        assert tokenizer.decode(r["token_ids"]) == r["text"]
    assert len({next(iter(r["ids"])) for r in results}) == NUM_REQUESTS
    server.wait_idle()
    after = _finished_by_reason(server)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert delta["abort"] == len(left)
    assert delta["length"] == NUM_REQUESTS - len(left)
    assert sum(delta.values()) == NUM_REQUESTS
    server.assert_pages_free()
    metrics = httpx.get(f"{server.url}/metrics").text
    assert re.search(r"^dspark:kv_cache_pages_used\{.*\} 0\.0$", metrics, re.M)
    assert statuses and set(statuses) == {200}
