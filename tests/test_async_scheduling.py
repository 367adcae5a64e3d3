"""Async scheduling (step N+1 launched before step N's tokens are read) changes no output.

Each case runs the same batch through an engine with async_scheduling on and one with it off and
compares everything a caller sees: tokens, text, finish and stop reasons, logprobs. The mix
covers the paths where a token's value matters after the next step was already launched: EOS
and stop token ids, stop strings, min_tokens, max_tokens, preemption, abort.
"""

from __future__ import annotations

import random

import pytest

from dspark import LLM, SamplingParams
from tests.helpers import assert_same_logprobs
from tests.test_engine import PROMPTS


def _llm(model_dir, async_scheduling: bool, **kwargs) -> LLM:
    return LLM(str(model_dir), dtype="float32", device="cpu",
               async_scheduling=async_scheduling, **kwargs)  # fmt: skip


def _seen(outputs):
    return [
        (c.token_ids, c.text, c.finish_reason, c.stop_reason)
        for c in (o.outputs[0] for o in outputs)
    ]


def _mixed_params(llm_sync: LLM) -> list[SamplingParams]:
    full = llm_sync.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False
    )
    ids = [o.outputs[0].token_ids for o in full]
    texts = [o.outputs[0].text for o in full]
    return [
        SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[ids[0][2]]),
        SamplingParams(temperature=0, max_tokens=20, stop=texts[1][6:9] or "e"),
        SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[ids[2][1]], min_tokens=5),
        SamplingParams(temperature=0, max_tokens=1),
        SamplingParams(temperature=0.9, top_p=0.8, seed=3, max_tokens=17, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=9, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0.7, top_k=20, seed=5, max_tokens=20, logprobs=1),
        SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[ids[7][0]]),
    ]


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        dict(num_kv_pages=256, max_num_batched_tokens=16, max_num_seqs=8),  # chunked prefill
        dict(
            num_kv_pages=12, max_model_len=128, max_num_batched_tokens=64, max_num_seqs=8
        ),  # preemption
    ],
    ids=["chunked", "preemption"],
)
def test_async_outputs_equal_sync_outputs(tiny_llama_dir, engine_kwargs):
    sync = _llm(tiny_llama_dir, False, **engine_kwargs)
    params = _mixed_params(sync)
    expected = sync.generate(PROMPTS, params, use_tqdm=False)
    fast = _llm(tiny_llama_dir, True, **engine_kwargs)
    assert fast.engine.async_scheduling
    got = fast.generate(PROMPTS, params, use_tqdm=False)
    assert _seen(got) == _seen(expected)
    assert_same_logprobs(got, expected)
    if engine_kwargs["num_kv_pages"] == 7:
        assert fast.engine.scheduler.num_preemptions > 0
    engine = fast.engine
    assert engine.allocator.num_free == engine.allocator.num_usable
    assert not engine.has_unfinished_requests()


def test_abort_while_the_next_step_is_in_flight(tiny_llama_dir):
    llm = _llm(tiny_llama_dir, True, num_kv_pages=64)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine.add_request("keep", PROMPTS[1], params)
    engine.add_request("drop", PROMPTS[2], params)
    for _ in range(4):
        engine.step()
    assert engine._in_flight is not None  # a step is launched and not yet read back
    engine.abort_request("drop")
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    reasons = {o.request_id: o.outputs[0].finish_reason for o in outputs if o.finished}
    assert reasons == {"drop": "abort", "keep": "length"}
    keep = next(o for o in outputs if o.request_id == "keep" and o.finished)
    alone = _llm(tiny_llama_dir, False, num_kv_pages=64).generate(
        PROMPTS[1], params, use_tqdm=False
    )
    assert keep.outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert engine.allocator.num_free == engine.allocator.num_usable


@pytest.mark.parametrize("seed", range(6))
def test_async_equals_sync_on_random_tight_batches(tiny_vocab_dir, seed):
    """Random prompts, lengths and frequent stop tokens on a KV cache of 6 pages (preemptions,
    requests stopping while the next step is in flight): async and sync give the same tokens."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(12) for _ in range(rng.randrange(1, 30))] for _ in range(10)]
    params = [SamplingParams(temperature=rng.choice([0.0, 1.0]), seed=i,
                             max_tokens=rng.randrange(1, 30),
                             stop_token_ids=[rng.randrange(12) for _ in range(3)])
              for i in range(10)]  # fmt: skip
    kw = dict(num_kv_pages=6, max_model_len=64, max_num_batched_tokens=32, max_num_seqs=8)
    runs = {}
    for mode in (False, True):
        llm = _llm(tiny_vocab_dir, mode, **kw)
        runs[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.engine.allocator.num_free == llm.engine.allocator.num_usable
    assert runs[True] == runs[False]
