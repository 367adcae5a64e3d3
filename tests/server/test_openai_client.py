"""The official `openai` client against the real server: completions, chat, streaming with
usage, with and without speculation, and the errors a client sees."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import API_KEY, MODEL, auth

openai = pytest.importorskip("openai")

GREEDY = dict(temperature=0, max_tokens=12, extra_body={"ignore_eos": True})


def _client(live, api_key: str = API_KEY):
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=api_key, max_retries=0)


@pytest.fixture(params=["plain", "speculative"])
def live(request, server, spec_server):
    return server if request.param == "plain" else spec_server


def test_completion(live):
    out = _client(live).completions.create(model=MODEL, prompt="The quick brown fox", **GREEDY)
    assert out.object == "text_completion" and out.model == MODEL
    (choice,) = out.choices
    assert choice.finish_reason == "length" and choice.text
    assert out.usage.completion_tokens == 12
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12


def test_chat(live):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    out = _client(live).chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    (choice,) = out.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length" and out.usage.completion_tokens == 12


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_streaming_with_usage_equals_the_whole_response(live, route):
    client = _client(live)
    if route == "chat":
        create = client.chat.completions.create
        kwargs = dict(messages=[{"role": "user", "content": "Count to ten."}])
    else:
        create, kwargs = client.completions.create, dict(prompt="One, two, three,")
    whole = create(model=MODEL, **kwargs, **GREEDY)
    chunks = list(create(model=MODEL, stream=True, stream_options={"include_usage": True},
                         **kwargs, **GREEDY))  # fmt: skip
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 12
    assert all(c.usage is None for c in body)
    if route == "chat":
        assert body[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in body)
        assert text == whole.choices[0].message.content
    else:
        text = "".join(c.choices[0].text for c in body)
        assert text == whole.choices[0].text
    assert body[-1].choices[0].finish_reason == "length"
    assert [c.choices[0].finish_reason for c in body[:-1]] == [None] * (len(body) - 1)


def test_speculation_is_lossless_and_reports_its_figures(server, spec_server):
    """Greedy: the speculative server answers what the plain one does; its usage carries the
    request's own drafts and acceptances, which add up to the /metrics counters' increase."""
    prompt = "Once upon a time"
    plain = _client(server).completions.create(model=MODEL, prompt=prompt, **GREEDY)
    before = _spec_counters(spec_server)
    spec = _client(spec_server).completions.create(model=MODEL, prompt=prompt, **GREEDY)
    after = _spec_counters(spec_server)
    assert spec.choices[0].text == plain.choices[0].text
    figures = spec.usage.model_extra["speculation"]
    assert figures["num_drafts"] > 0
    assert figures["num_drafts"] == after["num_drafts"] - before["num_drafts"]
    assert figures["num_accepted_tokens"] == after["num_accepted"] - before["num_accepted"]
    tau = 1 + figures["num_accepted_tokens"] / figures["num_drafts"]
    assert figures["mean_acceptance_length"] == pytest.approx(tau)
    details = spec.usage.completion_tokens_details
    assert details.accepted_prediction_tokens == figures["num_accepted_tokens"]
    assert "speculation" not in (plain.usage.model_extra or {})


def _spec_counters(live) -> dict[str, float]:
    text = httpx.get(f"{live.url}/metrics").text
    values = {}
    for line in text.splitlines():
        for key, name in (
            ("num_drafts", "vllm:spec_decode_num_drafts_total"),
            ("num_accepted", "vllm:spec_decode_num_accepted_tokens_total"),
        ):
            if line.startswith(name + "{"):
                values[key] = float(line.rsplit(" ", 1)[1])
    return values


def test_opting_out_of_speculation(spec_server):
    extra = {"ignore_eos": True, "use_speculation": False}
    out = _client(spec_server).completions.create(
        model=MODEL, prompt="Hello", temperature=0, max_tokens=8, extra_body=extra
    )
    assert out.usage.model_extra["speculation"]["num_drafts"] == 0


def test_n_choices_and_several_prompts(server):
    """Choice i * n + j is prompt i's j-th sample; prompt tokens count once per prompt."""
    client = _client(server)
    kwargs = dict(model=MODEL, prompt=["Hello", "Goodbye"], n=2, seed=7, temperature=1.0,
                  max_tokens=5, extra_body={"ignore_eos": True})  # fmt: skip
    out = client.completions.create(**kwargs)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.usage.completion_tokens == 4 * 5
    single = client.completions.create(model=MODEL, prompt="Hello", max_tokens=1)
    goodbye = client.completions.create(model=MODEL, prompt="Goodbye", max_tokens=1)
    assert out.usage.prompt_tokens == single.usage.prompt_tokens + goodbye.usage.prompt_tokens
    again = client.completions.create(**kwargs)
    assert [c.text for c in again.choices] == [c.text for c in out.choices]  # seeded
    assert out.choices[0].text != out.choices[1].text  # choice j samples with seed + j


def test_sampling_parameters_shape_the_output(live):
    """logit_bias and bad_words reach the engine: greedy with a bias of 100 on one token emits
    only it; banning that token as a bad word removes it (plain and speculative servers
    alike; every field's mapping: tests/server/test_protocol_sampling.py)."""
    client = _client(live)
    tok = live.tokenizer
    token = tok.encode(" the", add_special_tokens=False)
    assert len(token) == 1
    greedy = dict(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0,
                  extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
    biased = client.completions.create(**greedy, logit_bias={str(token[0]): 100})
    assert biased.choices[0].text == " the" * 6
    banned = client.completions.create(
        **{**greedy, "extra_body": {**greedy["extra_body"], "bad_words": ["the"]}},
        logit_bias={str(token[0]): 100},
    )  # fmt: skip
    assert " the" not in banned.choices[0].text
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0,
        logit_bias={str(token[0]): 100}, n=2,
    )  # fmt: skip
    assert [c.message.content for c in chat.choices] == [" the" * 4] * 2


def test_echo_puts_the_prompt_before_each_choice(server):
    """Whole and streamed, text and token-id prompts, n = 2: choice i * n + j starts with
    prompt i's text, then what the same request without echo answers."""
    client = _client(server)
    ids = server.tokenizer.encode("Goodbye", add_special_tokens=False)
    kwargs = dict(model=MODEL, max_tokens=4, temperature=0, n=2)
    for prompt, texts in ((["Hello", "Once"], ["Hello", "Once"]), ([ids], ["Goodbye"])):
        plain = client.completions.create(prompt=prompt, **kwargs)
        echoed = client.completions.create(prompt=prompt, echo=True, **kwargs)
        expected = [texts[c.index // 2] + c.text for c in plain.choices]
        assert [c.text for c in echoed.choices] == expected
        streamed = [""] * len(expected)
        for chunk in client.completions.create(prompt=prompt, echo=True, stream=True, **kwargs):
            for c in chunk.choices:
                streamed[c.index] += c.text
        assert streamed == expected


def test_logprobs(server):
    client = _client(server)
    out = client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, temperature=0,
                                    logprobs=3, extra_body={"ignore_eos": True})  # fmt: skip
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset[0] == 0
    for logprob, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0 and max(top.values()) == pytest.approx(logprob)  # greedy: the top
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=3, logprobs=True, top_logprobs=2)  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(entry.top_logprobs) == 2 for entry in content)


def test_stop_string_streamed_never_shows_what_the_whole_response_cuts(server):
    client = _client(server)
    whole = client.completions.create(model=MODEL, prompt="Tell me a story", **GREEDY)
    text = whole.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # a stop string inside the greedy text
    kwargs = dict(model=MODEL, prompt="Tell me a story", stop=[stop], **GREEDY)
    cut = client.completions.create(**kwargs)
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs))
    assert (
        cut.choices[0].finish_reason == "stop" and cut.choices[0].text == text[: text.index(stop)]
    )
    assert streamed == cut.choices[0].text


def test_errors_the_client_sees(server):
    client = _client(server)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=-1)
    assert e.value.status_code == 400 and "max_tokens" in e.value.message
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError, match="exceeds max_model_len 128"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=500)
    with pytest.raises(openai.BadRequestError, match="n: Input should be less than or equal"):
        client.completions.create(model=MODEL, prompt="x", n=9)
    with pytest.raises(openai.BadRequestError, match="presence_penalty: Input should be less"):
        client.completions.create(model=MODEL, prompt="x", presence_penalty=2.5)
    # vLLM's sampling extensions, sent as extra fields: bounds are 400s naming the field
    for name, value in (("min_p", 1.5), ("repetition_penalty", 0.0), ("bad_words", [""]),
                        ("logit_bias", {"5": 101}), ("prompt_logprobs", 21)):  # fmt: skip
        with pytest.raises(openai.BadRequestError, match=name) as e:
            client.completions.create(model=MODEL, prompt="x", extra_body={name: value})
        assert e.value.body["param"].startswith(name), e.value.body
    with pytest.raises(openai.BadRequestError, match="logit_bias has token 49152, outside"):
        client.completions.create(model=MODEL, prompt="x", logit_bias={"49152": 1})
    with pytest.raises(openai.BadRequestError, match="logit_bias key 'x' is not a token id"):
        client.completions.create(model=MODEL, prompt="x", logit_bias={"x": 1})
    with pytest.raises(openai.BadRequestError, match="stop: List should have at most 16"):
        client.completions.create(model=MODEL, prompt="x", stop=[str(i) for i in range(17)])
    with pytest.raises(openai.BadRequestError, match="logprobs: Input should be less than"):
        client.completions.create(model=MODEL, prompt="x", logprobs=21)
    with pytest.raises(openai.NotFoundError, match="'gpt-4' does not exist"):
        client.completions.create(model="gpt-4", prompt="x")
    with pytest.raises(openai.AuthenticationError):
        _client(server, api_key="wrong").completions.create(model=MODEL, prompt="x")
    with pytest.raises(openai.AuthenticationError):
        _client(server, api_key="wrong").models.list()


def test_models_version_and_open_routes(server):
    (card,) = _client(server).models.list().data
    assert card.id == MODEL and card.model_extra["max_model_len"] == 128
    assert httpx.get(f"{server.url}/version").json()["version"]
    assert httpx.get(f"{server.url}/health").json() == {"status": "serving"}  # no key needed


def _post(live, body=None, content: bytes | None = None) -> httpx.Response:
    headers = {**auth(), "content-type": "application/json"}
    if content is not None:
        return httpx.post(f"{live.url}/v1/completions", headers=headers, content=content)
    return httpx.post(f"{live.url}/v1/completions", headers=headers, json=body)


def test_validation_errors_are_400_in_the_envelope(server):
    for response in (
        _post(server, {"prompt": "x", "temperature": "hot"}),
        _post(server, {}),  # no prompt
        _post(server, {"prompt": ""}),
        _post(server, {"prompt": [[]]}),
        _post(server, {"prompt": [10**12]}),
        _post(server, content=b"{not json"),
        _post(server, content=b'{"prompt": "x", "temperature": NaN}'),
        _post(server, {"prompt": "x", "top_p": 0}),
        _post(server, {"prompt": [49151, 10**6]}),  # outside the vocabulary: the engine's check
        _post(server, {"prompt": "x", "stream_options": {"include_usage": True}}),  # no stream
        _post(server, {"prompt": "x", "echo": True, "logprobs": 1, "stream": True}),
        _post(server, content=b'{"prompt": "\\ud800"}'),  # a lone surrogate
    ):
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error" and error["message"]
    big = _post(server, {"prompt": "x" * (3 * 1024 * 1024)})
    assert big.status_code == 413 and "exceeds the server's limit" in big.json()["error"]["message"]
