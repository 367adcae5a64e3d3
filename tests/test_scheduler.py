"""Scheduler and page allocator: budgets, chunked prefill, admission by pages, preemption."""

from __future__ import annotations

import pytest

from dspark.engine.kv_cache import PageAllocator
from dspark.engine.scheduler import Scheduler
from dspark.request import FinishReason, Request, RequestStatus
from dspark.sampling_params import SamplingParams
from dspark.step_plan import SCRATCH_PAGE, SampledTokens


def _req(rid: str, prompt_len: int, max_tokens: int = 4, temperature: float = 0.0) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature)
    return Request(rid, list(range(3, 3 + prompt_len)), params, 0, eos_token_id=2, arrival_time=0.0)


def _scheduler(num_pages=64, page_size=4, max_num_seqs=8, budget=16, max_model_len=64):
    return Scheduler(PageAllocator(num_pages), page_size, max_num_seqs, budget, max_model_len)


def _step(s: Scheduler, token: int = 7):
    plan = s.schedule()
    s.advance(plan)
    s.update(plan, [SampledTokens((token,)) if r.do_sample else None for r in plan.rows])
    return plan


def test_allocator_never_hands_out_the_scratch_page():
    alloc = PageAllocator(5)
    pages = alloc.allocate(4)
    assert SCRATCH_PAGE not in pages and sorted(pages) == [1, 2, 3, 4]
    with pytest.raises(MemoryError):
        alloc.allocate(1)
    alloc.free(pages)
    assert alloc.num_free == 4


def test_chunked_prefill_splits_a_long_prompt_across_steps():
    s = _scheduler(budget=16)
    s.add(_req("a", 40))
    chunks = [_step(s).rows[0] for _ in range(3)]
    assert [(c.start, c.num_tokens, c.do_sample) for c in chunks] == [
        (0, 16, False),
        (16, 16, False),
        (32, 8, True),
    ]
    assert s.running[0].num_output_tokens == 1


def test_decodes_come_first_and_the_budget_is_shared():
    s = _scheduler(budget=16)
    s.add(_req("a", 3))
    _step(s)  # a prefilled, now decoding
    s.add(_req("b", 30))
    plan = _step(s)
    assert [(r.request.request_id, r.num_tokens) for r in plan.rows] == [("a", 1), ("b", 15)]


def test_admission_stops_when_pages_run_out():
    # 5 usable pages of 4 tokens: "a" (12 tokens) takes 3, "b" (12) does not fit beside it
    s = _scheduler(num_pages=6, budget=32)
    s.add(_req("a", 12))
    s.add(_req("b", 12))
    plan = s.schedule()
    assert [r.request.request_id for r in plan.rows] == ["a"]
    assert [r.request_id for r in s.waiting] == ["b"]


def test_preemption_recomputes_the_newest_request_and_frees_everything_at_the_end():
    s = _scheduler(num_pages=7, budget=32, max_model_len=64)  # 6 usable pages
    a, b = _req("a", 8, max_tokens=10), _req("b", 8, max_tokens=10)
    s.add(a)
    s.add(b)
    for _ in range(20):
        if not s.has_unfinished:
            break
        _step(s)
    assert s.num_preemptions > 0 and b.num_preemptions > 0
    assert a.finish_reason == b.finish_reason == FinishReason.LENGTH
    assert a.num_output_tokens == b.num_output_tokens == 10
    assert s.allocator.num_free == s.allocator.num_usable


def test_sampling_requests_are_counted_while_they_run():
    """num_sampling (what the drafting policy prices a step by) counts the running requests
    that sample, through admission, preemption, re-admission and finish."""
    s = _scheduler(num_pages=7, budget=32, max_model_len=64)  # 6 usable pages: b is preempted
    a, b = _req("a", 8, max_tokens=10), _req("b", 8, max_tokens=10, temperature=1.0)
    s.add(a)
    s.add(b)
    assert s.num_sampling == 0  # (waiting)
    seen = set()
    while s.has_unfinished:
        _step(s)
        running = sum(r.sampling_params.temperature > 0 for r in s.running)
        assert s.num_sampling == running
        seen.add(running)
    assert b.num_preemptions > 0 and seen == {0, 1} and s.num_sampling == 0


def test_prefilled_says_whether_the_last_plan_admitted_or_prefilled():
    s = _scheduler(budget=16)
    s.add(_req("a", 20))
    assert _step(s).rows[0].num_tokens == 16 and s.prefilled  # admitted, a first chunk
    _step(s)
    assert s.prefilled  # its last chunk
    _step(s)
    assert not s.prefilled  # a decode row
    s.add(_req("b", 3))
    _step(s)
    assert s.prefilled


def test_finish_frees_pages_and_abort_of_a_waiting_request():
    s = _scheduler()
    a, b = _req("a", 5), _req("b", 5)
    s.add(a)
    _step(s)
    s.add(b)
    s.finish(a, FinishReason.ABORT, None)
    s.finish(b, FinishReason.ABORT, None)
    assert a.status == b.status == RequestStatus.FINISHED
    assert s.allocator.num_free == s.allocator.num_usable and not s.has_unfinished


def test_max_num_seqs_limits_running_requests():
    s = _scheduler(max_num_seqs=2, budget=16)
    for i in range(4):
        s.add(_req(str(i), 2))
    assert len(s.schedule().rows) == 2


def test_plan_is_decode_only_when_every_row_is_one_sampled_token():
    s = _scheduler(budget=16)
    s.add(_req("a", 5, max_tokens=10))
    s.add(_req("b", 20, max_tokens=10))  # prefilled in two chunks (budget 16)
    first = _step(s)
    assert not first.is_decode  # prefill chunks
    plan = _step(s)  # a decodes, b's second chunk
    assert [r.num_tokens for r in plan.rows] == [1, 9] and not plan.is_decode
    plan = _step(s)
    assert [r.num_tokens for r in plan.rows] == [1, 1] and plan.is_decode


def test_max_num_tokens_is_the_length_limit():
    s = _scheduler(max_model_len=64)
    short, capped = _req("a", 5, max_tokens=3), _req("b", 50, max_tokens=40)
    s.add(short)
    s.add(capped)
    assert short.max_num_tokens == 8  # 5 prompt + 3 outputs
    assert capped.max_num_tokens == 64  # max_model_len first
