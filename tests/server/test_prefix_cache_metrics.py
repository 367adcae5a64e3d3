"""vllm:prefix_cache_queries / hits over HTTP: a repeated prompt is found in the cache, in
tokens as vLLM counts them; with caching off both stay 0."""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("fastapi")
from dspark import LLM  # noqa: E402
from dspark.server.wire import EngineStats, stats_of  # noqa: E402
from tests.server.conftest import MODEL, auth  # noqa: E402

PAGE = 16  # EngineConfig's page_size


def _counter(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    line = next(s for s in text.splitlines() if s.startswith(f'{name}{{model_name="{MODEL}"}}'))
    return float(line.split()[-1])


def test_a_repeated_prompt_counts_its_cached_pages_as_hits(server):
    prompt = " ".join(f"word{i}" for i in range(40))  # ~80 tokens: several full pages
    queries = _counter(server.url, "vllm:prefix_cache_queries_total")
    hits = _counter(server.url, "vllm:prefix_cache_hits_total")
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0}
    texts = []
    for _ in range(2):  # one after the other: the second finds the first's published pages
        response = httpx.post(f"{server.url}/v1/completions", json=body, headers=auth())
        assert response.status_code == 200, response.text
        texts.append(response.json()["choices"][0]["text"])
        num_prompt = response.json()["usage"]["prompt_tokens"]
    server.wait_idle()
    assert texts[0] == texts[1]
    assert num_prompt > 2 * PAGE
    new_queries = _counter(server.url, "vllm:prefix_cache_queries_total") - queries
    new_hits = _counter(server.url, "vllm:prefix_cache_hits_total") - hits
    assert new_queries == 2 * num_prompt
    assert new_hits == (num_prompt - 1) // PAGE * PAGE  # its full pages, the last token computed
    server.assert_pages_free()  # cached pages no request holds count as free


def test_with_caching_off_the_counters_stay_zero(tiny_vocab_dir):
    llm = LLM(str(tiny_vocab_dir), dtype="float32", device="cpu", num_kv_pages=32,
              enable_prefix_caching=False)  # fmt: skip
    llm.generate([[2, 3, 4] * 12] * 2, use_tqdm=False)
    stats = EngineStats(*stats_of(llm.engine, with_spec=False, with_requests=False))
    assert (stats.num_prefix_cache_queries, stats.num_prefix_cache_hits) == (0, 0)
