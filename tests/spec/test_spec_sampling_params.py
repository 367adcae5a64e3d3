"""Penalties, min_p, logit_bias and bad words under speculation: the emitted tokens keep the
shaped target's law (window position j shaped by the outputs and drafts 1..j, in the drafter
and the verifier alike), and greedy output equals plain greedy decoding token for token."""

from __future__ import annotations

import pytest
import torch

from dspark import LLM, SamplingParams
from tests.helpers import assert_matches_distribution, assert_same_logprobs
from tests.spec.eager_replay import EagerReplay
from tests.test_sampling_params_shaping import (
    MANY_PROMPTS,
    ONE_SHAPED,
    PROMPT,
    SHAPED,
    VOCAB,
    assert_raw_prompt_logprobs,
    exact_pair_probs,
    record_shaping,
)
from tests.tiny_models import make_tiny_drafter

K = 4
NUM_SAMPLES = 6000


@pytest.fixture(scope="module")
def vocab_drafter(tiny_vocab_dir, tmp_path_factory):
    return make_tiny_drafter(tiny_vocab_dir, tmp_path_factory.mktemp("drafter12"), taps=(0,))


def _spec_llm(target, drafter, **kw) -> LLM:
    return LLM(str(target), dtype="float32", device="cpu", speculative_config={
               "model": str(drafter), "num_speculative_tokens": K}, **kw)  # fmt: skip


@pytest.mark.parametrize(
    ("name", "graphs"),
    [*((name, False) for name in SHAPED), ("penalties", True), ("min_p", True)],
)  # fmt: skip
def test_speculation_keeps_the_shaped_pair_distribution(tiny_vocab_dir, vocab_drafter, name,
                                                         graphs):  # fmt: skip
    """Tokens 2 and 3 of 6,000 seeded requests (temperature 0.9): token 1 comes from the
    prefill, then a window of one draft (max_tokens 3) verifies token 2 and may emit token 3
    as its bonus, shaped with the draft among the outputs. Chi-square at the 0.1% level
    against the exact law (tests/helpers.assert_matches_distribution). `graphs`: the steps
    run as captured ones do (tests/spec/eager_replay.py), the drafts unshaped, verified again
    with the shaping."""
    llm = _spec_llm(tiny_vocab_dir, vocab_drafter, num_kv_pages=4096)
    spec_runner = llm.engine.runner.spec_runner
    if graphs:
        spec_runner.uniform_windows = True
        spec_runner.graphs = EagerReplay(spec_runner, [1, 2, 4, 8, 16, 32, 64, 128, 256])
    base = dict(temperature=0.9, max_tokens=3, ignore_eos=True)
    params = [SamplingParams(seed=s, **base, **SHAPED[name]) for s in range(NUM_SAMPLES)]
    outs = llm.generate([PROMPT] * NUM_SAMPLES, params, use_tqdm=False)
    m = llm.engine.get_metrics()
    assert m["num_drafts"] > 0 and m["num_accepted_tokens"] > 0, m
    assert llm.engine.runner.stats["spec_steps_logits_shaping"] > 0
    assert (llm.engine.runner.stats["spec_graph_steps_logits_shaping"] > 0) == graphs
    pairs = torch.tensor([o.outputs[0].token_ids[1] * VOCAB + o.outputs[0].token_ids[2]
                          for o in outs])  # fmt: skip
    counts = torch.bincount(pairs, minlength=VOCAB * VOCAB).double()
    exact = exact_pair_probs(llm.engine.model, PROMPT, SamplingParams(**base, **SHAPED[name]))
    assert_matches_distribution(counts, exact * NUM_SAMPLES)


PROMPTS = [[2, 3, 4], [5, 6, 7, 8, 9, 10, 11, 2, 3, 4, 5], [9], [4, 4, 4, 4, 4, 4, 4], [3, 5]]
GREEDY_SHAPED = {
    "penalties": [
        dict(presence_penalty=0.6, frequency_penalty=0.4, repetition_penalty=1.3),
        dict(frequency_penalty=1.5),
        dict(repetition_penalty=0.7, logit_bias={4: 1.5, 9: -2.0}),
        dict(bad_words=["e", "c d"]),  # a two-token word: its request verifies no drafts
        {},
    ],
    # no shaping reads the outputs: steps of windows still launch ahead (continuations)
    "static": [
        dict(logit_bias={4: 5.0}),
        dict(bad_words=["g"]),
        dict(min_p=0.3, logit_bias={2: -100}),
        dict(logit_bias={8: -100, 7: 3.0}),
        {},
    ],  # fmt: skip
}


@pytest.mark.parametrize("shaped", list(GREEDY_SHAPED))
@pytest.mark.parametrize(
    ("async_scheduling", "graphs"), [(True, False), (False, False), (True, True)],
    ids=["async", "sync", "graph_layouts"],
)  # fmt: skip
def test_greedy_with_shaping_equals_plain_decoding(
    tiny_vocab_dir, vocab_drafter, async_scheduling, shaped, graphs
):
    """Five requests of different shaping batched together (and one plain), 24 to 40 tokens:
    the windows' K drafts are judged with the drafts before them counted, so a window that
    miscounted would emit another argmax than plain decoding does. "graph_layouts": the steps
    run as captured ones do (tests/spec/eager_replay.py), drafted unshaped and verified again
    with the shaping."""
    shapings = GREEDY_SHAPED[shaped]
    if graphs:  # (a two-token bad word keeps its request plain: no step would be all windows)
        shapings = [dict(sh, bad_words=[w for w in sh["bad_words"] if " " not in w])
                    if "bad_words" in sh else sh for sh in shapings]  # fmt: skip
    params = [
        SamplingParams(temperature=0, max_tokens=24 + 4 * i, ignore_eos=True, **shaping)
        for i, shaping in enumerate(shapings)
    ]
    kw = dict(num_kv_pages=256, max_num_seqs=8, max_model_len=64,
              async_scheduling=async_scheduling)  # fmt: skip
    plain_llm = LLM(str(tiny_vocab_dir), dtype="float32", device="cpu", **kw)
    plain = [o.outputs[0].token_ids for o in plain_llm.generate(PROMPTS, params, use_tqdm=False)]
    unshaped = [SamplingParams(temperature=0, max_tokens=p.max_tokens, ignore_eos=True)
                for p in params]  # fmt: skip
    reference = plain_llm.generate(PROMPTS, unshaped, use_tqdm=False)
    assert sum(o.outputs[0].token_ids != t for o, t in zip(reference, plain, strict=True)) >= 3, (
        "the shaping should change most outputs"
    )
    llm = _spec_llm(tiny_vocab_dir, vocab_drafter, **kw)
    spec_runner = llm.engine.runner.spec_runner
    spec_runner.uniform_windows = True  # (as with graphs: K + 1 wide windows)
    if graphs:
        spec_runner.graphs = EagerReplay(spec_runner, [1, 2, 4, 8])
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert got == plain
    m = llm.engine.get_metrics()
    assert m["num_drafts"] > 0 and m["num_accepted_tokens"] > 0, m
    stats = llm.engine.runner.stats
    assert stats["spec_steps_logits_shaping"] > 0
    assert (stats["spec_graph_steps_logits_shaping"] > 0) == graphs, dict(stats)
    if async_scheduling and (shaped == "static" or graphs):
        # steps of continuation windows, launched behind the step before and verified once
        # it is collected, with the outputs it wrote (a two-token bad word keeps the eager
        # run's penalties set plain: no step of it launches ahead)
        assert stats["continuation_windows"] > 0, stats
        assert stats["spec_steps_verified_after_previous"] > 0, stats


def test_one_shaping_window_among_many(tiny_vocab_dir, vocab_drafter, monkeypatch):
    """Eight greedy requests drafting together, request 3 shaping its logits: each speculative
    step's tensors hold its window alone, the seven others emit the tokens and logprobs of a
    run where no request shapes, and request 3 those of plain decoding alone."""
    from dspark.runner import spec_runner

    built = record_shaping(monkeypatch, spec_runner)
    kw = dict(num_kv_pages=256, max_num_seqs=8, max_model_len=64)
    base = dict(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    params = [SamplingParams(**base, **(ONE_SHAPED if i == 3 else {})) for i in range(8)]
    llm = _spec_llm(tiny_vocab_dir, vocab_drafter, **kw)
    shaped = llm.generate(MANY_PROMPTS, params, use_tqdm=False)
    assert llm.engine.get_metrics()["num_accepted_tokens"] > 0
    assert any(n > 1 for n, _ in built)
    # (a step whose windows leave request 3 out, a plain row beside them, builds none)
    assert {(s.bias.shape[0], s.output_counts.shape[0]) for _, s in built} <= {(0, 0), (1, 1)}
    assert sum(len(s.rows) for _, s in built) > 0
    unshaped = llm.generate(MANY_PROMPTS, SamplingParams(**base), use_tqdm=False)
    others = [0, 1, 2, 4, 5, 6, 7]
    assert [shaped[i].outputs[0].token_ids for i in others] == [
        unshaped[i].outputs[0].token_ids for i in others
    ]
    assert_same_logprobs([shaped[i] for i in others], [unshaped[i] for i in others])
    plain = LLM(str(tiny_vocab_dir), dtype="float32", device="cpu", **kw)
    alone = plain.generate([MANY_PROMPTS[3]], params[3], use_tqdm=False)
    assert shaped[3].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert shaped[3].outputs[0].token_ids != unshaped[3].outputs[0].token_ids
    assert_same_logprobs([shaped[3]], alone)


def test_prompt_logprobs_beside_windows(tiny_vocab_dir, vocab_drafter):
    """A long prompt prefilled in chunks of at most 8 tokens while another request drafts:
    its prompt logprobs are the raw model's, and the drafting request's greedy text is plain
    decoding's."""
    kw = dict(num_kv_pages=128, max_num_batched_tokens=8, max_num_seqs=4, max_model_len=64)
    prompt = [2, 3, 4, 3, 9, 9, 5, 7, 2, 6, 11, 10, 4, 4, 8, 3, 2, 7, 6, 5]
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=3)]  # fmt: skip
    llm = _spec_llm(tiny_vocab_dir, vocab_drafter, **kw)
    # the long prompt arrives once the first request drafts
    llm.engine.add_request("a", PROMPT, params[0])
    for _ in range(3):
        llm.engine.step()
    llm.engine.add_request("b", prompt, params[1])
    outs = {}
    while llm.engine.has_unfinished_requests():
        for o in llm.engine.step():
            if o.finished:
                outs[o.request_id] = o
    assert_raw_prompt_logprobs(llm.engine.model, prompt, outs["b"].prompt_logprobs, 3)
    plain = LLM(str(tiny_vocab_dir), dtype="float32", device="cpu", **kw)
    expected = plain.generate([PROMPT], params[0], use_tqdm=False)[0].outputs[0].token_ids
    assert outs["a"].outputs[0].token_ids == expected
    assert llm.engine.get_metrics()["num_drafts"] > 0
    assert llm.engine.runner.stats["eager_steps_prompt_logprobs"] > 0
