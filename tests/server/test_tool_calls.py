"""Tool calling without a model: the Hermes parser on crafted text, a stream's content released
only once certain, tool_choice mapped onto the grammar that holds the output (vLLM's schemas),
and the 400s for what cannot be served."""

from __future__ import annotations

import copy
import json

import pytest

pytest.importorskip("fastapi")

from dspark.models.tokenizer import Tokenizer  # noqa: E402
from dspark.server import hermes  # noqa: E402
from dspark.server.errors import APIError  # noqa: E402
from dspark.server.protocol import ChatCompletionRequest  # noqa: E402
from dspark.server.responses import ChatFormat, Delta  # noqa: E402
from dspark.server.serving import prepare_chat  # noqa: E402
from dspark.server.tool_calls import ToolCalling, tool_calling  # noqa: E402

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]},
}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters
# a template that renders tools the way Qwen's do (and one that renders none: SmolLM2's)
HERMES_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
)
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


def _calling(tool_choice=None, tools=(WEATHER, TIME), parallel=True) -> ToolCalling | None:
    body = ChatCompletionRequest(messages=MESSAGES, tools=list(tools), tool_choice=tool_choice,
                                 parallel_tool_calls=parallel)  # fmt: skip
    return tool_calling(body.tools, body.tool_choice, body.parallel_tool_calls)


def _functions(calls: list[dict]) -> list[tuple[str, dict]]:
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == len(calls)
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


# ---- the Hermes parser ----------------------------------------------------------------------


def test_hermes_calls_are_taken_out_of_the_text():
    text = (
        'I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
        '\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": "{}"}</tool_call>'
    )
    content, calls = hermes.parse(text)
    assert content == "I will check.\n\n"
    assert calls == [hermes.ParsedCall("get_weather", '{"city": "Paris"}'),
                     hermes.ParsedCall("get_time", "{}")]  # fmt: skip


def test_hermes_reads_an_unclosed_last_call_and_parameters():
    content, calls = hermes.parse('<tool_call>{"name": "f", "parameters": {"x": [1, 2]}}\n')
    assert content == "" and calls == [hermes.ParsedCall("f", '{"x": [1, 2]}')]


@pytest.mark.parametrize("text", [
    "no call here",
    '<tool_call>{"name": "f", "arguments": {"x": 1}',  # cut inside its JSON
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>["f"]</tool_call>',
    '<tool_call>{"name": "f", "arguments": 3}</tool_call>',
    '<tool_call>{"name": "f"}</tool_call><tool_call>oops</tool_call>',  # one bad: none taken
])  # fmt: skip
def test_hermes_takes_nothing_from_a_malformed_call(text):
    assert hermes.parse(text) is None


def test_a_streams_content_is_released_once_certain():
    stream = hermes.ContentStream()
    pieces = ["Sure", ". ", " Let me <", "tool_c", 'all>{"name"', "</tool_call>"]
    assert [stream.feed(p) for p in pieces] == ["Sure", ".", "  Let me", "", "", ""]
    # a "<" that turns out not to begin a call is released with what follows it
    stream = hermes.ContentStream()
    assert [stream.feed(p) for p in ["a <", "b> \n", "c"]] == ["a", " <b>", " \nc"]


# ---- tool_choice -> the grammar, and the output -> tool calls ------------------------------


def test_a_named_function_holds_the_output_to_its_parameters():
    calling = _calling({"type": "function", "function": {"name": "get_weather"}})
    assert calling.constraint().json == WEATHER["function"]["parameters"]
    content, calls = calling.parse('{"city": "Paris"}')
    assert content is None and _functions(calls) == [("get_weather", {"city": "Paris"})]
    assert calling.finish_reason("stop", calls) == "tool_calls"
    # cut by max_tokens: no call, the text is content, and the reason says so
    content, calls = calling.parse('{"city": "Pa')
    assert (content, calls) == ('{"city": "Pa', [])
    assert calling.finish_reason("length", calls) == "length"
    no_parameters = _calling({"type": "function", "function": {"name": "get_time"}})
    assert no_parameters.constraint().json == {"type": "object", "properties": {}}


def test_required_is_vllms_array_of_calls():
    schema = _calling("required").constraint().json
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    names = [alt["properties"]["name"]["enum"] for alt in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    first = schema["items"]["anyOf"][0]["properties"]
    assert first["parameters"] == WEATHER["function"]["parameters"]
    assert _calling("required", parallel=False).constraint().json["maxItems"] == 1
    content, calls = _calling("required").parse(
        '[{"name": "get_weather", "parameters": {"city": "Oslo"}},'
        ' {"name": "get_time", "parameters": {}}]'
    )
    assert content is None
    assert _functions(calls) == [("get_weather", {"city": "Oslo"}), ("get_time", {})]


def test_required_moves_each_functions_defs_to_the_root():
    point = {"$defs": {"P": {"type": "object", "properties": {"x": {"type": "number"}}}},
             "type": "object", "properties": {"at": {"$ref": "#/$defs/P"}}}  # fmt: skip
    tool = {"type": "function", "function": {"name": "go", "parameters": point}}
    schema = _calling("required", tools=[tool, TIME]).constraint().json
    assert schema["$defs"] == point["$defs"]
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    other = copy.deepcopy(tool)
    other["function"]["name"] = "stay"
    other["function"]["parameters"]["$defs"]["P"] = {"type": "string"}
    with pytest.raises(APIError, match=r"\$defs 'P'") as e:
        _calling("required", tools=[tool, other]).constraint()
    assert e.value.param == "tools"


def test_auto_parses_hermes_calls_and_keeps_the_rest_as_content():
    calling = _calling("auto")
    text = (
        'Checking. <tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}'
        '</tool_call><tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n'
    )
    content, calls = calling.parse(text)
    assert content == "Checking." and len(calls) == 2
    assert calling.finish_reason("stop", calls) == "tool_calls"
    content, calls = _calling("auto", parallel=False).parse(text)
    assert _functions(calls) == [("get_weather", {"city": "Rome"})]
    assert calling.parse("Just text.") == ("Just text.", [])
    assert calling.finish_reason("stop", []) == "stop"
    assert calling.parse('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')[0] is None


def test_no_tool_calling_without_tools_or_with_none():
    assert _calling("none") is None
    assert tool_calling(None, None, True) is None
    assert tool_calling(None, "none", True) is None  # as vLLM: "none" needs no tools
    assert _calling(None).mode == "auto"  # OpenAI's default with tools


@pytest.mark.parametrize("tool_choice", [
    "auto", "required", {"type": "function", "function": {"name": "get_weather"}},
])  # fmt: skip
def test_tool_choice_without_tools_is_refused(tool_choice):
    body = ChatCompletionRequest(messages=MESSAGES, tool_choice=tool_choice)
    with pytest.raises(APIError) as e:
        tool_calling(body.tools, body.tool_choice, body.parallel_tool_calls)
    assert e.value.param == "tool_choice" and "tools" in e.value.message


def test_an_unknown_function_or_a_duplicate_name_is_refused():
    with pytest.raises(APIError, match="'get_wether', which is not among tools") as e:
        _calling({"type": "function", "function": {"name": "get_wether"}})
    assert e.value.param == "tool_choice" and "'get_weather'" in e.value.message
    with pytest.raises(APIError, match="'get_weather' twice") as e:
        _calling("auto", tools=[WEATHER, WEATHER])
    assert e.value.param == "tools"


def test_a_functions_schema_that_does_not_compile_is_refused_naming_it():
    bad = copy.deepcopy(WEATHER)
    bad["function"]["parameters"]["properties"]["city"]["type"] = "strin"
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        with pytest.raises(APIError) as e:
            _calling(choice, tools=[TIME, bad]).constraint()
        assert e.value.param == "tools.1.function.parameters", e.value.message
    assert _calling("auto", tools=[TIME, bad]).constraint() is None  # nothing compiled


# ---- the response: whole and streamed -------------------------------------------------------


def _format(calling) -> ChatFormat:
    return ChatFormat(None, False, None, tools=calling)


def test_a_whole_choice_carries_the_calls():
    fmt = _format(_calling({"type": "function", "function": {"name": "get_weather"}}))
    choice = fmt.choice(0, Delta('{"city": "Paris"}', [1, 2], None, "stop"))
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert _functions(choice["message"]["tool_calls"]) == [("get_weather", {"city": "Paris"})]
    plain = _format(_calling("auto")).choice(0, Delta("Hello", [1], None, "length"))
    assert plain["message"] == {"role": "assistant", "content": "Hello"}
    assert plain["finish_reason"] == "length"


def _streamed(fmt: ChatFormat, pieces: list[str], reason: str = "stop") -> list[dict]:
    chunks = []
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        chunk = fmt.delta_choice(0, Delta(piece, [i], None, reason if last else None), i == 0)
        if chunk is not None:
            chunks.append(chunk)
        chunks += fmt.take_trailing()
    return chunks


def test_a_stream_sends_the_content_then_the_calls_last():
    pieces = ["Let me", " check.", "\n<tool", '_call>{"name": "get_weather", ',
              '"arguments": {"city": "Paris"}}', "</tool_call>"]  # fmt: skip
    chunks = _streamed(_format(_calling("auto")), pieces)
    content = "".join(c["delta"].get("content") or "" for c in chunks)
    assert content == "Let me check."
    *body, calls, finish = chunks  # OpenAI's order: the calls, then the finish alone
    assert all("tool_calls" not in c["delta"] and c["finish_reason"] is None for c in body)
    assert calls["finish_reason"] is None and finish["delta"] == {}
    assert finish["finish_reason"] == "tool_calls"
    (call,) = calls["delta"]["tool_calls"]
    assert call["index"] == 0 and _functions([call]) == [("get_weather", {"city": "Paris"})]
    # a constrained output sends no content: the call alone, at the end
    named = _format(_calling({"type": "function", "function": {"name": "get_weather"}}))
    chunks = _streamed(named, ['{"city"', ': "Oslo"', "}"])
    assert [c["delta"] for c in chunks[:-2]] == [{"role": "assistant", "content": ""}]
    assert _functions(chunks[-2]["delta"]["tool_calls"]) == [("get_weather", {"city": "Oslo"})]
    assert chunks[-1]["finish_reason"] == "tool_calls"


def test_a_stream_without_a_call_sends_all_its_text():
    pieces = ["Hi ", "there <", "b>", "  "]
    chunks = _streamed(_format(_calling("auto")), pieces, reason="length")
    assert "".join(c["delta"].get("content") or "" for c in chunks) == "".join(pieces)
    assert chunks[-1]["finish_reason"] == "length"


# ---- the prompt: tools rendered by the template ----------------------------------------------


@pytest.fixture
def tokenizers(smollm_hf_tokenizer) -> dict[str, Tokenizer]:
    hermes_hf = copy.deepcopy(smollm_hf_tokenizer)
    hermes_hf.chat_template = HERMES_TEMPLATE
    return {"hermes": Tokenizer(hermes_hf), "plain": Tokenizer(smollm_hf_tokenizer)}


def test_tools_reach_the_chat_template(tokenizers):
    tokenizer = tokenizers["hermes"]
    body = ChatCompletionRequest(messages=MESSAGES, tools=[WEATHER], tool_choice="none")
    prompt = tokenizer.decode(prepare_chat(body, tokenizer, "t").subs[0].prompt_ids, False)
    assert prompt.startswith("<tools>") and '"name": "get_weather"' in prompt
    assert '"city"' in prompt and prompt.endswith("<user>Weather in Paris?<assistant>")


def test_auto_needs_a_template_that_renders_tools(tokenizers):
    body = ChatCompletionRequest(messages=MESSAGES, tools=[WEATHER])
    prepare_chat(body, tokenizers["hermes"], "t")  # auto, by default
    with pytest.raises(APIError, match="does not render tools") as e:
        prepare_chat(body, tokenizers["plain"], "t")
    assert e.value.param == "tools"
    # a constrained call needs no template's help; nor does "none"
    for choice in ("required", "none", {"type": "function", "function": {"name": "get_weather"}}):
        body = ChatCompletionRequest(messages=MESSAGES, tools=[WEATHER], tool_choice=choice)
        prepare_chat(body, tokenizers["plain"], "t")


def test_a_constrained_tool_choice_with_structured_output_is_refused(tokenizers):
    for extra in ({"response_format": {"type": "json_object"}},
                  {"structured_outputs": {"regex": "a+"}}):  # fmt: skip
        body = ChatCompletionRequest(messages=MESSAGES, tools=[WEATHER], tool_choice="required",
                                     **extra)  # fmt: skip
        with pytest.raises(APIError, match="cannot be combined") as e:
            prepare_chat(body, tokenizers["hermes"], "t")
        assert e.value.param == "tool_choice"
        # "auto" may: the constraint holds the text, which is then parsed for calls
        body = ChatCompletionRequest(messages=MESSAGES, tools=[WEATHER], **extra)
        params = prepare_chat(body, tokenizers["hermes"], "t").subs[0].params
        assert params.structured_outputs is not None
