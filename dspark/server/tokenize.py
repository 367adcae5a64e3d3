"""POST /tokenize and /detokenize: the served model's tokenizer over HTTP, as vLLM serves them.

    /tokenize    {"prompt": text}                   -> {"tokens", "count", "max_model_len",
                 or {"messages": [...]} (the chat       "token_strs"}
                 template applied first, with
                 "tools" if given)
    /detokenize  {"tokens": [ids]}                  -> {"prompt": text}

They live at the root, not under /v1, because vLLM serves them there (clients written for vLLM
call /tokenize); they sit behind the API key all the same (auth.py), since they run the
server's tokenizer for whoever calls. `add_special_tokens` defaults as vLLM's: true for a
prompt (the BOS a completion's prompt gets), false for messages (the template writes its own).
Detokenizing keeps special tokens, so a round trip gives back the text the model saw.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import Field, model_validator

from dspark.models.tokenizer import Tokenizer
from dspark.server.errors import bad_request
from dspark.server.protocol import MAX_INT32, MAX_MESSAGES, ChatMessage
from dspark.server.tool_calls import Tools
from dspark.server.unsupported import StrictRequest


class TokenizeRequest(StrictRequest):
    """Exactly one of `prompt` (text) and `messages` (a chat, rendered by its template)."""

    route: ClassVar[str] = "/tokenize"

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)] | None = (
        None
    )
    add_generation_prompt: bool = True  # (messages only)
    add_special_tokens: bool | None = None  # None: true for a prompt, false for messages
    chat_template_kwargs: dict[str, Any] | None = None  # (messages only)
    tools: Tools | None = None  # (messages only)
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of prompt (text) and messages (a chat)")
        if self.tools is not None and self.messages is None:
            raise ValueError("tools are rendered by the chat template: send them with messages")
        return self


class DetokenizeRequest(StrictRequest):
    route: ClassVar[str] = "/detokenize"

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=MAX_INT32)]]


def tokenize(body: TokenizeRequest, tokenizer: Tokenizer, max_model_len: int) -> dict:
    if body.prompt is not None:
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        try:
            ids = tokenizer.encode(body.prompt, add_special_tokens=add_special)
        except Exception as e:  # noqa: BLE001 - unencodable text (lone surrogates) is bad input
            raise bad_request(f"prompt could not be tokenized: {e}", "prompt") from None
    else:
        kwargs = dict(body.chat_template_kwargs or {})
        if body.tools:  # (as a chat completion renders them)
            kwargs["tools"] = [tool.model_dump(exclude_none=True) for tool in body.tools]
        try:
            ids = tokenizer.apply_chat_template(
                [m.for_template() for m in body.messages], body.add_generation_prompt,
                kwargs, add_special_tokens=bool(body.add_special_tokens),
            )  # fmt: skip
        except Exception as e:  # noqa: BLE001 - the template's own checks (role order, ...)
            message = f"messages could not be rendered by the chat template: {e}"
            raise bad_request(message, "messages") from None
    token_strs = tokenizer.token_to_text(ids) if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
            "token_strs": token_strs}  # fmt: skip


def detokenize(body: DetokenizeRequest, tokenizer: Tokenizer) -> dict:
    vocab_size = tokenizer.vocab_size
    bad = next((i for i, t in enumerate(body.tokens) if t >= vocab_size), None)
    if bad is not None:
        raise bad_request(
            f"tokens.{bad}: token id {body.tokens[bad]} is outside the vocabulary "
            f"(0..{vocab_size - 1})",
            f"tokens.{bad}",
        )
    return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}
