"""Mixed speculative steps: windows, then a tail of prefill chunks and plain rows
(runner/mixed_layout.py). On the CPU, eagerly: the live layout, and the padded layout a captured
mixed step replays (the captured step function run on the same buffers)."""

from __future__ import annotations

import pytest
import torch

from dspark import LLM, SamplingParams
from dspark.runner.input_buffers import InputBuffers
from dspark.runner.mixed_layout import capture_layout, max_tail_rows, write_tail_pads
from dspark.runner.spec_graphs import MODES, SpecGraphs
from dspark.spec.spec_buffers import FILTERED, TEMPERATURE
from dspark.step_plan import PAD_SLOT, SCRATCH_PAGE
from tests.spec.eager_replay import EagerReplay
from tests.spec.test_uniform_windows import _assert_same_outputs
from tests.tiny_models import make_tiny_drafter

# more prompts than max_num_seqs: requests are admitted while others draft
PROMPTS = [[2, 3, 4], [5, 6, 7, 8, 9, 10, 11, 2, 3, 4, 5], [9], [4, 4, 4, 4, 4, 4, 4], [3, 5],
           [7, 8, 9, 10, 11, 3, 4, 5, 6, 7, 8, 9, 10, 11, 2, 3, 4, 5, 6, 7], [6, 6],
           [2, 9, 4, 11, 5]]  # fmt: skip
TAIL = 16  # tail tokens of the padded runs (the scheduler caps the prefill beside windows)
TAIL_ROWS = max_tail_rows(TAIL)  # live tail rows of its captured mixed steps (4)


@pytest.fixture(scope="module")
def drafter(tiny_vocab_dir, tmp_path_factory):
    return make_tiny_drafter(tiny_vocab_dir, tmp_path_factory.mktemp("drafter_mixed"), taps=(0,))


def _llm(tiny_vocab_dir, drafter, padded: bool | None, max_num_seqs: int = 4,
         max_model_len: int = 64):  # fmt: skip
    """padded None: no speculation; False: the live mixed layout; True: padded to graph sizes."""
    kw = dict(dtype="float32", device="cpu", num_kv_pages=128, max_num_seqs=max_num_seqs,
              max_model_len=max_model_len, async_scheduling=False)  # fmt: skip
    if padded is None:
        return LLM(str(tiny_vocab_dir), **kw)
    llm = LLM(str(tiny_vocab_dir), speculative_config={"model": str(drafter),
              "num_speculative_tokens": 3}, **kw)  # fmt: skip
    spec_runner = llm.engine.runner.spec_runner
    spec_runner.uniform_windows = True
    spec_runner.max_tail_tokens = TAIL
    llm.engine.scheduler.mixed_limits = (TAIL_ROWS, TAIL)  # the same chunks in both runs
    if padded:
        spec_runner.graphs = EagerReplay(spec_runner, [1, 2, 4], (TAIL,))
    return llm


def test_two_tail_sizes_pad_each_mixed_step_to_the_smaller_that_holds_it(tiny_vocab_dir, drafter):
    """Tails of 8 and 16 captured ("mixed_prefill_tokens": [8, 16]): the scheduler caps at 16,
    a mixed step of at most 8 tail tokens replays the P = 8 step, a larger one P = 16; the
    tokens are plain decoding's."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
              for n in [10, 14, 5, 21, 8, 12, 9, 16]]  # fmt: skip
    plain = _generate(_llm(tiny_vocab_dir, drafter, None), params)
    llm = _llm(tiny_vocab_dir, drafter, padded=True)
    replay = llm.engine.runner.spec_runner.graphs = EagerReplay(
        llm.engine.runner.spec_runner, [1, 2, 4], (8, TAIL)
    )
    tails = []
    mixed_graph = llm.engine.runner.spec_runner.mixed_graph

    def recording(num_windows, num_tail_tokens, num_tail_rows):  # (G, P) of each live tail
        key = mixed_graph(num_windows, num_tail_tokens, num_tail_rows)
        tails.append((num_tail_tokens, key[1]))
        return key

    llm.engine.runner.spec_runner.mixed_graph = recording
    assert [t for t, _ in _generate(llm, params)] == [t for t, _ in plain]
    assert {p for _, p, _ in replay.replayed} == {0, 8, TAIL}  # full blocks, both tails
    assert all(p == (8 if n <= 8 else TAIL) for n, p in tails), tails


def test_a_larger_tail_size_carries_more_rows(tiny_vocab_dir, drafter):
    """Tails of 16 and 512 tokens captured: 4 and 8 live rows (max_tail_rows). Six requests
    that opted out of speculation decode beside two drafting ones, so a drafting step's tail
    holds 6 one-token rows: too many rows for P = 16, so it pads to P = 512 (9 graph rows),
    where tails of 16 alone ran it eagerly. The tokens are plain decoding's."""
    prompts = PROMPTS[:8]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, use_speculation=i < 2)
              for i, n in enumerate([10, 14, 5, 21, 8, 12, 9, 16])]  # fmt: skip
    plain = _llm(tiny_vocab_dir, drafter, None, max_num_seqs=8).generate(
        prompts, params, use_tqdm=False
    )
    # (a pad row holds a tail's leftover, up to 512 tokens on the scratch page: its block-table
    # row must be as wide)
    llm = _llm(tiny_vocab_dir, drafter, padded=True, max_num_seqs=8, max_model_len=512)
    spec_runner = llm.engine.runner.spec_runner
    spec_runner.max_tail_tokens = 512
    replay = spec_runner.graphs = EagerReplay(spec_runner, [1, 2, 4, 8], (TAIL, 512))
    llm.engine.scheduler.mixed_limits = spec_runner.mixed_limits
    assert spec_runner.mixed_limits == (8, 512)
    chosen = []
    mixed_graph = spec_runner.mixed_graph

    def recording(num_windows, num_tail_tokens, num_tail_rows):
        key = mixed_graph(num_windows, num_tail_tokens, num_tail_rows)
        chosen.append((num_tail_tokens, num_tail_rows, key[1]))
        return key

    spec_runner.mixed_graph = recording
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert any(rows > TAIL_ROWS and p == 512 for _, rows, p in chosen), chosen
    assert all(p == (TAIL if n <= TAIL and r <= TAIL_ROWS else 512) for n, r, p in chosen)
    assert 512 in {p for _, p, _ in replay.replayed}
    assert spec_runner.stats["eager_spec_steps_mixed_tail_rows"] == 0


def _generate(llm, params):
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def test_capture_layout_and_tail_pads_worked_example():
    """The docstring's example: K = 3, G = 4 windows, P = 8 in R = 2 tail rows."""
    layout = capture_layout(4, 4, 8, 2)
    assert layout.cu_num_tokens_cpu == (0, 4, 8, 12, 16, 24, 24)
    assert (layout.num_tokens, layout.num_rows, layout.num_logits) == (24, 6, 18)
    assert layout.num_window_logits == 16
    b = InputBuffers(32, 8, 4, torch.device("cpu"))
    b.np("block_table")[:] = 7
    write_tail_pads(b, 6, 21, 2, 3)  # leftover 3 tokens from token 21, then an empty row
    assert b.np("cu_num_tokens")[7:9].tolist() == [24, 24]
    assert b.np("seq_lens")[6:8].tolist() == [3, 0]
    assert (b.np("slot_mapping")[21:24] == PAD_SLOT).all()
    assert (b.np("block_table")[6:8] == SCRATCH_PAGE).all()


def test_mixed_steps_greedy_equal_plain(tiny_vocab_dir, drafter):
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
              for n in [10, 14, 5, 21, 8, 12, 9, 16]]  # fmt: skip
    plain = _generate(_llm(tiny_vocab_dir, drafter, None), params)
    for padded in (False, True):
        llm = _llm(tiny_vocab_dir, drafter, padded)
        assert [t for t, _ in _generate(llm, params)] == [t for t, _ in plain]
        stats = llm.engine.runner.stats
        assert stats["mixed_spec_steps"] > 0, dict(stats)
        assert stats["spec_graph_steps_mixed"] == (stats["mixed_spec_steps"] if padded else 0)
        e = llm.engine
        assert e.allocator.num_free == e.allocator.num_usable


def test_padded_mixed_steps_equal_the_live_layout(tiny_vocab_dir, drafter):
    """Seeded sampling, top-k, logprobs and greedy rows side by side: padding a mixed step to a
    captured (G, P) changes nothing but the layout."""
    params = [
        SamplingParams(temperature=0 if i % 2 else 0.9, top_k=5 if i == 2 else 0, seed=i,
                       max_tokens=n, ignore_eos=True, logprobs=2 if i < 3 else None)
        for i, n in enumerate([11, 13, 7, 17, 9, 12, 6, 15])
    ]  # fmt: skip
    live = _generate(_llm(tiny_vocab_dir, drafter, False), params)
    llm = _llm(tiny_vocab_dir, drafter, True)
    padded = _generate(llm, params)
    _assert_same_outputs(padded, live)
    assert llm.engine.runner.stats["spec_graph_steps_mixed"] > 0


def test_a_temperature_mixed_step_replays_the_unfiltered_graph(tiny_vocab_dir, drafter):
    """Seeded temperature sampling without top-k or top-p: a mixed step replays the TEMPERATURE
    graph (the FILTERED one sorts every slot's and window token's vocabulary), and gives the
    live layout's tokens."""
    params = [SamplingParams(temperature=0.9, seed=i, max_tokens=n, ignore_eos=True)
              for i, n in enumerate([11, 13, 7, 17, 9, 12, 6, 15])]  # fmt: skip
    live = _generate(_llm(tiny_vocab_dir, drafter, False), params)
    llm = _llm(tiny_vocab_dir, drafter, True)
    padded = _generate(llm, params)
    _assert_same_outputs(padded, live)
    replay = llm.engine.runner.spec_runner.graphs
    mixed = [mode for (_, tail, _), mode in zip(replay.replayed, replay.modes, strict=True) if tail]
    assert mixed and set(mixed) == {TEMPERATURE}, replay.replayed


def test_mixed_steps_are_captured_in_every_sampling_mode():
    graphs = SpecGraphs.__new__(SpecGraphs)  # (the keys alone: no capture without CUDA)
    graphs.sizes, graphs.tails, graphs.modes, graphs.trimmed = [1, 2], (8, 16), MODES, {2: (4,)}
    keys = list(graphs._keys(2))
    for tail in (8, 16):
        assert [mode for _, t, _, mode in keys if t == tail] == list(MODES)
    assert [k for k in keys if k[2] == 4] == [(2, 0, 4, mode) for mode in MODES]
    assert keys[-1] == (2, 0, None, FILTERED)


def test_prefill_beside_windows_is_capped_and_the_rows_put_windows_first(tiny_vocab_dir, drafter):
    llm = _llm(tiny_vocab_dir, drafter, False)
    engine, tails = llm.engine, []
    long_prompt = list(range(2, 12)) * 4  # 40 tokens: more than TAIL
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("a", [2, 3, 4], params)
    engine.step()  # prefill alone: no cap
    engine.add_request("b", long_prompt, params)
    engine.add_request("c", [5, 6], params)
    while engine.has_unfinished_requests():
        plan = engine.scheduler.schedule()
        engine.scheduler.advance(plan)
        kinds = [bool(r.num_draft or r.empty_window) for r in plan.rows]
        if any(kinds) and not all(kinds):
            n = kinds.index(False)
            assert not any(kinds[n:]), kinds  # windows first, then the tail
            tails.append(sum(r.num_tokens for r in plan.rows[n:]))
        engine._update(plan, engine.runner.execute(plan))
    assert tails and max(tails) <= TAIL
    assert tails[0] == TAIL  # the long prompt's first chunk, cut at the cap


def test_a_burst_beside_windows_is_admitted_uncapped(tiny_vocab_dir, drafter):
    """More requests waiting for a seat than the tail has rows: one step admits them all, with
    their whole prompts (eagerly); as many as the tail has rows: capped, a mixed step."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for num_new, capped in ((TAIL_ROWS + 1, False), (TAIL_ROWS, True)):
        engine = _llm(tiny_vocab_dir, drafter, False, max_num_seqs=8).engine
        engine.add_request("a", [2, 3, 4], params)
        engine.step()  # prefill alone: a is drafting from now on
        prompts = PROMPTS[1 : 1 + num_new]
        for i, prompt in enumerate(prompts):
            engine.add_request(f"new{i}", prompt, params)
        plan = engine.scheduler.schedule()
        assert plan.rows[0].num_draft > 0  # a's window comes first
        tail = [r.num_tokens for r in plan.rows[1:]]
        if capped:
            assert sum(tail) <= TAIL and len(tail) <= TAIL_ROWS, tail
        else:
            assert tail == [len(p) for p in prompts] and sum(tail) > TAIL, tail


@pytest.mark.parametrize("bad", [-1, 8193, 2.5, True, "256"])
def test_bad_mixed_prefill_tokens_is_refused_by_name(bad):
    from dspark.spec.config import SpecConfig

    with pytest.raises(
        ValueError, match=r'"mixed_prefill_tokens" must be an integer in \[0, 8192\]'
    ):
        SpecConfig.from_dict({"mixed_prefill_tokens": bad})
    assert SpecConfig.from_dict({"mixed_prefill_tokens": 0}).mixed_prefill_tokens == 0


def test_mixed_prefill_tokens_may_list_several_sizes(tiny_vocab_dir, drafter):
    """A list captures a mixed step per size (sorted, duplicates dropped; one entry is the
    integer); the scheduler's cap is the largest. Empty lists, zeros and sizes past 8192 are
    refused with the key named."""
    from dspark.spec.config import SpecConfig, tail_sizes

    def sizes(value):
        return SpecConfig.from_dict({"mixed_prefill_tokens": value}).mixed_prefill_tokens

    assert sizes([512, 256, 256]) == (256, 512) and sizes([256]) == 256
    assert tail_sizes(SpecConfig.from_dict({"mixed_prefill_tokens": [512, 256]})) == (256, 512)
    assert tail_sizes(SpecConfig.from_dict({"mixed_prefill_tokens": 0})) == ()
    for bad in ([], [0, 256], [256, 8193], [256, "512"], [True]):
        with pytest.raises(ValueError, match=r'"mixed_prefill_tokens" must be .* or a non-empty'):
            sizes(bad)
    spec = {"model": str(drafter), "mixed_prefill_tokens": [16, 8]}
    llm = LLM(str(tiny_vocab_dir), dtype="float32", device="cpu", num_kv_pages=64,
              max_num_seqs=2, max_model_len=64, speculative_config=spec)  # fmt: skip
    assert llm.engine.runner.spec_runner.max_tail_tokens == 16
