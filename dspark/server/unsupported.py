"""Request fields that are not dspark's: vLLM's (and OpenAI's) that the engine does not
implement, and names that are no field at all. Each is answered 400 naming it, never ignored:
a client that sends `guided_json` and gets unconstrained text back has been misled.

A field in NEUTRAL_VALUES is accepted at the value that asks for nothing (a client or library
may send it by default: `store: false`, `use_beam_search: false`); any other value is refused.
JSON null counts as omitted for every field listed here. The lists follow vLLM's
CompletionRequest and ChatCompletionRequest (vllm/entrypoints/openai/protocol.py) and OpenAI's
chat and completions APIs; a field a route declares is never looked up here, so implementing
one is declaring it in protocol.py.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator

from dspark.server.errors import APIError

BEAM = "beam search is not supported"
TOOLS = "tools are served on /v1/chat/completions only"


def _guided(replacement: str) -> str:
    return (
        f"vLLM's guided_* fields were replaced by structured_outputs; send "
        f'{{"structured_outputs": {replacement}}}'
    )


# field -> why it is refused
UNSUPPORTED: dict[str, str] = {
    "guided_json": _guided('{"json": SCHEMA}'),
    "guided_regex": _guided('{"regex": REGEX}'),
    "guided_choice": _guided('{"choice": [...]}'),
    "guided_grammar": _guided('{"grammar": GRAMMAR}'),
    "guided_decoding_backend": "the structured output backend is the engine's (llguidance); "
    "omit it",
    "guided_whitespace_pattern": "guided_whitespace_pattern is not supported (JSON whitespace "
    "is the grammar's: flexible)",
    "structural_tag": "structural tags are not supported; use structured_outputs",
    "use_beam_search": BEAM,
    "length_penalty": f"length_penalty applies to beam search; {BEAM}",
    "prompt_embeds": "prompt embeddings are not supported; send text or token ids",
    "truncate_prompt_tokens": "prompt truncation is not supported; shorten the prompt",
    "allowed_token_ids": "allowed_token_ids is not supported yet",
    "bad_words": "bad_words is not supported yet",
    "logits_processors": "custom logits processors are not supported",
    "spaces_between_special_tokens": "spaces_between_special_tokens is not supported; "
    "special tokens are decoded as the tokenizer joins them",
    "return_tokens_as_token_ids": "return_tokens_as_token_ids is not supported; "
    "use return_token_ids",
    "priority": "request priorities are not supported (the scheduler is first come, first served)",
    "request_id": "request_id is not a body field here; send the X-Request-Id header",
    "cache_salt": "cache_salt is not supported",
    "kv_transfer_params": "KV transfer (disaggregated serving) is not supported",
    "vllm_xargs": "vllm_xargs is not supported",
    "add_special_tokens": "add_special_tokens is not supported on this route (/tokenize takes it)",
    "continue_final_message": "continue_final_message is not supported yet",
    "documents": "documents (retrieval templates) are not supported",
    "chat_template": "a per-request chat_template is not supported; the model's own is used",
    "mm_processor_kwargs": "multimodal inputs are not supported",
    "media_io_kwargs": "multimodal inputs are not supported",
    "echo": "echo is not supported on chat completions",
    "reasoning_effort": "reasoning options are not supported",
    "include_reasoning": "reasoning options are not supported",
    "thinking_token_budget": "reasoning options are not supported",
    "parallel_tool_calls": TOOLS,
    "tools": TOOLS,
    "tool_choice": TOOLS,
    "functions": "functions (OpenAI's deprecated tools) are not supported",
    "function_call": "function_call (OpenAI's deprecated tool_choice) is not supported",
    "audio": "audio output is not supported",
    "modalities": "output modalities other than text are not supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "store": "stored completions are not supported",
    "metadata": "metadata is only kept with stored completions, which are not supported",
    "service_tier": "service tiers are not supported",
    "verbosity": "verbosity is not supported",
    "prompt_cache_key": "prompt_cache_key is not supported (prefix caching is automatic)",
    "safety_identifier": "safety_identifier is not supported",
}

# field -> the value that asks for nothing, accepted
NEUTRAL_VALUES: dict[str, Any] = {
    "use_beam_search": False,
    "length_penalty": 1.0,
    "truncate_prompt_tokens": None,
    "spaces_between_special_tokens": True,
    "return_tokens_as_token_ids": False,
    "priority": 0,
    "continue_final_message": False,
    "echo": False,
    "include_reasoning": True,
    "store": False,
    "modalities": ["text"],
}


def refuse_unsupported(data: dict, declared: Iterable[str], route: str) -> dict:
    """The body less the fields accepted at their neutral value (or null); a 400 naming the
    first field of the body that `route` does not implement: one vLLM or OpenAI defines
    ("... is not supported"), or one that is nobody's field (with the route's fields, so a
    misspelling is easy to find)."""
    declared = set(declared)
    kept = {}
    for name, value in data.items():
        if name in declared:
            kept[name] = value
        elif name in UNSUPPORTED:
            if value is None or (name in NEUTRAL_VALUES and value == NEUTRAL_VALUES[name]):
                continue
            raise APIError(400, f"{name}: {UNSUPPORTED[name]}", name, "unsupported_field")
        else:
            fields = ", ".join(sorted(declared))
            message = f"{name}: unknown field of {route}; its fields are {fields}"
            raise APIError(400, message, str(name), "unknown_field")
    return kept


class StrictRequest(BaseModel):
    """A route's body: a field it does not declare is refused by name before any is validated
    (the 400 says "not supported yet" or lists the fields, not pydantic's "extra inputs are
    not permitted"; extra="forbid" tells /openapi.json the same)."""

    model_config = ConfigDict(extra="forbid")
    route: ClassVar[str]  # for the message: "/v1/completions"

    @model_validator(mode="before")
    @classmethod
    def _refuse_undeclared(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return refuse_unsupported(data, cls.model_fields, cls.route)
        return data
