"""Chat messages reach the chat template whole, and a field the server cannot honour is
refused: never a message silently altered."""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("fastapi")

from dspark.models.tokenizer import Tokenizer  # noqa: E402
from dspark.server.errors import APIError  # noqa: E402
from dspark.server.protocol import ChatCompletionRequest  # noqa: E402
from dspark.server.serving import prepare_chat  # noqa: E402

# renders what a tool-calling template reads: the assistant's calls, a tool result's call id
TOOL_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content or '' }}"
    "{% for call in m.tool_calls or [] %}[call {{ call.id }} {{ call.function.name }}"
    "({{ call.function.arguments }})]{% endfor %}"
    "{% if m.tool_call_id %}[result of {{ m.tool_call_id }}]{% endif %}{% endfor %}"
)
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}  # fmt: skip


@pytest.fixture
def tool_tokenizer(smollm_hf_tokenizer) -> Tokenizer:
    hf = copy.deepcopy(smollm_hf_tokenizer)
    hf.chat_template = TOOL_TEMPLATE
    return Tokenizer(hf)


def _rendered(tokenizer: Tokenizer, messages: list[dict]) -> str:
    body = ChatCompletionRequest(messages=messages, add_generation_prompt=False)
    ids = prepare_chat(body, tokenizer, "test").subs[0].prompt_ids
    return tokenizer.decode(ids, skip_special_tokens=False)


def test_an_assistant_messages_tool_calls_and_a_tool_result_reach_the_template(tool_tokenizer):
    text = _rendered(tool_tokenizer, [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "content": "12 C", "tool_call_id": "call_1"},
    ])  # fmt: skip
    assert '<assistant>[call call_1 get_weather({"city": "Oslo"})]' in text, text
    assert "<tool>12 C[result of call_1]" in text, text


def test_messages_without_tool_fields_render_as_before(tool_tokenizer):
    text = _rendered(tool_tokenizer, [{"role": "user", "content": "Hi"}])
    assert text == "<user>Hi"


@pytest.mark.parametrize(
    "tool_choice", ["auto", "required", {"type": "function", "function": {"name": "f"}}]
)
def test_tool_choice_without_tools_is_refused_naming_it(tool_tokenizer, tool_choice):
    """(As vLLM, "none" without tools asks for nothing and is served.)"""
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}],
                                 tool_choice=tool_choice)  # fmt: skip
    with pytest.raises(APIError) as refused:
        prepare_chat(body, tool_tokenizer, "test")
    assert refused.value.status == 400 and refused.value.param == "tool_choice"
    assert "tool_choice" in refused.value.message and "tools" in refused.value.message


def test_a_tool_message_needs_its_call_id():
    with pytest.raises(ValueError, match="tool_call_id"):
        ChatCompletionRequest(messages=[{"role": "tool", "content": "12 C"}])
