"""Drafting steps launched ahead change no output: step N+1's windows are scheduled and
launched before step N's verification reaches the host, their anchors taken from N on the
device. CPU, tiny models, windows laid out K + 1 wide as the speculative graphs lay them out."""

from __future__ import annotations

import pytest
import torch

from dspark import LLM, SamplingParams
from dspark.runner.continuations import next_anchors, write_continuations
from dspark.runner.input_buffers import InputBuffers
from dspark.spec.spec_buffers import SpecBuffers
from dspark.step_plan import SCRATCH_PAGE
from tests.helpers import assert_same_finished, assert_same_logprobs, assert_same_run
from tests.spec.test_async_spec import _run as switching_run
from tests.tiny_models import make_tiny_drafter

PROMPTS = [[2, 3, 4], [5, 6, 7, 8, 9, 10, 11, 2, 3, 4, 5], [9], [4, 4, 4, 4, 4, 4, 4], [3, 5],
           [6, 2, 8], [10, 11], [7, 7, 1, 2]]  # fmt: skip


@pytest.fixture(scope="module")
def drafter(tiny_vocab_dir, tmp_path_factory):
    return make_tiny_drafter(tiny_vocab_dir, tmp_path_factory.mktemp("drafter_ahead"), taps=(0,))


def _llm(model_dir, drafter, async_scheduling: bool, **kw) -> LLM:
    llm = LLM(str(model_dir), dtype="float32", device="cpu", async_scheduling=async_scheduling,
              speculative_config={"model": str(drafter), "num_speculative_tokens": 3},
              **kw)  # fmt: skip
    llm.engine.runner.spec_runner.uniform_windows = True
    return llm


def _seen(outputs):
    return [(c.token_ids, c.text, c.finish_reason, c.stop_reason)
            for c in (o.outputs[0] for o in outputs)]  # fmt: skip


def _params(sync: LLM) -> list[SamplingParams]:
    """Stops placed on tokens and text the requests really produce (from a greedy run)."""
    probe = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    full = [o.outputs[0] for o in sync.generate(PROMPTS, probe, use_tqdm=False)]
    ids, texts = [c.token_ids for c in full], [c.text for c in full]
    return [
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[ids[0][9]]),
        SamplingParams(temperature=0, max_tokens=30, stop=texts[1][10:13] or "e"),
        SamplingParams(temperature=0, max_tokens=13, ignore_eos=True),  # ends inside a block
        SamplingParams(
            temperature=0.9, top_p=0.8, seed=3, max_tokens=27, ignore_eos=True, logprobs=2
        ),  # fmt: skip
        SamplingParams(temperature=0, max_tokens=22, logprobs=1, ignore_eos=True),
        SamplingParams(temperature=0.7, top_k=5, seed=5, max_tokens=25),
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, use_speculation=False),
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[ids[7][2]], min_tokens=12),
    ]


@pytest.mark.parametrize(
    "kw",
    [dict(num_kv_pages=256, max_num_batched_tokens=64, max_num_seqs=8),
     dict(num_kv_pages=256, max_num_batched_tokens=64, max_num_seqs=3),
     dict(num_kv_pages=7, max_model_len=64, max_num_batched_tokens=64, max_num_seqs=4)],
    ids=["roomy", "admission", "preemption"],
)  # fmt: skip
def test_drafting_steps_launched_ahead_equal_sync(tiny_vocab_dir, drafter, kw):
    sync = _llm(tiny_vocab_dir, drafter, False, **kw)
    params = _params(sync)
    expected = sync.generate(PROMPTS, params, use_tqdm=False)
    fast = _llm(tiny_vocab_dir, drafter, True, **kw)
    got = fast.generate(PROMPTS, params, use_tqdm=False)
    if kw["num_kv_pages"] == 7:
        # a request whose first token is in flight behind a mixed step drafts its first window
        # a step late (engine/ahead.py), which moves where pages run out among the requests:
        # the same tokens and logprobs, another preemption's windows (here one request took
        # one recomputing prefill fewer, then one window more)
        assert _seen(got) == _seen(expected)
        assert_same_logprobs(got, expected)
    else:
        assert_same_run(got, expected, _seen)
    stats, e = fast.engine.runner.stats, fast.engine
    assert stats["spec_steps_launched_ahead"] > 0, dict(stats)  # not vacuous
    assert stats["continuation_windows"] > 0, dict(stats)
    assert sync.engine.runner.stats["spec_steps_launched_ahead"] == 0
    # near max_tokens: deferred where the window in flight could emit the last token (the
    # windows the device shortens need accepted drafts: test_async_spec's 4,000 requests)
    assert e.scheduler.num_windows_deferred > 0
    if kw["num_kv_pages"] == 7:
        assert e.scheduler.num_preemptions > 0
        assert stats["spec_steps_not_ahead_kv_pages"] > 0
    assert e.allocator.num_free == e.allocator.num_usable
    assert not e.scheduler.has_unfinished and e._in_flight is None


@pytest.mark.parametrize("period", [1, 3])
@pytest.mark.parametrize(
    "kw",
    [dict(num_kv_pages=256, max_num_batched_tokens=64, max_num_seqs=8),
     dict(num_kv_pages=7, max_model_len=64, max_num_batched_tokens=64, max_num_seqs=4)],
    ids=["roomy", "preemption"],
)  # fmt: skip
def test_drafting_steps_launched_behind_plain_steps_equal_sync(tiny_vocab_dir, drafter, kw,
                                                               period):  # fmt: skip
    """Drafting switched on and off as the policy switches it: a drafting step is launched
    behind the plain step in flight, its windows' anchors (the tokens that step samples)
    taken there on the device. Stops, min_tokens, a request that never drafts, seeded
    sampling and preemption give the outputs of the synchronous engine switched alike."""
    sync = _llm(tiny_vocab_dir, drafter, False, **kw)
    params = _params(sync)
    expected, _ = switching_run(sync.engine, params, period)
    fast = _llm(tiny_vocab_dir, drafter, True, **kw)
    got, _ = switching_run(fast.engine, params, period)
    assert_same_finished(got, expected)
    stats, e = fast.engine.runner.stats, fast.engine
    assert stats["spec_steps_launched_ahead_after_plain"] > 0, dict(stats)  # not vacuous
    assert stats["fed_anchor_windows"] > 0
    assert e.allocator.num_free == e.allocator.num_usable
    assert not e.scheduler.has_unfinished and e._in_flight is None
    if kw["num_kv_pages"] == 7:
        assert e.scheduler.num_preemptions > 0


def test_switched_off_runs_drafting_steps_synchronously(tiny_vocab_dir, drafter):
    llm = _llm(tiny_vocab_dir, drafter, False, num_kv_pages=64)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    llm.generate(PROMPTS[:3], params, use_tqdm=False)
    stats = llm.engine.runner.stats
    assert stats["eager_spec_steps"] > 0 and stats["spec_steps_launched_ahead"] == 0


def test_abort_while_a_window_is_in_flight(tiny_vocab_dir, drafter):
    """Aborting a request whose window is in flight (and whose next window may already be
    launched behind it): its output stops there, the others are unchanged, no page leaks."""
    kw = dict(num_kv_pages=256, max_num_batched_tokens=64, max_num_seqs=8)
    params = [SamplingParams(temperature=0 if i % 2 else 0.8, seed=i, max_tokens=24 + i,
                             ignore_eos=True) for i in range(len(PROMPTS))]  # fmt: skip
    want = _llm(tiny_vocab_dir, drafter, False, **kw).generate(PROMPTS, params, use_tqdm=False)
    engine = _llm(tiny_vocab_dir, drafter, True, **kw).engine
    for i, (prompt, p) in enumerate(zip(PROMPTS, params, strict=True)):
        engine.add_request(str(i), prompt, p)
    done, aborted_in_flight = {}, False
    while engine.has_unfinished_requests():
        req = engine._requests.get("1")
        if not aborted_in_flight and req is not None and req.num_windows_in_flight:
            if engine.runner.stats["spec_steps_launched_ahead"] >= 2:
                engine.abort_request("1")
                aborted_in_flight = True
        done.update({o.request_id: o.outputs[0] for o in engine.step() if o.finished})
    assert aborted_in_flight
    assert done["1"].finish_reason == "abort"
    full = want[1].outputs[0].token_ids
    assert done["1"].token_ids == full[: len(done["1"].token_ids)]
    assert len(done["1"].token_ids) < len(full)
    for i in range(len(PROMPTS)):
        if i != 1:
            assert done[str(i)].token_ids == want[i].outputs[0].token_ids, i
    assert engine.allocator.num_free == engine.allocator.num_usable


def test_next_anchors_worked_example():
    """The example above next_anchors (K = 3)."""
    a, b, c, e = 5, 6, 7, 8
    tokens = torch.tensor([[a, b, c, 0], [e, 0, 0, 0]])
    pos, tok = next_anchors(torch.tensor([9, 4]), tokens, torch.tensor([2, 0]))
    assert pos.tolist() == [12, 5]
    assert tok.tolist() == [c, e]


def test_write_continuations_worked_example():
    """The example above write_continuations: window row 1 of width 4, anchor at 1."""
    cpu = torch.device("cpu")
    b = InputBuffers(max_num_tokens=16, max_num_rows=4, max_pages_per_row=4, device=cpu)
    sb = SpecBuffers(max_rows=4, draft_len=3, page_size=4, device=cpu)
    b.np("block_table")[1, :2] = [7, 2]
    b.np("positions")[:] = -1
    rows = torch.tensor([1])
    sb.verify_len[1] = sb.verify_cap[1] = 3  # as staged: the full window
    write_continuations(b, sb, rows, torch.tensor([1]), torch.tensor([11]), torch.tensor([5]),
                        width=4)  # fmt: skip
    assert b.input_ids[4].item() == 11
    assert b.positions[4:8].tolist() == [1, 2, 3, 4]
    assert b.slot_mapping[4:8].tolist() == [29, 30, 31, 8]
    assert b.seq_lens[1].item() == 5
    assert (sb.anchors[1].item(), sb.anchor_pos[1].item()) == (11, 1)
    assert sb.block_positions[3:6].tolist() == [1, 2, 3]
    assert sb.block_slots[3:6].tolist() == [29, 30, 31]
    assert sb.block_seq_lens[1].item() == 4
    assert sb.verify_len[1].item() == sb.verify_cap[1].item() == 2  # limit 5: 2 tokens held
    # the rows around it are untouched
    assert b.positions[:4].tolist() == [-1] * 4 and b.positions[8:12].tolist() == [-1] * 4
    assert b.np("block_table")[0].tolist() == [SCRATCH_PAGE] * 4


def test_scheduler_continuation_rows_and_deferral():
    """K = 2, draft_len 3, page_size 4: a window in flight at anchor 6 (7 tokens) gets a
    continuation whose start is the latest anchor (6 + 3 = 9) and pages for 7 + 3 + 3 = 13
    tokens; its update reads where the request stands after the in-flight window's update."""
    from dspark.engine.kv_cache import PageAllocator
    from dspark.engine.scheduler import Scheduler
    from dspark.request import Request
    from dspark.step_plan import SampledTokens

    s = Scheduler(PageAllocator(16), 4, 4, 64, 64, draft_len=3, max_verify=2)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    req = Request("a", [3, 4, 5, 6, 7, 8], params, 0, eos_token_id=1, arrival_time=0.0)
    s.add(req)
    first = s.schedule()  # the prefill
    s.advance(first)
    s.update(first, [SampledTokens((9,))])
    n = s.schedule()  # a window [9, 2 drafts] at anchor 6
    (row,) = n.rows
    assert (row.start, row.num_draft, row.is_continuation) == (6, 2, False)
    s.advance(n)
    assert req.num_windows_in_flight == 1 and s.ahead_blocker(max_rows=8) is None
    ahead = s.schedule()  # behind it
    (cont,) = ahead.rows
    assert (cont.start, cont.num_draft, cont.is_continuation) == (9, 2, True)
    assert len(req.page_ids) == 4  # 13 tokens
    s.advance(ahead)
    s.update(n, [SampledTokens((10, 11))])  # one draft accepted, anchor now at 8
    assert (req.num_computed_tokens, req.num_tokens) == (8, 9)
    s.update(ahead, [SampledTokens((12, 13, 14))])  # both accepted: anchor at 11
    assert (req.num_computed_tokens, req.num_tokens) == (11, 12)
    assert req.output_token_ids == [9, 10, 11, 12, 13, 14] and req.num_windows_in_flight == 0
    # near max_model_len, where the drafter block from its furthest anchor (12 + 3 = 15)
    # would pass the page table (15 + 3 > 17), the request in flight is deferred
    s.max_model_len = 17
    s.advance(s.schedule())  # a window at anchor 11 (12 + 3 <= 17)
    assert s.ahead_blocker(max_rows=8) is None and s.schedule().is_empty
    assert s.num_windows_deferred == 1


@pytest.mark.parametrize("max_tokens", [5, 4])
def test_scheduler_continues_near_max_tokens(max_tokens):
    """Near max_tokens a request in flight still gets its next window, staged in full: the
    device shortens it once the in-flight window's count is known (runner/continuations.py).
    A 6-token prompt with 1 output token and a window of 2 drafts in flight holds 8 to 10
    tokens after it. With max_tokens 5 (11 tokens at most) the next window verifies 2, 1 or
    0 drafts. With 4 (10 at most) the window in flight may emit the last token, so the next
    one waits for its count (deferred) rather than risk a step for nothing."""
    from dspark.engine.kv_cache import PageAllocator
    from dspark.engine.scheduler import Scheduler
    from dspark.request import Request
    from dspark.step_plan import SampledTokens

    s = Scheduler(PageAllocator(16), 4, 4, 64, 64, draft_len=3, max_verify=2)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    req = Request("a", [3, 4, 5, 6, 7, 8], params, 0, eos_token_id=1, arrival_time=0.0)
    s.add(req)
    first = s.schedule()
    s.advance(first)
    s.update(first, [SampledTokens((9,))])
    n = s.schedule()
    s.advance(n)  # a window [9, 2 drafts] at anchor 6
    assert n.rows[0].num_draft == 2 and s.ahead_blocker(max_rows=8) is None
    ahead = s.schedule()
    if max_tokens == 5:
        (cont,) = ahead.rows
        assert cont.is_continuation and cont.num_draft == 2 and s.num_windows_deferred == 0
    else:
        assert ahead.is_empty and s.num_windows_deferred == 1


def test_requests_ending_apart_stay_in_uniform_steps(tiny_vocab_dir, drafter):
    """Greedy requests whose max_tokens end them at different steps: a request whose last
    token comes among windows verifies it as an empty window, so no plain row holds the next
    step back (spec_steps_not_ahead_plain_rows), and the tokens are those of plain decoding."""
    kw = dict(num_kv_pages=256, max_num_seqs=8)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
              for n in (9, 14, 17, 22, 25, 28, 31, 40)]  # fmt: skip
    plain = LLM(str(tiny_vocab_dir), dtype="float32", device="cpu", **kw)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    for async_scheduling in (False, True):
        llm = _llm(tiny_vocab_dir, drafter, async_scheduling, **kw)
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        assert got == want
        stats = llm.engine.runner.stats
        # (launched ahead, a last token may also come as a continuation the device shortened
        # to verify nothing)
        last = stats["empty_windows"] + stats["continuation_windows_shortened"]
        assert last > 0 and (async_scheduling or stats["empty_windows"] > 0), dict(stats)
        assert stats["spec_steps_not_ahead_plain_rows"] == 0, dict(stats)
        m = llm.get_metrics()  # an empty window is no draft
        assert m["num_drafts"] == sum(m["verify_len_counts"][1:]) and m["verify_len_counts"][0]
        e = llm.engine
        assert e.allocator.num_free == e.allocator.num_usable
    assert stats["spec_steps_launched_ahead"] > 0


def _prefilled(params: list[SamplingParams]):
    """A scheduler (page size 4, draft_len 3) whose requests of 3-token prompts have each
    emitted one token."""
    from dspark.engine.kv_cache import PageAllocator
    from dspark.engine.scheduler import Scheduler
    from dspark.request import Request
    from dspark.step_plan import SampledTokens

    s = Scheduler(PageAllocator(32), 4, 8, 64, 64, draft_len=3)
    reqs = [Request(str(i), [3, 4, 5], p, 0, eos_token_id=1, arrival_time=0.0)
            for i, p in enumerate(params)]  # fmt: skip
    for r in reqs:
        s.add(r)
    prefill = s.schedule()
    s.advance(prefill)
    s.update(prefill, [SampledTokens((9,))] * len(reqs))
    return s, reqs


def test_scheduler_marks_last_tokens_empty_windows():
    """A drafting request whose next token is its last gets a plain row marked empty_window
    (one KV slot, a placeholder); one opted out, under min_tokens, or with room for a draft
    does not."""
    from dspark.request import PENDING_TOKEN

    s, reqs = _prefilled([
        SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),  # last token next
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),  # room for drafts
        SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, use_speculation=False),
        SamplingParams(temperature=0, max_tokens=2, min_tokens=2),  # under min_tokens: plain
    ])  # fmt: skip
    plan = s.schedule()
    assert [(r.num_draft, r.empty_window) for r in plan.rows] == [
        (0, True),
        (3, False),
        (0, False),
        (0, False),
    ]
    assert len(reqs[0].page_ids) == 1  # the anchor's slot: 4 tokens in one page
    s.advance(plan)
    assert reqs[0].token_ids[-1] == PENDING_TOKEN


def test_ahead_blocker_lets_empty_windows_by():
    """Behind a step of windows: a request whose last token is next (an empty window) does not
    block the step launched ahead, nor does one whose pending token is its last; an opted-out
    request's plain row does."""
    s, reqs = _prefilled([
        SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
    ])  # fmt: skip
    assert s.ahead_blocker(max_rows=8) is None
    s.advance(s.schedule())  # reqs[0]'s last token pending, reqs[1]'s window in flight
    assert s.ahead_blocker(max_rows=8) is None
    s2, _ = _prefilled([
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, use_speculation=False),
    ])  # fmt: skip
    assert s2.ahead_blocker(max_rows=8) == "plain_rows"
