"""Tool calling with the official client against the real server: a named function's call and
"required" held to their schemas by the grammar (plain and speculative), "auto" parsed from the
model's Hermes-style text (its text made a call by a regex, the random model would not write
one), streamed calls read by the client's own stream helper, and the 400s."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

pytest.importorskip("fastapi")
jsonschema = pytest.importorskip("jsonschema")

from tests.server.conftest import API_KEY, MODEL, auth, engine_config, start_server  # noqa: E402
from tests.server.test_structured_outputs import _no_free_whitespace  # noqa: E402

openai = pytest.importorskip("openai")

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": CITY,
                                            "description": "The weather in a city"}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}  # fmt: skip
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
# Qwen2.5's way of showing tools and asking for Hermes-style calls, cut to its bones
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call functions:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\nFor each call write "
    '<tool_call>{"name": <function-name>, "arguments": <args-json-object>}</tool_call>'
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# what "auto" is given to parse: some text, then a call, as the template asks
CALL_REGEX = (
    r'Let me check\.\n<tool_call>\{"name": "get_weather", "arguments": '
    r'\{"city": "(Paris|Oslo)", "unit": "[CF]"\}\}</tool_call>'
)


def _client(live):
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(params=["plain", "speculative"])
def live(request, server, spec_server):
    return server if request.param == "plain" else spec_server


@pytest.fixture(scope="module")
def tool_server(tiny_llama_dir, tmp_path_factory):
    """The tiny Llama with a chat template that renders tools (SmolLM2's renders none)."""
    from transformers import AutoTokenizer

    directory = tmp_path_factory.mktemp("tool_llama")
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_llama_dir / name, directory / name)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    tokenizer.chat_template = HERMES_TEMPLATE
    tokenizer.save_pretrained(directory)
    live = start_server(engine_config(directory, max_model_len=512), api_key=API_KEY)
    yield live
    live.stop()


def _arguments(call, schema: dict) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, schema)
    return arguments


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, seed=3)],
                         ids=["greedy", "sampled"])  # fmt: skip
def test_a_named_function_is_called_with_valid_arguments(live, sampling):
    out = _client(live).chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=[WEATHER, TIME], tool_choice=NAMED, max_tokens=60,
        logit_bias=_no_free_whitespace(live), **sampling,
    )  # fmt: skip
    (choice,) = out.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    _arguments(call, CITY)


def test_required_calls_one_of_the_functions(live):
    out = _client(live).chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=[WEATHER, TIME], tool_choice="required",
        parallel_tool_calls=False, max_tokens=80, temperature=0, n=2, seed=1,
        logit_bias=_no_free_whitespace(live),
    )  # fmt: skip
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls  # parallel_tool_calls false: one
        schema = {"get_weather": CITY, "get_time": TIME["function"]["parameters"]}
        _arguments(call, schema[call.function.name])


def test_a_streamed_call_reads_with_the_clients_stream_helper(server):
    client = _client(server)
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=[WEATHER], tool_choice=NAMED,
                  max_tokens=60, temperature=0, logit_bias=_no_free_whitespace(server))  # fmt: skip
    whole = client.chat.completions.create(**kwargs)
    with client.chat.completions.stream(**kwargs) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_completion()
    (choice,) = final.choices
    assert choice.finish_reason == "tool_calls" and "tool_calls.function.arguments.done" in events
    (call,) = choice.message.tool_calls
    expected = whole.choices[0].message.tool_calls[0]
    assert (call.function.name, call.function.arguments) == (
        expected.function.name, expected.function.arguments)  # fmt: skip
    # the raw chunks: no content, the call whole in one chunk, then the finish alone
    *chunks, calls, finish = list(client.chat.completions.create(stream=True, **kwargs))
    assert all(not c.choices[0].delta.content and not c.choices[0].delta.tool_calls
               for c in chunks)  # fmt: skip
    assert calls.choices[0].delta.tool_calls[0].index == 0
    assert calls.choices[0].finish_reason is None and finish.choices[0].delta.tool_calls is None
    assert finish.choices[0].finish_reason == "tool_calls"


def test_auto_parses_the_models_calls_out_of_its_text(tool_server):
    client = _client(tool_server)
    forced = {"structured_outputs": {"regex": CALL_REGEX}}
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=[WEATHER, TIME], max_tokens=80,
                  temperature=0, extra_body=forced)  # fmt: skip
    out = client.chat.completions.create(**kwargs)  # tool_choice "auto": the default
    (choice,) = out.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert _arguments(call, CITY)["city"] in ("Paris", "Oslo")
    # streamed: the content as it came, the same call at the end
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Let me check."
    streamed = chunks[-2].choices[0].delta.tool_calls
    assert chunks[-1].choices[0].finish_reason == "tool_calls" and len(streamed) == 1
    assert streamed[0].function.arguments == call.function.arguments


def test_auto_without_a_call_is_a_plain_answer(tool_server):
    client = _client(tool_server)
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=[WEATHER], tool_choice="auto", max_tokens=8,
        temperature=0,
    )  # fmt: skip
    (choice,) = out.choices
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8,
                                           temperature=0)  # fmt: skip
    # the tools were in the prompt: /tokenize renders them the same way
    tokenized = httpx.post(f"{tool_server.url}/tokenize", headers=auth(),
                           json={"messages": MESSAGES, "tools": [WEATHER]}).json()  # fmt: skip
    assert out.usage.prompt_tokens == tokenized["count"] > plain.usage.prompt_tokens


def test_tool_errors_the_client_sees(server):
    client = _client(server)
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=4)
    cases = [
        (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
         "tool_choice", "'nope', which is not among tools"),
        (dict(tool_choice="required"), "tool_choice", "only allowed with tools"),
        (dict(tools=[WEATHER]), "tools", "does not render tools"),  # SmolLM2's template: auto
        (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}),
         "tool_choice", "cannot be combined"),
        (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"x": {"type": "nmber"}}}}}], tool_choice="required"),
         "tools.0.function.parameters", "is invalid"),
        (dict(tools=[WEATHER, WEATHER], tool_choice="none"), "tools", "twice"),
    ]  # fmt: skip
    for fields, param, message in cases:
        with pytest.raises(openai.BadRequestError, match=message) as e:
            client.chat.completions.create(**kwargs, **fields)
        assert e.value.body["param"] == param, e.value.body
    # "none" with tools is served, tools or not in the template
    out = client.chat.completions.create(**kwargs, tools=[WEATHER], tool_choice="none")
    assert out.choices[0].message.tool_calls is None
