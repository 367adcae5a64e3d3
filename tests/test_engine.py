"""End-to-end engine behaviour on a tiny random-weight Llama (CPU, fp32)."""

from __future__ import annotations

import pytest

from dspark import LLM, SamplingParams
from tests.helpers import full_logits

PROMPTS = [
    "Hi",
    "The quick brown fox jumps over the lazy dog",
    "Once upon a time, in a land far away, there lived a dragon who loved to read books.",
    "1 2 3 4 5",
    "What is the meaning of life, the universe and everything? Please answer briefly.",
    "A",
    "Paged attention stores keys and values in fixed-size pages.",
    "Tell me about the history of computing, from the abacus to modern GPUs, in detail.",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def _engine_is_clean(llm: LLM) -> bool:
    e = llm.engine
    return e.allocator.num_free == e.allocator.num_usable and not e.has_unfinished_requests()


@pytest.fixture(scope="module")
def alone(tiny_llm):
    return [_tokens(tiny_llm.generate([p], GREEDY, use_tqdm=False))[0] for p in PROMPTS]


def test_greedy_batch_equals_alone_with_chunked_prefill(tiny_llama_dir, alone):
    llm = LLM(
        str(tiny_llama_dir),
        dtype="float32",
        device="cpu",
        num_kv_pages=256,
        max_num_batched_tokens=16,
        max_num_seqs=8,
    )
    assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == alone
    assert _engine_is_clean(llm)


def test_greedy_batch_equals_alone_under_preemption(tiny_llama_dir, alone):
    # 11 usable pages of 16 tokens for 8 requests of up to ~45 tokens each: preemption must happen
    llm = LLM(
        str(tiny_llama_dir),
        dtype="float32",
        device="cpu",
        num_kv_pages=12,
        max_model_len=128,
        max_num_batched_tokens=64,
        max_num_seqs=8,
    )
    assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == alone
    assert llm.engine.scheduler.num_preemptions > 0
    assert _engine_is_clean(llm)


def test_seeded_sampling_is_batch_invariant(tiny_llm):
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=s, max_tokens=16, ignore_eos=True)
        for s in range(len(PROMPTS))
    ]
    batch = _tokens(tiny_llm.generate(PROMPTS, params, use_tqdm=False))
    for i in (0, 3, 7):
        assert _tokens(tiny_llm.generate([PROMPTS[i]], params[i], use_tqdm=False))[0] == batch[i]
    other = SamplingParams(
        temperature=0.8, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True
    )
    assert _tokens(tiny_llm.generate([PROMPTS[0]], other, use_tqdm=False))[0] != batch[0]
    assert _engine_is_clean(tiny_llm)


def test_stop_string_truncates_text(tiny_llm):
    full = tiny_llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)[0].outputs[0]
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    assert stop.strip(), "need a visible stop string"
    out = tiny_llm.generate(
        PROMPTS[1], SamplingParams(temperature=0, max_tokens=24, stop=stop), use_tqdm=False
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[: full.text.index(stop)]
    kept = SamplingParams(
        temperature=0, max_tokens=24, stop=[stop], include_stop_str_in_output=True
    )
    out = tiny_llm.generate(PROMPTS[1], kept, use_tqdm=False)[0].outputs[0]
    assert out.text.endswith(stop)


def test_stop_token_ids_min_tokens_and_max_tokens(tiny_llm):
    full = tiny_llm.generate(PROMPTS[2], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    stop_id = full[3]
    first = full.index(stop_id)
    out = tiny_llm.generate(
        PROMPTS[2],
        SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_id]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.token_ids == full[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    # min_tokens bans the stop token before the minimum, so the request goes on past it
    out = tiny_llm.generate(
        PROMPTS[2],
        SamplingParams(
            temperature=0, max_tokens=24, stop_token_ids=[stop_id], min_tokens=first + 2
        ),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(out.token_ids) >= first + 2 and stop_id not in out.token_ids[: first + 1]
    out = tiny_llm.generate(
        PROMPTS[2], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False
    )[0].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_logprobs_are_the_models_log_softmax(tiny_llm):
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, ignore_eos=True)
    out = tiny_llm.generate(PROMPTS[1], params, use_tqdm=False)[0]
    ids = out.prompt_token_ids + out.outputs[0].token_ids
    logprobs = full_logits(tiny_llm.engine.model, ids).logits.log_softmax(-1)
    n = len(out.prompt_token_ids)
    for k, (tok, lp) in enumerate(
        zip(out.outputs[0].token_ids, out.outputs[0].logprobs, strict=True)
    ):
        row = logprobs[n - 1 + k]
        assert tok in lp and len(lp) <= 4
        assert lp[tok] == pytest.approx(row[tok].item(), abs=1e-4)
        top3 = row.topk(3).indices.tolist()
        assert set(top3) <= set(lp)
    assert out.outputs[0].cumulative_logprob == pytest.approx(
        sum(lp[t] for t, lp in zip(out.outputs[0].token_ids, out.outputs[0].logprobs, strict=True))
    )


def test_abort_frees_pages(tiny_llm):
    engine = tiny_llm.engine
    engine.add_request("abort-me", PROMPTS[2], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.allocator.num_free < engine.allocator.num_usable
    engine.abort_request("abort-me")
    outs = engine.step()
    assert [o.outputs[0].finish_reason for o in outs if o.request_id == "abort-me"] == ["abort"]
    assert _engine_is_clean(tiny_llm)


def test_chat_applies_the_template(tiny_llm):
    conv = [{"role": "user", "content": "Hello"}]
    out = tiny_llm.chat(conv, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    expected = tiny_llm.get_tokenizer().apply_chat_template(conv)
    assert out.prompt_token_ids == expected and len(out.outputs[0].token_ids) <= 3


def test_min_tokens_and_ignore_eos_on_a_model_that_often_ends(tiny_vocab_dir):
    llm = LLM(str(tiny_vocab_dir), dtype="float32", device="cpu", num_kv_pages=64)
    eos = llm.engine.eos_token_id

    def run(**kw):
        ps = [SamplingParams(temperature=1.0, seed=s, max_tokens=8, **kw) for s in range(40)]
        return [o.outputs[0] for o in llm.generate(["a b"] * 40, ps, use_tqdm=False)]

    plain = run()
    assert any(o.finish_reason == "stop" and len(o.token_ids) < 8 for o in plain)
    assert all(o.finish_reason == "length" and len(o.token_ids) == 8 for o in run(ignore_eos=True))
    assert all(eos not in o.token_ids[:5] for o in run(min_tokens=5))


def test_arrival_time_is_the_callers_and_the_add_time_is_kept(tiny_llm):
    """add_request(arrival_time=t) (the server passes its handler's time, as vLLM does): the
    latency metrics start at t, and the engine's own add time is kept beside it."""
    import time

    engine = tiny_llm.engine
    arrival = time.monotonic() - 0.5  # (half a second in the server before it got here)
    engine.add_request("timed", "Hello", SamplingParams(max_tokens=2), arrival_time=arrival)
    engine.add_request("untimed", "Hello", SamplingParams(max_tokens=2))
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    timed, untimed = outputs["timed"].metrics, outputs["untimed"].metrics
    assert timed["arrival_time"] == arrival and timed["added_time"] >= arrival + 0.5
    assert untimed["arrival_time"] == untimed["added_time"]
    assert timed["first_token_time"] - timed["arrival_time"] >= 0.5
