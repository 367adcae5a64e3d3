"""The OpenAI/vLLM request fields of logits shaping map onto SamplingParams (field by field),
and bad values are 400s naming the field."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

from dspark.server.errors import APIError  # noqa: E402
from dspark.server.protocol import ChatCompletionRequest, CompletionRequest  # noqa: E402

FIELDS = dict(presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.2, min_p=0.1,
              logit_bias={"7": -100.0, "9": 2.5}, bad_words=["foo", "bar baz"])  # fmt: skip


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_shaping_fields_reach_the_sampling_params(route):
    if route == "chat":
        body = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], n=2, seed=3,
                                     **FIELDS)  # fmt: skip
    else:
        body = CompletionRequest(prompt="x", n=2, seed=3, **FIELDS)
    body.check_supported()
    params = [body.sampling_params(4, None, j) for j in range(body.n)]
    for sp in params:
        assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty, sp.min_p) == (
            0.5, -0.25, 1.2, 0.1,
        )  # fmt: skip
        assert sp.logit_bias == {7: -100.0, 9: 2.5} and sp.bad_words == ["foo", "bar baz"]
    assert [sp.seed for sp in params] == [3, 4]  # choice j: seed + j, as vLLM's children


def test_prompt_logprobs_and_echo_with_logprobs_are_refused_only_when_streaming():
    """The engine reports a prompt's logprobs with a whole output: served whole, refused (by
    name) on a stream."""
    CompletionRequest(prompt="x", echo=True, stream=True).check_supported()  # no logprobs
    for whole in (CompletionRequest(prompt="x", echo=True, logprobs=1),
                  CompletionRequest(prompt="x", prompt_logprobs=1)):  # fmt: skip
        whole.check_supported()
    echo = CompletionRequest(prompt="x", echo=True, logprobs=1, stream=True)
    prompt_logprobs = CompletionRequest(prompt="x", prompt_logprobs=1, stream=True)
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], prompt_logprobs=0,
                                 stream=True)  # fmt: skip
    for body, field in ((echo, "echo"), (prompt_logprobs, "prompt_logprobs"),
                        (chat, "prompt_logprobs")):  # fmt: skip
        with pytest.raises(APIError) as e:
            body.check_supported()
        assert "stream" in str(e.value.message) and e.value.param == field


def test_echo_with_logprobs_asks_the_engine_for_the_prompts_logprobs():
    """As vLLM: as many alternatives per prompt position as per output token, or the
    request's own prompt_logprobs if larger."""
    cases = [
        (dict(echo=True, logprobs=3), 3),
        (dict(echo=True, logprobs=1, prompt_logprobs=4), 4),
        (dict(echo=True), None),
        (dict(logprobs=3), None),
        (dict(prompt_logprobs=0), 0),
    ]
    for fields, computed in cases:
        params = CompletionRequest(prompt="x", **fields).sampling_params(4, None, 0)
        assert params.prompt_logprobs == computed, fields


def test_a_sampling_params_error_names_its_field():
    body = CompletionRequest(prompt="x", logit_bias={"x": 1.0})
    with pytest.raises(APIError) as e:
        body.sampling_params(4, None, 0)
    assert e.value.param == "logit_bias" and "not a token id" in e.value.message
