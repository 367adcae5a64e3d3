"""Automatic prefix caching: the hash chain, the allocator's page states, admission on cached
pages, and end to end on tiny models: a repeated long prefix computed once, outputs equal to
caching off token for token (plain and speculative, greedy and seeded sampling), every page back
in the pool after preemption and aborts, and no cached page ever written."""

from __future__ import annotations

import hashlib
import random

import pytest
import torch

from dspark import LLM, SamplingParams
from dspark.engine.kv_cache import PageAllocator
from dspark.engine.prefix_cache import PrefixCache, page_hash, root_hash
from dspark.engine.scheduler import Scheduler
from dspark.request import PENDING_TOKEN, Request
from dspark.step_plan import SampledTokens
from tests.tiny_models import (
    TINY_WORDS,
    _llama_config,
    make_tiny_drafter,
    make_tiny_vocab_tokenizer,
    save_random_model,
)

PAGE = 4  # the unit tests' page size


def _req(rid: str, prompt: list[int], max_tokens: int = 4) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return Request(rid, list(prompt), params, 0, eos_token_id=None, arrival_time=0.0)


# ---- the hash chain -------------------------------------------------------------------------


def test_a_page_hash_names_its_tokens_and_everything_before_them():
    root = root_hash("")
    h0 = page_hash(root, [5, 6, 7, 8])
    assert page_hash(root, [5, 6, 7, 8]) == h0  # deterministic
    assert page_hash(h0, [9, 10, 11, 12]) != page_hash(root, [9, 10, 11, 12])  # the parent counts
    assert page_hash(root, [5, 6, 7, 9]) != h0
    assert page_hash(root_hash("drafter:abc"), [5, 6, 7, 8]) != h0  # the extra key counts
    # token ids are hashed as 64-bit integers: no two token lists share a byte string
    assert page_hash(root, [1, 256]) != page_hash(root, [256, 1])


def test_only_full_pages_of_known_tokens_are_hashed():
    cache = PrefixCache(PageAllocator(8), PAGE)
    req = _req("a", [5, 6, 7, 8, 9, 10, 11, 12, 13, 14])  # pages [5..8] [9..12], partial [13 14]
    hashes = cache.page_hashes(req, 3)
    assert len(hashes) == 2  # (a third page would be partial: page_hashes stops at the tokens)
    assert hashes == [page_hash(cache.root, [5, 6, 7, 8]),
                      page_hash(hashes[0], [9, 10, 11, 12])]  # fmt: skip
    pending = _req("b", [5, 6, 7, 8, 9, 10, 11])
    pending.token_ids.append(PENDING_TOKEN)  # its last token still on the device
    assert len(cache.page_hashes(pending, 2)) == 1


# ---- the allocator's page states ------------------------------------------------------------


def test_cached_pages_are_shared_reference_counted_and_evicted_last_and_lru():
    alloc = PageAllocator(7)  # pages 1..6
    a = alloc.allocate(3)
    assert a == [1, 2, 3]
    for page, h in zip(a, [b"h1", b"h2", b"h3"], strict=True):
        assert alloc.publish(page, h)
    assert alloc.lookup([b"h1", b"h2", b"x", b"h3"]) == [1, 2]  # the longest run from the first
    alloc.share([1, 2])  # a second request hits pages 1, 2
    assert [alloc.ref_count(p) for p in a] == [2, 2, 1]
    alloc.free(a)  # the first request ends: page 3 cached, unheld
    assert [alloc.ref_count(p) for p in a] == [1, 1, 0]
    assert alloc.num_free == 4  # pages 4, 5, 6 free and page 3 evictable
    assert alloc.num_free_after_sharing([1, 2, 3]) == 3  # sharing page 3 takes it off the pool
    alloc.free([1, 2])
    assert alloc.num_free == 6 and alloc.num_cached == 3
    # free pages go first; then cached ones, least recently freed first, and a request's last
    # page before its first (freed in reverse: 3 then 2, 1)
    assert alloc.allocate(3) == [4, 5, 6]
    assert alloc.allocate(1) == [3] and alloc.num_evictions == 1
    assert alloc.lookup([b"h1", b"h2", b"h3"]) == [1, 2]  # h3 evicted with its page
    assert not alloc.publish(alloc.allocate(1)[0], b"h1")  # a duplicate stays private


def test_a_page_freed_twice_fails_loudly():
    alloc = PageAllocator(3)
    pages = alloc.allocate(1)
    alloc.free(pages)
    with pytest.raises(AssertionError, match="no reference"):
        alloc.free(pages)


# ---- the scheduler --------------------------------------------------------------------------


def _scheduler(num_pages: int = 32, cache: bool = True, budget: int = 64) -> Scheduler:
    alloc = PageAllocator(num_pages)
    prefix = PrefixCache(alloc, PAGE) if cache else None
    return Scheduler(alloc, PAGE, 8, budget, 64, prefix_cache=prefix)


def _step(s: Scheduler, token: int = 7):
    plan = s.schedule()
    s.advance(plan)
    s.update(plan, [SampledTokens((token,)) if r.do_sample else None for r in plan.rows])
    return plan


def test_a_repeated_prefix_is_admitted_on_its_cached_pages():
    s = _scheduler()
    prompt = list(range(3, 3 + 18))  # 18 tokens: 4 full pages, then 2
    s.add(_req("a", prompt))
    _step(s)
    assert s.prefix_cache.num_hits == 0 and s.prefix_cache.num_queries == 18
    first = s.running[0].page_ids[:4]
    s.add(_req("b", prompt + [30]))
    (row,) = [r for r in _step(s).rows if r.request.request_id == "b"]
    assert (row.start, row.num_tokens) == (16, 3)  # starts after its 4 cached pages
    b = s.running[1]
    assert b.page_ids[:4] == first and s.prefix_cache.num_hits == 16
    assert all(s.allocator.ref_count(p) == 2 for p in first)
    # a prompt of whole pages leaves its last token to compute (it samples the next one)
    s.add(_req("c", prompt[:16]))
    (row,) = [r for r in _step(s).rows if r.request.request_id == "c"]
    assert (row.start, row.num_tokens) == (12, 4)
    while s.has_unfinished:
        _step(s)
    alloc = s.allocator
    assert alloc.num_free == alloc.num_usable
    assert all(alloc.ref_count(p) == 0 for p in range(1, alloc.num_pages))


def test_decoded_tokens_are_published_once_their_page_is_full():
    s = _scheduler()
    s.add(_req("a", [3, 4, 5], max_tokens=10))
    for _ in range(6):  # prompt 3 + tokens: positions 0..7 computed after 6 steps
        _step(s, token=9)
    a = s.running[0]
    assert a.num_computed_tokens == 8 and a.num_published_pages == 2
    assert s.allocator.lookup(s.prefix_cache.page_hashes(a, 2)) == a.page_ids[:2]


def test_preemption_drops_references_and_the_request_finds_its_own_pages_again():
    s = _scheduler(num_pages=13, budget=64)  # 12 usable pages: one request alone needs 11
    s.add(_req("a", list(range(3, 15)), max_tokens=30))  # 12 tokens: 3 pages
    s.add(_req("b", list(range(40, 52)), max_tokens=30))
    while s.num_preemptions == 0:
        _step(s)
    assert s.prefix_cache.num_hits == 0
    while s.has_unfinished:
        _step(s)
    # the preempted request was readmitted on its own published pages, not evicted meanwhile
    assert s.prefix_cache.num_hits > 0
    alloc = s.allocator
    assert alloc.num_free == alloc.num_usable
    assert all(alloc.ref_count(p) == 0 for p in range(1, alloc.num_pages))


def test_caching_off_admits_as_before():
    s = _scheduler(cache=False)
    s.add(_req("a", list(range(3, 21))))
    _step(s)
    s.add(_req("b", list(range(3, 21))))
    (row,) = [r for r in _step(s).rows if r.request.request_id == "b"]
    assert row.start == 0 and s.allocator.num_cached == 0


# ---- end to end on a tiny model ------------------------------------------------------------

PREFIX_LEN = 1000


@pytest.fixture(scope="module")
def long_vocab_dir(tmp_path_factory):
    """The 12-word model (make_tiny_vocab_model's) with a 2,048-token context."""
    directory = tmp_path_factory.mktemp("tiny_vocab_long")
    config = _llama_config(len(TINY_WORDS), num_hidden_layers=1, eos_token_id=1,
                           bos_token_id=None, initializer_range=0.8,
                           max_position_embeddings=2048)  # fmt: skip
    save_random_model(directory, config, seed=1)
    make_tiny_vocab_tokenizer().save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def long_drafter(long_vocab_dir, tmp_path_factory):
    return make_tiny_drafter(long_vocab_dir, tmp_path_factory.mktemp("drafter_long"), taps=(0,))


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    """n prompts: one shared 1,000-token prefix, then 3 to 20 tokens of their own."""
    rng = random.Random(seed)
    prefix = [rng.randrange(2, len(TINY_WORDS)) for _ in range(PREFIX_LEN)]
    return [prefix + [rng.randrange(2, len(TINY_WORDS)) for _ in range(rng.randint(3, 20))]
            for _ in range(n)]  # fmt: skip


def _params(n: int, sampled: bool) -> list[SamplingParams]:
    if not sampled:
        return [SamplingParams(temperature=0, max_tokens=12 + i, ignore_eos=True) for i in range(n)]
    return [SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=12 + i,
                           ignore_eos=True) for i in range(n)]  # fmt: skip


def _llm(model_dir, caching: bool, drafter=None, **kw) -> LLM:
    spec = None if drafter is None else {"model": str(drafter), "num_speculative_tokens": 3}
    kw = dict(dtype="float32", device="cpu", num_kv_pages=256, max_model_len=1100,
              max_num_batched_tokens=512, enable_prefix_caching=caching,
              speculative_config=spec) | kw  # fmt: skip
    llm = LLM(str(model_dir), **kw)
    if drafter is not None:  # windows K + 1 wide: drafting steps launched ahead (continuations)
        llm.engine.runner.spec_runner.uniform_windows = True
    return llm


def _page_digest(caches, page: int) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for kv in caches:
        h.update(kv[:, page].contiguous().numpy().tobytes())
    return h.digest()


def watch_cached_pages(engine) -> dict[str, int]:
    """Check at every step that no page cached before the step is written by it, in the
    target's KV cache or the drafter's: the digests of the pages cached when advance() starts
    are compared with theirs after the launch (on the CPU the step has run by then), for every
    page still cached under the same hash. Returns the counts of checks, updated as it runs."""
    caches = list(engine.runner.kv_caches) + (list(engine.spec.kv_caches) if engine.spec else [])
    sched, runner, alloc = engine.scheduler, engine.runner, engine.allocator
    advance, launch = sched.advance, runner.launch
    before: dict[bytes, tuple[int, bytes]] = {}
    counts = {"steps": 0, "pages": 0}

    def checked_advance(plan):
        before.clear()
        before.update({h: (p, _page_digest(caches, p)) for h, p in alloc.cached_pages().items()})
        advance(plan)

    def checked_launch(plan):
        step = launch(plan)
        now = alloc.cached_pages()
        for h, (page, digest) in before.items():
            if now.get(h) == page:
                assert _page_digest(caches, page) == digest, f"cached page {page} was written"
                counts["pages"] += 1
        counts["steps"] += 1
        return step

    sched.advance, runner.launch = checked_advance, checked_launch
    return counts


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_a_repeated_1000_token_prefix_is_computed_once_with_the_same_outputs(
    long_vocab_dir, sampled
):
    prompts, params = _prompts(4), _params(4, sampled)
    runs = {}
    for caching in (False, True):
        llm = _llm(long_vocab_dir, caching)
        first = llm.generate(prompts[:1], params[:1], use_tqdm=False)
        rest = llm.generate(prompts[1:], params[1:], use_tqdm=False)
        runs[caching] = (_tokens(first + rest), llm.engine)
    assert runs[True][0] == runs[False][0]
    cached, uncached = runs[True][1], runs[False][1]
    cache = cached.prefix_cache
    # the later three found the prefix's 62 full pages (992 tokens) cached
    assert cache.num_hits == 3 * (PREFIX_LEN // 16) * 16
    assert cache.num_queries == sum(len(p) for p in prompts)
    computed = cached.scheduler.num_prompt_tokens_computed
    assert computed == sum(len(p) for p in prompts) - cache.num_hits
    assert uncached.scheduler.num_prompt_tokens_computed == sum(len(p) for p in prompts)
    assert uncached.prefix_cache is None


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_speculative_outputs_and_drafts_are_the_same_with_a_cached_prefix(
    long_vocab_dir, long_drafter, sampled
):
    """Outputs, windows and accepted drafts equal caching off, and no step writes a cached page
    of either cache (the context's values themselves: the test below; a random tiny drafter's
    acceptance barely depends on them)."""
    prompts, params = _prompts(4, seed=1), _params(4, sampled)
    runs = {}
    for caching in (False, True):
        llm = _llm(long_vocab_dir, caching, long_drafter)
        counts = watch_cached_pages(llm.engine)
        outputs = llm.generate(prompts[:1], params[:1], use_tqdm=False)
        outputs += llm.generate(prompts[1:], params[1:], use_tqdm=False)
        metrics = llm.engine.get_metrics()
        runs[caching] = (_tokens(outputs), metrics["num_accepted_tokens"], metrics["num_drafts"])
        if caching:
            assert llm.engine.prefix_cache.num_hits == 3 * (PREFIX_LEN // 16) * 16
            assert counts["pages"] > 0  # cached pages were there to check, and none written
    assert runs[True] == runs[False]
    assert runs[True][2] > 0


def _prefix_kv(engine, req_id: str, num_positions: int) -> list:
    """[2, positions, nkv, hd] per layer of the target's cache, then the drafter's: the K/V the
    request's page table holds at its first num_positions positions."""
    req = engine._requests[req_id]
    pos = torch.arange(num_positions)
    pages = torch.tensor(req.page_ids)[pos // 16]
    caches = list(engine.runner.kv_caches) + list(engine.spec.kv_caches)
    return [kv[:, pages, pos % 16].clone() for kv in caches]


def test_a_cached_prefix_holds_the_context_an_uncached_prefill_computes(
    long_vocab_dir, long_drafter
):
    """The second request's prefix, found in the cache, holds the target's K/V and the drafter's
    context that computing it would give (what lets the drafter draft over a cached prefix as
    over its own prefill: its outputs could not show it, since verification is lossless)."""
    prompts, params = _prompts(2, seed=3), _params(2, sampled=False)
    num_positions = len(prompts[1]) - 1
    kv = {}
    for caching in (False, True):
        llm = _llm(long_vocab_dir, caching, long_drafter)
        llm.generate(prompts[:1], params[:1], use_tqdm=False)
        engine = llm.engine
        engine.add_request("b", prompts[1], params[1])
        while engine._requests["b"].is_prefilling:
            engine.step()
        kv[caching] = _prefix_kv(engine, "b", num_positions)
        if caching:
            assert engine.prefix_cache.num_hits == (PREFIX_LEN // 16) * 16
    for cached, computed in zip(kv[True], kv[False], strict=True):
        torch.testing.assert_close(cached, computed, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_page_pressure_preemption_and_aborts_return_every_page(
    long_vocab_dir, long_drafter, speculative
):
    """Few pages for many requests sharing a prefix: preemptions (recomputed on cached pages),
    aborts mid-prefill and mid-decode; outputs of the others equal caching off, no cached page
    is written, and at the end every page is back in the pool with no reference left."""
    prompts = [p[:300] + p[PREFIX_LEN:] for p in _prompts(8, seed=2)]  # 300-token shared prefix
    params = _params(8, sampled=False)
    drafter = long_drafter if speculative else None
    aborted = {"2", "5"}
    seen = {}
    for caching in (False, True):
        llm = _llm(long_vocab_dir, caching, drafter, num_kv_pages=30,
                   max_num_batched_tokens=128, max_num_seqs=8, max_model_len=400)  # fmt: skip
        engine = llm.engine
        counts = watch_cached_pages(engine) if caching else None
        for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
            engine.add_request(str(i), prompt, sp)
        finals, num_steps = {}, 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out.outputs[0].token_ids
            num_steps += 1
            if num_steps == 3:
                engine.abort_request("2")  # mid-prefill (128 tokens a step)
            if num_steps == 14:
                engine.abort_request("5")
        alloc = engine.allocator
        assert alloc.num_free == alloc.num_usable
        assert all(alloc.ref_count(p) == 0 for p in range(1, alloc.num_pages))
        assert engine.scheduler.num_preemptions > 0
        seen[caching] = {k: v for k, v in finals.items() if k not in aborted}
        if caching:
            assert engine.prefix_cache.num_hits > 0 and counts["pages"] > 0
    assert seen[True] == seen[False] and len(seen[True]) == 6


def test_the_stats_line_reports_the_hit_rate(tiny_vocab_dir, caplog):
    llm = LLM(str(tiny_vocab_dir), dtype="float32", device="cpu", num_kv_pages=32,
              log_stats_interval_s=1e-9)  # fmt: skip
    prompt = [2, 3, 4, 5] * 9  # 36 tokens: 2 full pages found by the second request
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)
    with caplog.at_level("INFO", logger="dspark.engine.stats"):
        llm.generate([prompt], params, use_tqdm=False)
    assert "prefix cache hit rate 88.9%" in caplog.text  # 32 of 36 tokens
