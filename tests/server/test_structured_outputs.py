"""Structured output over HTTP: response_format and structured_outputs mapped onto the engine's
StructuredOutputsParams, 400s naming the field for what does not compile or cannot be served,
and, with the official client against the real server, outputs that hold to their constraint
(plain and speculative, greedy and sampled)."""

from __future__ import annotations

import functools
import json
import re

import pytest

pytest.importorskip("fastapi")
jsonschema = pytest.importorskip("jsonschema")

from dspark.sampling_params import StructuredOutputsParams  # noqa: E402
from dspark.server.errors import APIError  # noqa: E402
from dspark.server.protocol import ChatCompletionRequest, CompletionRequest  # noqa: E402
from dspark.server.structured_outputs import requested_constraint  # noqa: E402
from tests.server.conftest import API_KEY, MODEL  # noqa: E402

openai = pytest.importorskip("openai")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "pet": {"enum": ["cat", "dog", None]},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]


def _constraint(**fields):
    body = ChatCompletionRequest(messages=MESSAGES, **fields)
    return requested_constraint(body.response_format, body.structured_outputs)


# ---- the mapping ----------------------------------------------------------------------------


def test_response_format_maps_onto_the_engines_params():
    assert _constraint() is None
    assert _constraint(response_format={"type": "text"}) is None
    params, field = _constraint(response_format={"type": "json_object"})
    assert params == StructuredOutputsParams(json_object=True) and field == "response_format"
    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                     "strict": True}}  # fmt: skip
    params, field = _constraint(response_format=schema)
    assert params == StructuredOutputsParams(json=PERSON) and field == "response_format"


@pytest.mark.parametrize("value", [
    {"json": PERSON}, {"json": json.dumps(PERSON)}, {"regex": "[a-z]+"},
    {"choice": ["yes", "no"]}, {"grammar": 'start: "a" | "b"'}, {"json_object": True},
])  # fmt: skip
def test_structured_outputs_maps_field_by_field(value):
    params, field = _constraint(structured_outputs=value)
    assert field == "structured_outputs"
    (name, expected), *_ = value.items()
    assert getattr(params, name) == expected and params.kind == name
    completion = CompletionRequest(prompt="x", structured_outputs=value)
    assert requested_constraint(None, completion.structured_outputs)[0] == params


@pytest.mark.parametrize("fields, param, message", [
    (dict(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objec"}}}),
     "response_format.json_schema.schema", "is invalid"),
    (dict(structured_outputs={"regex": "[0-9+"}), "structured_outputs.regex", "is invalid"),
    (dict(structured_outputs={"grammar": "start: (("}), "structured_outputs.grammar", "invalid"),
    (dict(structured_outputs={"json": "{not json"}), "structured_outputs", "not JSON text"),
    (dict(structured_outputs={"regex": "a", "choice": ["a"]}), "structured_outputs",
     "exactly one"),
    (dict(structured_outputs={"json_object": False}), "structured_outputs", "exactly one"),
    (dict(response_format={"type": "json_object"}, structured_outputs={"regex": "a"}),
     "structured_outputs", "send one of them"),
])  # fmt: skip
def test_what_cannot_be_served_is_a_400_naming_its_field(fields, param, message):
    with pytest.raises(APIError, match=message) as e:
        _constraint(**fields)
    assert e.value.status == 400 and e.value.param == param, e.value.message


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema"}}, "response_format"),  # no json_schema
    ({"response_format": {"type": "json_object", "json_schema": {"name": "x", "schema": {}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "structural_tag"}}, "response_format.type"),
    ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "a", "disable_any_whitespace": True}},
     "structured_outputs"),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs.regexp"),
])  # fmt: skip
def test_malformed_fields_are_400s_naming_them(server, body, param):
    import httpx

    response = httpx.post(f"{server.url}/v1/chat/completions",
                          headers={"Authorization": f"Bearer {API_KEY}"},
                          json={"messages": MESSAGES, **body})  # fmt: skip
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.json()


def test_vllms_options_at_their_neutral_value_are_accepted():
    value = {"regex": "a", "disable_any_whitespace": False, "whitespace_pattern": None}
    assert _constraint(structured_outputs=value)[0] == StructuredOutputsParams(regex="a")


# ---- served ---------------------------------------------------------------------------------


def _client(live):
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(params=["plain", "speculative"])
def live(request, server, spec_server):
    return server if request.param == "plain" else spec_server


@functools.cache
def _whitespace_ids(tokenizer) -> tuple[int, ...]:
    texts = (tokenizer.decode([i], skip_special_tokens=False) for i in range(tokenizer.vocab_size))
    return tuple(i for i, text in enumerate(texts) if text and not text.strip())


def _no_free_whitespace(live) -> dict[str, float]:
    """A logit_bias off the tokens that are whitespace only: the tiny random model would spend
    its tokens on JSON's optional whitespace (the grammar allows any amount), a real model
    writes JSON as it learned to. (166 tokens in SmolLM2's vocabulary; OpenAI allows 300.)"""
    return {str(i): -100.0 for i in _whitespace_ids(live.tokenizer)}


SAMPLING = [dict(temperature=0), dict(temperature=1.0, seed=7)]


@pytest.mark.parametrize("sampling", SAMPLING, ids=["greedy", "sampled"])
def test_a_json_schema_response_validates(live, sampling):
    schema = {"name": "person", "schema": PERSON, "strict": True}
    response_format = {"type": "json_schema", "json_schema": schema}
    out = _client(live).chat.completions.create(
        model=MODEL, messages=MESSAGES, response_format=response_format, max_tokens=60, n=2,
        logit_bias=_no_free_whitespace(live), **sampling,
    )  # fmt: skip
    for choice in out.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_a_json_object_response_is_an_object_streamed_as_whole(server):
    client = _client(server)
    kwargs = dict(model=MODEL, messages=MESSAGES, response_format={"type": "json_object"},
                  max_tokens=40, temperature=0, logit_bias=_no_free_whitespace(server))  # fmt: skip
    whole = client.chat.completions.create(**kwargs)
    text = whole.choices[0].message.content
    assert text.startswith("{")  # (the random model's keys run long: cut, the text is a prefix)
    assert whole.choices[0].finish_reason == "length" or isinstance(json.loads(text), dict)
    streamed = "".join(c.choices[0].delta.content or ""
                       for c in client.chat.completions.create(stream=True, **kwargs))  # fmt: skip
    assert streamed == text


@pytest.mark.parametrize("sampling", SAMPLING, ids=["greedy", "sampled"])
def test_regex_and_choice_through_extra_body(live, sampling):
    client = _client(live)
    regex = "(red|green|blue)-[0-9]{2}"
    out = client.completions.create(model=MODEL, prompt="A color:", max_tokens=20, n=2,
                                    extra_body={"structured_outputs": {"regex": regex}},
                                    **sampling)  # fmt: skip
    for choice in out.choices:
        assert re.fullmatch(regex, choice.text) and choice.finish_reason == "stop", choice
    choices = ["yes", "no", "it depends"]
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20, n=2,
                                          extra_body={"structured_outputs": {"choice": choices}},
                                          **sampling)  # fmt: skip
    for choice in chat.choices:
        assert choice.message.content in choices and choice.finish_reason == "stop"


def test_a_grammar_streamed(server):
    grammar = 'start: "Answer: " NUM\nNUM: /[1-9][0-9]?/'
    chunks = _client(server).completions.create(
        model=MODEL, prompt="2 + 2 =", max_tokens=20, temperature=0, stream=True,
        extra_body={"structured_outputs": {"grammar": grammar}},
    )  # fmt: skip
    chunks = list(chunks)
    text = "".join(c.choices[0].text for c in chunks)
    assert re.fullmatch("Answer: [1-9][0-9]?", text)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_bad_schema_is_refused_before_the_engine(server):
    with pytest.raises(openai.BadRequestError, match="is invalid") as e:
        _client(server).chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=4,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "x", "schema": {"type": "strng"}}},
        )  # fmt: skip
    assert e.value.body["param"] == "response_format.json_schema.schema"
    with pytest.raises(openai.BadRequestError, match="is invalid") as e:
        _client(server).completions.create(
            model=MODEL, prompt="x", max_tokens=4,
            extra_body={"structured_outputs": {"regex": "(a"}},
        )  # fmt: skip
    assert e.value.body["param"] == "structured_outputs.regex"
