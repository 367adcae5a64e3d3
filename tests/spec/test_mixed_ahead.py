"""Mixed steps in the async pipeline (engine/ahead.py): a step of windows scheduled ahead
admits waiting requests into a mixed step's tail, and a step is scheduled behind a mixed one,
the requests whose first token its tail samples deferred one step. Outputs equal the
synchronous engine's. CPU, tiny models, the live and the padded (graph) layouts."""

from __future__ import annotations

import pytest

from dspark import LLM, SamplingParams
from dspark.runner.mixed_layout import max_tail_rows
from tests.helpers import assert_same_run
from tests.spec.eager_replay import EagerReplay
from tests.tiny_models import make_tiny_drafter

# more prompts than seats: requests are admitted while others draft
PROMPTS = [[2, 3, 4], [5, 6, 7, 8, 9, 10, 11, 2, 3, 4, 5], [9], [4, 4, 4, 4, 4, 4, 4], [3, 5],
           [7, 8, 9, 10, 11, 3, 4, 5, 6, 7, 8, 9, 10, 11, 2, 3, 4, 5, 6, 7], [6, 6],
           [2, 9, 4, 11, 5], [10, 3], [8, 8, 8]]  # fmt: skip
TAIL = 16  # tail tokens of a mixed step (the 20-token prompt takes two chunks)
TAIL_ROWS = max_tail_rows(TAIL)  # live tail rows of its captured mixed steps (4)


@pytest.fixture(scope="module")
def drafter(tiny_vocab_dir, tmp_path_factory):
    return make_tiny_drafter(tiny_vocab_dir, tmp_path_factory.mktemp("drafter_mixed_ahead"),
                             taps=(0,))  # fmt: skip


def _llm(tiny_vocab_dir, drafter, async_scheduling: bool, padded: bool):
    llm = LLM(str(tiny_vocab_dir), dtype="float32", device="cpu", num_kv_pages=128,
              max_num_seqs=4, max_model_len=64, async_scheduling=async_scheduling,
              speculative_config={"model": str(drafter), "num_speculative_tokens": 3})  # fmt: skip
    spec_runner, scheduler = llm.engine.runner.spec_runner, llm.engine.scheduler
    spec_runner.uniform_windows = True
    spec_runner.max_tail_tokens = TAIL
    scheduler.mixed_limits = (TAIL_ROWS, TAIL)  # the same chunks in every run
    if padded:
        spec_runner.graphs = EagerReplay(spec_runner, [1, 2, 4], (TAIL,))
    return llm


def _params():
    return [
        SamplingParams(temperature=0 if i % 3 else 0.8, seed=i, max_tokens=n, ignore_eos=True,
                       logprobs=1 if i < 4 else None)
        for i, n in enumerate([9, 14, 5, 21, 8, 12, 9, 16, 7, 11])
    ]  # fmt: skip


def _seen(outputs):
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outputs]


@pytest.mark.parametrize("padded", [False, True], ids=["live", "padded"])
def test_admissions_ahead_and_steps_behind_mixed_ones_equal_sync(tiny_vocab_dir, drafter, padded):
    sync = _llm(tiny_vocab_dir, drafter, False, padded)
    expected = sync.generate(PROMPTS, _params(), use_tqdm=False)
    llm = _llm(tiny_vocab_dir, drafter, True, padded)
    got = llm.generate(PROMPTS, _params(), use_tqdm=False)
    assert_same_run(got, expected, _seen)
    stats, e = llm.engine.runner.stats, llm.engine
    assert stats["spec_steps_launched_ahead_admitting"] > 0, dict(stats)  # not vacuous
    assert stats["spec_steps_launched_behind_mixed"] > 0, dict(stats)
    assert e.scheduler.num_first_windows_deferred > 0
    # the 20-token prompt's second chunk joins the tail of a step launched ahead: no step
    # waits for the one before it because of a prompt chunked over steps
    assert stats["spec_steps_not_ahead_plain_rows"] == 0, dict(stats)
    assert stats["spec_graph_steps_mixed"] > 0 if padded else stats["mixed_spec_steps"] > 0
    counts = llm.get_metrics()["async_spec_steps"]  # (the same counters, reported)
    assert counts["admitting"] == stats["spec_steps_launched_ahead_admitting"]
    assert counts["behind_mixed"] == stats["spec_steps_launched_behind_mixed"]
    assert counts["first_windows_deferred"] == e.scheduler.num_first_windows_deferred
    assert e.allocator.num_free == e.allocator.num_usable
    assert not e.scheduler.has_unfinished and e._in_flight is None


def test_chunks_ahead_under_page_pressure_equal_sync(tiny_vocab_dir, drafter):
    """Prompts of up to 50 tokens chunked over a 16-token tail, on 12 KV pages for 6 seats:
    chunks ride in steps launched ahead while requests are preempted and recomputed; the
    tokens equal the synchronous engine's and every page returns."""
    import random

    rng = random.Random(1)
    prompts = [[rng.randrange(2, 12) for _ in range(rng.randrange(3, 50))] for _ in range(24)]
    params = [SamplingParams(temperature=0 if i % 3 else 0.8, seed=i, ignore_eos=True,
                             max_tokens=rng.randrange(5, 30)) for i in range(24)]  # fmt: skip

    def run(async_scheduling: bool):
        spec = {"model": str(drafter), "num_speculative_tokens": 3}
        llm = LLM(str(tiny_vocab_dir), dtype="float32", device="cpu", num_kv_pages=12,
                  max_num_seqs=6, max_model_len=128, async_scheduling=async_scheduling,
                  speculative_config=spec)  # fmt: skip
        llm.engine.runner.spec_runner.uniform_windows = True
        llm.engine.runner.spec_runner.max_tail_tokens = TAIL
        llm.engine.scheduler.mixed_limits = (TAIL_ROWS, TAIL)
        return llm, llm.generate(prompts, params, use_tqdm=False)

    _, expected = run(False)
    llm, got = run(True)
    assert _seen(got) == _seen(expected)
    stats, e = llm.engine.runner.stats, llm.engine
    assert stats["spec_steps_launched_ahead_admitting"] > 0 and e.scheduler.num_preemptions > 0
    assert e.allocator.num_free == e.allocator.num_usable
