"""Captured speculative steps replay exactly what the eager speculative step computes (GPU).

Same engine settings twice, CUDA graphs on and off: the emitted tokens (greedy and seeded
sampling, with and without top-k/top-p) and the acceptance counters must be identical, and the
graph run must actually have replayed speculative graphs.
"""

from __future__ import annotations

import pytest

from dspark import LLM, SamplingParams
from tests.spec.test_spec_engine import PROMPTS12, _outputs
from tests.tiny_models import make_tiny_drafter

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def vocab_drafter(tiny_vocab_dir, tmp_path_factory):
    return make_tiny_drafter(tiny_vocab_dir, tmp_path_factory.mktemp("drafter_graphs"), taps=(0,))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=7, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=3, max_tokens=40, ignore_eos=True),
    ],
    ids=["greedy", "temperature", "filtered"],
)
def test_spec_graph_replay_equals_eager(tiny_vocab_dir, vocab_drafter, params):
    """Eager, captured graphs (synchronous drafting steps), and captured graphs with drafting
    steps launched ahead (async_scheduling, the default): the same tokens; eager and graphs also
    the same counters."""
    runs = {}
    for name, graphs, ahead in (("eager", False, False), ("graphs", True, False),
                                ("ahead", True, True)):  # fmt: skip
        llm = LLM(str(tiny_vocab_dir), dtype="float32", device="cuda", num_kv_pages=256,
                  max_num_seqs=8, max_model_len=128, use_cuda_graphs=graphs,
                  async_scheduling=ahead,
                  speculative_config={"model": str(vocab_drafter)})  # fmt: skip
        seen = []  # the observer hook gets each step's confidences from graphs too
        llm.engine.spec.observers.append(lambda v, a, c, seen=seen: seen.append((v, a, c.tolist())))
        outputs, metrics = _outputs(llm, PROMPTS12, params), llm.engine.get_metrics()
        # the eager path is the graphs' fallback: only the graph run counts why it fell back
        fallbacks = metrics.pop("fallbacks")
        metrics.pop("steps")  # which path each step took: graphs or eager, by design different
        ahead_counts = metrics.pop("async_spec_steps", {})
        predicted = metrics.pop("predicted_survival_per_pos")  # float sums of the confidences
        # a last token among windows is an empty window with graphs (uniform layout), a plain
        # row eagerly: the counters compare without them
        empty = metrics["verify_len_counts"][0]
        metrics["verify_len_counts"][0] = 0
        metrics["num_verified_tokens"] -= empty
        assert empty == llm.engine.runner.stats["empty_windows"]
        runs[name] = (outputs, metrics, predicted)
        assert seen and len(seen[0][2]) == len(seen[0][0])
        if graphs:
            stats = llm.engine.runner.stats
            assert stats["spec_graph_steps"] > 0, dict(stats)
            assert set(fallbacks) <= {"not_all_windows"}, fallbacks
        else:
            assert fallbacks == {}, fallbacks
        if ahead:
            assert ahead_counts["launched_ahead"] > 0, ahead_counts
    assert runs["graphs"][:2] == runs["eager"][:2]
    assert runs["graphs"][2] == pytest.approx(runs["eager"][2], rel=1e-5)
    assert runs["ahead"][0] == runs["eager"][0]


def _switching_engine(target, drafter, graphs: bool, async_scheduling: bool):
    """The engine the switching tests run: with CUDA graphs or eager, async or not."""
    return LLM(str(target), dtype="float32", device="cuda", num_kv_pages=256, max_num_seqs=8,
               max_model_len=128, use_cuda_graphs=graphs, async_scheduling=async_scheduling,
               speculative_config={"model": str(drafter)}).engine  # fmt: skip


def _switching(engine, params: SamplingParams) -> dict[str, list[int]]:
    """PROMPTS12 with drafting on for three steps, off for three, ...: each request's tokens."""
    for i, prompt in enumerate(PROMPTS12):
        engine.add_request(str(i), prompt, params)
    done, step = {}, 0
    while engine.has_unfinished_requests():
        engine.scheduler.drafting = (step // 3) % 2 == 0
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        step += 1
    return done


def test_plain_steps_replay_decode_graphs_that_feed_the_drafter(tiny_vocab_dir, vocab_drafter):
    """Drafting switched off and on every few steps (as the drafting policy does): plain steps
    replay decode graphs that append the drafter's context, so the drafts after them, and so
    the acceptance counters, equal the eager run's. Drafting steps run synchronously in both
    runs: launched ahead (graphs only), a step's verification reaches the host one step later,
    so the same toggle by step index would draft different windows (the tokens stay equal,
    the acceptance counts need not)."""
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    runs = {}
    for graphs in (False, True):
        engine = _switching_engine(tiny_vocab_dir, vocab_drafter, graphs, async_scheduling=False)
        done = _switching(engine, params)
        runs[graphs] = (done, engine.get_metrics()["num_accepted_tokens"])
        if graphs:
            stats = engine.runner.stats
            assert stats["graph_steps"] > 0 and stats["spec_graph_steps"] > 0, dict(stats)
    assert runs[True] == runs[False]


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "temperature"])
def test_drafting_steps_behind_plain_steps_on_graphs_equal_eager(tiny_vocab_dir, vocab_drafter,
                                                                 temperature):  # fmt: skip
    """Drafting switched off and on every few steps with graphs and async scheduling: a
    drafting step replays its graph behind the plain step in flight, its windows' anchors fed
    there on the device; the tokens equal the eager run's, laid out and launched alike (windows
    K + 1 wide, async). (Not the synchronous run's: launched ahead, a step's verification
    reaches the host a step later, so the same toggle by step index drafts other windows, and
    sampled tokens depend on the windows they were verified in.)"""
    params = SamplingParams(temperature=temperature, seed=11, max_tokens=48, ignore_eos=True)
    runs, stats = {}, None
    for graphs in (False, True):
        engine = _switching_engine(tiny_vocab_dir, vocab_drafter, graphs, async_scheduling=True)
        engine.runner.spec_runner.uniform_windows = True  # (eager: as the graphs lay them out)
        runs[graphs] = _switching(engine, params)
        stats = engine.runner.stats
        assert engine.allocator.num_free == engine.allocator.num_usable
    assert stats["spec_steps_launched_ahead_after_plain"] > 0, dict(stats)
    assert stats["fed_anchor_windows"] > 0 and stats["spec_graph_steps"] > 0, dict(stats)
    assert runs[True] == runs[False]


@pytest.mark.parametrize("tails", [8, [4, 8]], ids=["one_tail", "two_tails"])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "temperature"])
def test_mixed_graphs_replay_equals_eager(tiny_vocab_dir, vocab_drafter, temperature, tails):
    """Requests admitted while others draft (more prompts than max_num_seqs): with graphs such
    steps replay captured mixed steps (windows, then the prefill tail, padded to the smallest
    captured size that holds it), eagerly they run packed. Greedy and seeded sampling give the
    same tokens."""
    prompts = [*PROMPTS12, [6, 6, 2], [3, 9, 4, 5, 6, 7, 8, 9, 10, 11, 2, 3], [7], [5, 4, 3]]
    params = SamplingParams(temperature=temperature, seed=5, max_tokens=30, ignore_eos=True)
    runs, stats = {}, None
    for graphs in (False, True):
        llm = LLM(str(tiny_vocab_dir), dtype="float32", device="cuda", num_kv_pages=256,
                  max_num_seqs=3, max_model_len=128, use_cuda_graphs=graphs,
                  speculative_config={"model": str(vocab_drafter),
                                      "mixed_prefill_tokens": tails})  # fmt: skip
        runs[graphs] = _outputs(llm, prompts, params)
        stats = llm.engine.runner.stats
        engine = llm.engine
        assert engine.allocator.num_free == engine.allocator.num_usable
    assert stats["spec_graph_steps_mixed"] > 0, dict(stats)
    if isinstance(tails, list):  # each captured step counted by the size it took
        by_size = stats["spec_graph_steps_mixed_p4"] + stats["spec_graph_steps_mixed_p8"]
        assert by_size == stats["spec_graph_steps_mixed"], dict(stats)
    assert runs[True] == runs[False]


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "temperature"])
def test_a_tail_of_many_rows_replays_equals_eager(tiny_vocab_dir, vocab_drafter, temperature):
    """Tails of 16 and 512 tokens (4 and 8 live rows, max_tail_rows): six requests that opted
    out of speculation decode beside two drafting ones, so drafting steps carry tails of more
    rows than P = 16 holds and replay the P = 512 graph (9 tail rows). The tokens are eager
    decoding's."""
    prompts = [*PROMPTS12, [6, 6, 2], [3, 9, 4, 5, 6, 7, 8, 9, 10, 11, 2, 3], [7]]
    params = [SamplingParams(temperature=temperature, seed=5, max_tokens=n, ignore_eos=True,
                             use_speculation=i < 2)
              for i, n in enumerate([30, 25, 12, 28, 20, 16, 24, 9])]  # fmt: skip
    runs, stats = {}, None
    for graphs in (False, True):
        llm = LLM(str(tiny_vocab_dir), dtype="float32", device="cuda", num_kv_pages=256,
                  max_num_seqs=8, max_model_len=512, use_cuda_graphs=graphs,
                  speculative_config={"model": str(vocab_drafter),
                                      "mixed_prefill_tokens": [16, 512]})  # fmt: skip
        runs[graphs] = _outputs(llm, prompts, params)
        stats = llm.engine.runner.stats
    assert stats["spec_graph_steps_mixed_p512"] > 0, dict(stats)
    assert stats["eager_spec_steps_mixed_tail_rows"] == 0, dict(stats)
    assert runs[True] == runs[False]


def test_each_graph_set_writes_one_logits_buffer(tiny_vocab_dir, vocab_drafter):
    """Every captured step of a set returns rows of the set's one logits buffer (kept per
    graph, Qwen3-8B's logits filled an 80 GB card at 256 seats: runner/cuda_graph.py)."""
    llm = LLM(str(tiny_vocab_dir), dtype="float32", device="cuda", num_kv_pages=256,
              max_num_seqs=8, max_model_len=128,
              speculative_config={"model": str(vocab_drafter)})  # fmt: skip
    runner = llm.engine.runner
    spec_buffer = runner.spec_runner.graph_logits
    decode = runner.stager.graphs
    outputs = runner.spec_runner.graphs._outputs
    assert len(outputs) > 3
    for out, scored in outputs.values():  # the step's output and its half up to verification
        assert out.logits.data_ptr() == spec_buffer.data_ptr()
        assert scored.logits.data_ptr() == spec_buffer.data_ptr()
    for key in decode._graphs:
        assert decode.output(*key).data_ptr() == decode.logits.data_ptr()
    # ... and they still generate (the replays' equality with eager steps: the tests above)
    out = llm.generate(PROMPTS12[:4], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 8 for o in out)
