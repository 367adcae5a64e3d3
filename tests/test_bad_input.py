"""Bad input gets an error naming the value and the allowed range; nothing accepted is lost."""

from __future__ import annotations

import pytest

from dspark import LLM, SamplingParams


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"max_tokens": 0}, r"max_tokens must be at least 1, got 0"),
        ({"max_tokens": -3}, r"max_tokens must be at least 1, got -3"),
        ({"temperature": -0.5}, r"temperature must be >= 0, got -0.5"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
        ({"top_k": -2}, r"top_k must be -1 .*got -2"),
        ({"min_tokens": 5, "max_tokens": 2}, r"min_tokens \(5\) must not exceed max_tokens \(2\)"),
        ({"seed": -1}, r"seed must be an integer in \[0, 2\*\*63 - 1\], got -1"),
        ({"logprobs": 50}, r"logprobs must be an integer in \[0, 20\], got 50"),
        ({"stop": [""]}, r"stop strings must be non-empty"),
    ],
)
def test_sampling_params_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_bad_prompts_in_a_batch_are_named_and_lose_nothing(tiny_llm):
    max_len = tiny_llm.engine.max_model_len
    good = ["Hello there", "Another prompt"]
    cases = [
        ("", SamplingParams(), r"prompt 1: prompt is empty"),
        ([], SamplingParams(), r"prompt 1: prompt is empty"),
        (
            [5] * max_len,
            SamplingParams(),
            rf"prompt 1: prompt has {max_len} tokens but "
            rf"max_model_len is {max_len}",
        ),
        (
            "x",
            SamplingParams(max_tokens=max_len),
            rf"prompt 1: max_tokens {max_len} plus .* "
            r"exceeds max_model_len",
        ),
        ([10**9], SamplingParams(), r"prompt 1: prompt token id 1000000000 is outside"),
        (  # an id past the vocabulary would index the logits out of range under min_tokens
            "x",
            SamplingParams(stop_token_ids=[10**6], min_tokens=2),
            r"prompt 1: stop_token_ids has 1000000, outside the vocabulary",
        ),
    ]
    for bad, params, match in cases:
        with pytest.raises(ValueError, match=match):
            tiny_llm.generate(
                [good[0], bad, good[1]],
                [SamplingParams(max_tokens=4), params, SamplingParams(max_tokens=4)],
                use_tqdm=False,
            )
        assert not tiny_llm.engine.has_unfinished_requests()  # nothing half-queued
    outs = tiny_llm.generate(good, SamplingParams(max_tokens=4), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]


def test_rejected_request_does_not_disturb_running_ones(tiny_llm):
    engine = tiny_llm.engine
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = tiny_llm.generate("Keep going", params, use_tqdm=False)[0].outputs[0].token_ids
    engine.add_request("keep", "Keep going", params)
    engine.step()
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("keep", "dup", params)
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request("bad", "", params)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done["keep"].outputs[0].token_ids == expected


def test_engine_config_errors(tiny_llama_dir):
    with pytest.raises(ValueError, match="dtype must be one of"):
        LLM(str(tiny_llama_dir), dtype="int3")
    with pytest.raises(ValueError, match="max_model_len 4096 exceeds the model's context"):
        LLM(str(tiny_llama_dir), dtype="float32", device="cpu", max_model_len=4096)
    with pytest.raises(ValueError, match="does not fit the KV cache"):
        LLM(str(tiny_llama_dir), dtype="float32", device="cpu", max_model_len=500, num_kv_pages=4)
