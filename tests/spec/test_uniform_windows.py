"""Steps of windows laid out K + 1 wide (what a captured speculative graph replays), short
windows included, give exactly the outputs of the packed layout: run eagerly on the CPU."""

from __future__ import annotations

import pytest

from dspark import LLM, SamplingParams
from tests.tiny_models import make_tiny_drafter

PROMPTS = [[2, 3, 4], [5, 6, 7, 8, 9, 10, 11, 2, 3, 4, 5], [9], [4, 4, 4, 4, 4, 4, 4], [3, 5]]


@pytest.fixture(scope="module")
def drafter(tiny_vocab_dir, tmp_path_factory):
    return make_tiny_drafter(tiny_vocab_dir, tmp_path_factory.mktemp("drafter_u"), taps=(0,))


def _run(tiny_vocab_dir, drafter, params, uniform: bool | None):
    # drafting steps synchronous in both runs: the same batches, so logprobs compare exactly
    # (test_async_drafting_steps.py compares the async ones)
    kw = dict(dtype="float32", device="cpu", num_kv_pages=128, max_num_seqs=8, max_model_len=64,
              async_scheduling=False)  # fmt: skip
    spec = None if uniform is None else {"model": str(drafter), "num_speculative_tokens": 3}
    llm = LLM(str(tiny_vocab_dir), speculative_config=spec, **kw)
    if uniform:
        llm.engine.runner.spec_runner.uniform_windows = True
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], llm


def _assert_same_outputs(wide, packed):
    """Tokens exactly; logprobs to fp32 round-off (a last token verified as an empty window is
    scored in a wider forward than the plain row of the packed layout). The tiny model's logits
    are tens in size (initializer_range 0.8), and CPU matmuls of another row count sum in
    another order: with torch 2.14.1 one logprob differed by 4.4e-5 (earlier CI runs stayed
    under 1e-5), so the bound is 1e-4."""
    for (tokens, logprobs), (tokens_p, logprobs_p) in zip(wide, packed, strict=True):
        assert tokens == tokens_p
        if logprobs_p is None:
            assert logprobs is None
            continue
        for top, top_p in zip(logprobs, logprobs_p, strict=True):
            assert list(top) == list(top_p)
            assert list(top.values()) == pytest.approx(list(top_p.values()), abs=1e-4)


def test_uniform_windows_equal_packed_windows(tiny_vocab_dir, drafter):
    """max_tokens that end mid-window shorten windows at different steps, and requests whose
    last token comes among windows verify it as an empty window; with logprobs and seeded
    sampling beside greedy rows, the wide layout changes nothing but the layout."""
    params = [
        SamplingParams(temperature=0 if i % 2 else 0.9, top_k=5 if i == 2 else 0, seed=i,
                       max_tokens=n, ignore_eos=True, logprobs=2 if i < 2 else None)
        for i, n in enumerate([11, 13, 7, 17, 9])
    ]  # fmt: skip
    packed, llm_packed = _run(tiny_vocab_dir, drafter, params, uniform=False)
    wide, llm = _run(tiny_vocab_dir, drafter, params, uniform=True)
    _assert_same_outputs(wide, packed)
    stats = llm.engine.runner.stats
    assert stats["empty_windows"] > 0, dict(stats)
    assert llm_packed.engine.runner.stats["empty_windows"] == 0
    assert stats["eager_spec_steps"] > 0, dict(stats)
    e = llm.engine
    assert e.allocator.num_free == e.allocator.num_usable


def test_uniform_windows_greedy_equals_plain(tiny_vocab_dir, drafter):
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in [10, 14, 5, 21, 8]
    ]
    plain, _ = _run(tiny_vocab_dir, drafter, params, uniform=None)
    wide, llm = _run(tiny_vocab_dir, drafter, params, uniform=True)
    assert [t for t, _ in wide] == [t for t, _ in plain]
    assert llm.get_metrics()["num_accepted_tokens"] > 0


def test_numpy_window_staging_equals_the_row_by_row_path(tiny_vocab_dir, drafter):
    """Every uniform step staged twice, by _stage_windows (numpy over the rows, what the engine
    runs) and by _stage_rows (row by row): the same inputs, layout and rows, across short,
    empty and continuation windows, launched ahead and not."""
    params = [
        SamplingParams(temperature=0 if i % 2 else 0.9, seed=i, max_tokens=n, ignore_eos=True)
        for i, n in enumerate([11, 13, 7, 17, 9])
    ]
    for async_spec in (False, True):
        kw = dict(dtype="float32", device="cpu", num_kv_pages=128, max_num_seqs=8,
                  max_model_len=64, async_scheduling=async_spec)  # fmt: skip
        llm = LLM(str(tiny_vocab_dir), speculative_config={"model": str(drafter),
                  "num_speculative_tokens": 3}, **kw)  # fmt: skip
        runner = llm.engine.runner
        runner.spec_runner.uniform_windows = True
        stager = runner.stager
        fast, checked = stager._stage_windows, []

        def staged_twice(plan, reqs, serials, width, runner=runner, fast=fast, checked=checked):
            got = fast(plan, reqs, serials, width)
            got_inputs = _inputs(runner, got)
            want = runner.stager._stage_rows(plan, reqs, serials, width)
            assert (got.layout, got.graph_size, got.window_rows) == (
                want.layout, want.graph_size, want.window_rows)  # fmt: skip
            assert got.sampled_rows.size == want.sampled_rows.size == 0
            for name, values in _inputs(runner, want).items():
                assert (got_inputs[name] == values).all(), name
            checked.append(any(r.is_continuation for r in plan.rows))
            return got

        stager._stage_windows = staged_twice
        llm.generate(PROMPTS, params, use_tqdm=False)
        # (launched ahead, last tokens come as continuations the device shortens instead)
        assert len(checked) > 10 and (runner.stats["empty_windows"] > 0 or async_spec)
        assert any(checked) == async_spec  # continuations only when launched ahead


def _inputs(runner, staged) -> dict:
    b, lay = runner.buffers, staged.layout
    t, r = lay.num_tokens, lay.num_rows
    return {name: b.np(name)[:used].copy() for name, used in (
        ("input_ids", t), ("positions", t), ("slot_mapping", t), ("cu_num_tokens", r + 1),
        ("seq_lens", r), ("logits_indices", lay.num_logits))}  # fmt: skip
