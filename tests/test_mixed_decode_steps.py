"""Mixed decode steps: decode rows, then a tail of prefill chunks (requests admitted while the
others decode), padded to a captured (G, P) (runner/cuda_graph.py, runner/mixed_layout.py).
On the CPU the padded layout runs through the forward a graph captures, on the same buffers."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dspark import LLM, SamplingParams
from dspark.config import EngineConfig
from dspark.runner.mixed_layout import max_tail_rows
from tests.helpers import EagerDecodeGraphs
from tests.spec.test_uniform_windows import _assert_same_outputs

# more prompts than max_num_seqs: requests are admitted while others decode
PROMPTS = [[2, 3, 4], [5, 6, 7, 8, 9, 10, 11, 2, 3, 4, 5], [9], [4, 4, 4, 4, 4, 4, 4], [3, 5],
           [7, 8, 9, 10, 11, 3, 4, 5, 6, 7, 8, 9, 10, 11, 2, 3, 4, 5, 6, 7], [6, 6],
           [2, 9, 4, 11, 5], [8, 7, 6, 5, 4, 3, 2]]  # fmt: skip
TAIL = 16  # P of the padded runs
TAIL_ROWS = max_tail_rows(TAIL)  # live tail rows of its captured mixed steps (4)
SIZES = [1, 2, 4]  # the graph ladder the padded runs pad decode rows to


def _llm(tiny_vocab_dir, padded: bool, max_num_seqs: int = 4, async_scheduling=True,
         **kw) -> LLM:  # fmt: skip
    """async_scheduling False for the tests that drive schedule/update by hand."""
    llm = LLM(str(tiny_vocab_dir), dtype="float32", device="cpu", num_kv_pages=128,
              max_num_seqs=max_num_seqs, max_model_len=64,
              async_scheduling=async_scheduling, **kw)  # fmt: skip
    if padded:
        runner = llm.engine.runner
        runner.stager.graph_sizes = SIZES
        runner.stager.graphs = EagerDecodeGraphs(runner, SIZES, TAIL)
        llm.engine.scheduler.decode_mixed_limits = runner.decode_mixed_limits
    return llm


def _generate(llm, params):
    """Lengths 5, 8, 11, ...: requests end at different steps, so admissions meet decode rows."""
    lengths = [replace(params, max_tokens=5 + 3 * i) for i in range(len(PROMPTS))]
    outs = llm.generate(PROMPTS, lengths, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(
            temperature=0.9, top_k=6, seed=5, max_tokens=12, ignore_eos=True, logprobs=2
        ),  # fmt: skip
    ],
    ids=["greedy", "seeded_topk_logprobs"],
)
def test_padded_mixed_decode_steps_equal_eager_steps(tiny_vocab_dir, params):
    """The same tokens (and logprobs) as the eager run, whose admissions run unpadded."""
    eager = _generate(_llm(tiny_vocab_dir, padded=False), params)
    llm = _llm(tiny_vocab_dir, padded=True)
    padded = _generate(llm, params)
    _assert_same_outputs(padded, eager)
    stats, replays = llm.engine.runner.stats, llm.engine.runner.stager.graphs.replays
    assert stats["mixed_decode_steps"] > 0 and replays["mixed"] == stats["graph_steps_mixed"]
    assert replays["decode"] > 0
    assert not any(k.startswith("eager_steps_mixed_") for k in stats), dict(stats)


def test_a_prefill_into_an_idle_engine_replays_the_smallest_mixed_graph(tiny_vocab_dir):
    """One request at a time (each admitted into an idle engine): a prompt that fits the tail
    is staged as a mixed decode step of G = 1 whose decode row is a pad row; one longer than
    the tail runs eagerly. The same tokens and logprobs as the eager run."""
    params = SamplingParams(temperature=0.8, top_k=5, seed=3, max_tokens=6, ignore_eos=True,
                            logprobs=1)  # fmt: skip
    prompts = [PROMPTS[0], PROMPTS[1], list(range(2, 12)) * 2]  # 3, 11 and 20 > TAIL tokens
    runs = []
    for padded in (False, True):
        llm = _llm(tiny_vocab_dir, padded=padded)
        outs = [llm.generate([p], params, use_tqdm=False)[0].outputs[0] for p in prompts]
        runs.append([(o.token_ids, o.logprobs) for o in outs])
    _assert_same_outputs(runs[1], runs[0])
    stats = llm.engine.runner.stats
    assert stats["mixed_decode_steps_prefill_only"] == 2  # the 20-token prompt: eagerly
    assert stats["eager_steps_not_decode"] == 1 and stats["eager_steps"] == 1
    assert not any(k.startswith("eager_steps_mixed_") for k in stats), dict(stats)


def test_prefill_beside_decode_rows_is_capped_and_the_rows_put_decode_rows_first(
    tiny_vocab_dir,
):
    engine = _llm(tiny_vocab_dir, padded=True, async_scheduling=False).engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("a", [2, 3, 4], params)
    engine.step()  # prefill alone: no cap
    engine.add_request("b", list(range(2, 12)) * 4, params)  # 40 tokens: more than TAIL
    engine.add_request("c", [5, 6], params)
    tails = []
    while engine.has_unfinished_requests():
        plan = engine.scheduler.schedule()
        engine.scheduler.advance(plan)
        head = [r.num_tokens == 1 and r.do_sample for r in plan.rows]
        if any(head) and not all(head):
            n = head.index(False)
            assert not any(head[n:]), head  # decode rows first, then the tail
            tails.append(sum(r.num_tokens for r in plan.rows[n:]))
        engine._update(plan, engine.runner.execute(plan))
    assert tails and max(tails) <= TAIL
    assert tails[0] == TAIL  # the long prompt's first chunk, cut at the cap


def test_a_burst_beside_decode_rows_is_admitted_uncapped(tiny_vocab_dir):
    """More requests waiting for a seat than the tail has rows: one eager step takes them all
    (whole prompts); as many as the tail has rows: capped, a mixed decode step."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for num_new, capped in ((TAIL_ROWS + 1, False), (TAIL_ROWS, True)):
        engine = _llm(tiny_vocab_dir, padded=True, max_num_seqs=8, async_scheduling=False).engine
        engine.add_request("a", [2, 3, 4], params)
        engine.step()  # a decodes from now on
        prompts = PROMPTS[1 : 1 + num_new]
        for i, prompt in enumerate(prompts):
            engine.add_request(f"new{i}", prompt, params)
        plan = engine.scheduler.schedule()
        assert plan.rows[0].num_tokens == 1  # a's decode row first
        tail = [r.num_tokens for r in plan.rows[1:]]
        if capped:
            assert sum(tail) <= TAIL and len(tail) <= TAIL_ROWS, tail
        else:
            assert tail == [len(p) for p in prompts] and sum(tail) > TAIL, tail


def test_without_mixed_decode_graphs_the_rows_keep_their_order(tiny_vocab_dir):
    """No decode_mixed_limits (the default, and on the CPU): a plain step's rows are not
    reordered and its prefill is not capped."""
    engine = _llm(tiny_vocab_dir, padded=False, async_scheduling=False).engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("a", [2, 3, 4], params)
    engine.step()
    engine.add_request("b", list(range(2, 12)) * 4, params)
    plan = engine.scheduler.schedule()
    assert [r.num_tokens for r in plan.rows] == [1, 40]


@pytest.mark.parametrize("bad", [-1, 8193, 2.5, True, "256"])
def test_bad_mixed_prefill_tokens_is_refused_by_name(bad):
    with pytest.raises(ValueError, match=r"mixed_prefill_tokens must be an integer in \[0, 8192\]"):
        EngineConfig(mixed_prefill_tokens=bad)


@pytest.mark.gpu
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "temperature"])
def test_mixed_decode_graphs_replay_equals_eager(tiny_vocab_dir, temperature):
    """On the GPU, captured: admissions while others decode replay mixed decode graphs (with
    mixed_prefill_tokens), or run eagerly (without graphs); the same tokens."""
    params = [SamplingParams(temperature=temperature, seed=5, max_tokens=5 + 3 * i,
                             ignore_eos=True) for i in range(len(PROMPTS))]  # fmt: skip
    runs, stats = {}, None
    for graphs in (False, True):
        llm = LLM(str(tiny_vocab_dir), dtype="float32", device="cuda", num_kv_pages=256,
                  max_num_seqs=3, max_model_len=128, use_cuda_graphs=graphs,
                  mixed_prefill_tokens=TAIL)  # fmt: skip
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        runs[graphs] = [o.outputs[0].token_ids for o in outs]
        stats = llm.engine.runner.stats
        assert llm.engine.allocator.num_free == llm.engine.allocator.num_usable
    assert stats["graph_steps_mixed"] > 0 and stats["graph_steps"] > 0, dict(stats)
    assert runs[True] == runs[False]


def _six_waiting_beside_a_decode_row(engine) -> list[int]:
    """The tail's chunk lengths of the step that meets six waiting requests beside a decode
    row."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("a", [2, 3, 4], params)
    engine.step()
    for i, prompt in enumerate(PROMPTS[1:7]):
        engine.add_request(f"new{i}", prompt, params)
    return [r.num_tokens for r in engine.scheduler.schedule().rows[1:]]


def test_the_burst_threshold_grows_with_the_running_rows(tiny_vocab_dir):
    """4 sqrt(running rows), at least the tail's rows. Six
    waiting requests beside one decode row are a burst (threshold 4); beside nine they are not
    (threshold 12), so the step keeps the captured tail's caps."""
    from dspark.engine.burst import burst_threshold

    assert [burst_threshold(r, TAIL_ROWS) for r in (0, 1, 9, 16, 250, 256, 512)] == [
        4, 4, 12, 16, 63, 64, 91]  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for num_running, burst in ((1, True), (9, False)):
        engine = _llm(tiny_vocab_dir, padded=True, max_num_seqs=16, async_scheduling=False).engine
        for i in range(num_running):
            engine.add_request(f"run{i}", PROMPTS[i % 3], params)
        while len(engine.scheduler.running) < num_running or engine.scheduler.waiting:
            engine.step()
        for i, prompt in enumerate(PROMPTS[1:7]):
            engine.add_request(f"new{i}", prompt, params)
        plan = engine.scheduler.schedule()
        tail = [r.num_tokens for r in plan.rows[num_running:]]
        assert all(r.num_tokens == 1 for r in plan.rows[:num_running])
        if burst:
            assert len(tail) == 6, tail  # every waiting request admitted at once
        else:
            assert sum(tail) <= TAIL and len(tail) <= TAIL_ROWS, tail
