"""A finished request's id may be used again: the new request gets its own pages and tokens."""

from __future__ import annotations

from dspark import LLM, SamplingParams
from tests.test_engine import PROMPTS


def _run(engine, prompts, params):
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[str(i)] for i in range(len(prompts))]


def test_reused_ids_give_the_outputs_of_a_fresh_engine(tiny_llama_dir):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kw = dict(
        dtype="float32", device="cpu", num_kv_pages=64, max_num_batched_tokens=16, max_num_seqs=8
    )
    engine = LLM(str(tiny_llama_dir), **kw).engine
    _run(engine, PROMPTS[::-1], params)  # the ids 0.. first name other prompts and pages
    again = _run(engine, PROMPTS, params)
    fresh = _run(LLM(str(tiny_llama_dir), **kw).engine, PROMPTS, params)
    assert again == fresh
