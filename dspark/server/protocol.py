"""The request bodies of the OpenAI API the server accepts, as pydantic models.

Field names are OpenAI's (and vLLM's for the extensions: top_k, min_tokens, ignore_eos,
stop_token_ids, skip_special_tokens, include_stop_str_in_output, return_token_ids,
repetition_penalty, min_p, bad_words, prompt_logprobs, structured_outputs) plus dspark's
use_speculation; structured output's fields are in structured_outputs.py, the tools' in
tool_calls.py. Every bound is declared on the field, so /openapi.json tells a client (or a
fuzzer) what is allowed and a value outside it is a 400 naming the field. A field the route does
not declare is refused with a 400 naming it (unsupported.py: vLLM's fields the engine lacks say
so, guided_json names what replaced it; other names list the route's fields), where vLLM and
OpenAI ignore it: an ignored `guided_json` answers 200 with unconstrained text. Declared
options the server cannot honour as asked (suffix, prompt_logprobs or echo with logprobs while
streaming, ...) are accepted at their neutral value and refused otherwise with a clear message,
never silently dropped; a chat message reaches the template with all its fields.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dspark.sampling_params import MAX_SEED, SamplingParams, StructuredOutputsParams
from dspark.server.errors import bad_request
from dspark.server.structured_outputs import ResponseFormat, StructuredOutputsRequest
from dspark.server.tool_calls import ToolChoice, Tools
from dspark.server.unsupported import StrictRequest

MAX_N = 8  # choices per request
MAX_PROMPTS = 16  # prompts in one completions request
MAX_STOP = 16  # stop strings, and stop token ids
MAX_LOGPROBS = 20  # the engine's limit on top alternatives per token
MAX_LOGIT_BIAS = 300  # token biases per request (OpenAI's limit)
MAX_MESSAGES = 1024
MAX_INT32 = 2**31 - 1  # counts past this are never meant (the engine's lengths are far smaller)

TokenIds = Annotated[list[Annotated[int, Field(ge=0, le=MAX_INT32)]], Field(min_length=1)]
NonEmptyText = Annotated[str, Field(min_length=1)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")  # (vLLM's continuous_usage_stats: not supported)

    include_usage: bool = False


class _Request(StrictRequest):
    """Sampling fields shared by both routes."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str | None = None  # None: the served model
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, le=MAX_INT32)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    min_tokens: int = Field(0, ge=0, le=MAX_INT32)
    stop: NonEmptyText | Annotated[list[NonEmptyText], Field(max_length=MAX_STOP)] | None = None
    stop_token_ids: (
        Annotated[list[Annotated[int, Field(ge=0, le=MAX_INT32)]], Field(max_length=MAX_STOP)]
        | None
    ) = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    # vLLM's extensions that clients send (declared, so that a value is refused, not dropped)
    repetition_penalty: float = Field(1.0, gt=0.0, le=100.0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    # token id (a JSON key: a string) -> bias, OpenAI's range
    logit_bias: (
        Annotated[dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]],
                  Field(max_length=MAX_LOGIT_BIAS)]
        | None
    ) = None  # fmt: skip
    bad_words: Annotated[list[NonEmptyText], Field(max_length=MAX_STOP)] | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # structured output (structured_outputs.py): OpenAI's field, vLLM's
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    user: str | None = None
    # dspark: per-request opt-out of speculation; vLLM: the token ids beside the text
    use_speculation: bool = True
    return_token_ids: bool = False

    def check_supported(self) -> None:
        """Refuse options the engine does not implement (400 naming the field)."""
        if self.prompt_logprobs is not None and self.stream:
            raise bad_request(
                "prompt_logprobs is not supported with stream: true (the engine reports a "
                "prompt's logprobs with its whole output); ask without streaming",
                "prompt_logprobs",
            )
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed with stream: true", "stream_options")

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """The alternatives per prompt position the engine computes (None: no prompt logprobs)."""
        return self.prompt_logprobs

    def sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        index: int,
        structured_outputs: StructuredOutputsParams | None = None,
    ):
        """The SamplingParams of choice `index` (0..n-1): a seeded request's choices get seeds
        seed, seed + 1, ... so they differ but stay reproducible."""
        seed = None if self.seed is None else (self.seed + index) % (MAX_SEED + 1)
        try:
            return SamplingParams(
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                min_p=self.min_p,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                repetition_penalty=self.repetition_penalty,
                logit_bias=self.logit_bias,
                bad_words=self.bad_words,
                seed=seed,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                stop=self.stop,
                stop_token_ids=self.stop_token_ids,
                ignore_eos=self.ignore_eos,
                include_stop_str_in_output=self.include_stop_str_in_output,
                logprobs=logprobs,
                prompt_logprobs=self.engine_prompt_logprobs,
                skip_special_tokens=self.skip_special_tokens,
                use_speculation=self.use_speculation,
                structured_outputs=structured_outputs,
                output_kind="delta" if self.stream else "final_only",
            )
        except ValueError as e:
            raise bad_request(str(e), _field_named(str(e))) from None


class CompletionRequest(_Request):
    """POST /v1/completions."""

    route: ClassVar[str] = "/v1/completions"

    prompt: (
        NonEmptyText
        | TokenIds
        | Annotated[list[NonEmptyText], Field(min_length=1, max_length=MAX_PROMPTS)]
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]
    )
    max_tokens: int | None = Field(16, ge=1, le=MAX_INT32)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo and self.logprobs is not None and self.stream:
            raise bad_request(
                "echo with logprobs is not supported with stream: true (the echoed prompt's "
                "logprobs come with the whole output); ask without streaming, or without echo",
                "echo",
            )
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request(f"best_of must equal n ({self.n}) or be omitted", "best_of")

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """echo with logprobs needs the prompt's logprobs too, as many alternatives as the
        output's (vLLM's rule)."""
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (text or token ids)."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """One message, handed to the chat template with every field it carries: an assistant's
    earlier `tool_calls` and a tool result's `tool_call_id` are what a tool-calling template
    renders, so they are passed on, never dropped."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], Field(max_length=MAX_MESSAGES)] | None = None
    name: str | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_MESSAGES)] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _check_tool_fields(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls is only allowed on assistant messages, not {self.role}")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a tool message needs its tool_call_id, and only a tool message")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def for_template(self) -> dict:
        """The message as the chat template reads it (HF's message dicts)."""
        message: dict = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls is not None:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatCompletionRequest(_Request):
    """POST /v1/chat/completions."""

    route: ClassVar[str] = "/v1/chat/completions"

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT32)  # None: until the context is full
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: Tools | None = None
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, else "none"
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # the template's variables, as vLLM's

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def conversation(self) -> list[dict]:
        return [m.for_template() for m in self.messages]

    def template_kwargs(self, with_tools: bool = True) -> dict[str, Any]:
        """The chat template's variables: chat_template_kwargs, and the tools (HF's `tools`)."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.tools and with_tools:
            kwargs["tools"] = [tool.model_dump(exclude_none=True) for tool in self.tools]
        return kwargs


def _field_named(message: str) -> str | None:
    """The request field a SamplingParams error names first ("logit_bias of token 3 must be
    ..." -> "logit_bias"), for the error's param."""
    name = message.split(" ", 1)[0]
    return name if name in _Request.model_fields else None
