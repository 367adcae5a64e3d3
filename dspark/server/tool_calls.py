"""Tool calling on /v1/chat/completions: `tools`, `tool_choice` and `parallel_tool_calls`, as
OpenAI defines them and vLLM serves them.

The tools are rendered into the prompt by the model's chat template (HF's `tools` variable).
What the model may answer, and how its text becomes `message.tool_calls`, follows `tool_choice`:

    "none"                 the model answers in text; nothing is parsed
    "auto" (the default    the model is free; Hermes-style calls in its text
     with tools)           (`<tool_call>{"name": .., "arguments": {..}}</tool_call>`, hermes.py)
                           become tool_calls, the rest stays content. Needs a chat template
                           that renders tools: without one the model never sees them (400)
    "required"             the output is held by a grammar to a JSON array of one or more calls
                           of the listed functions, [{"name": .., "parameters": {..}}, ..]
                           (vLLM's schema); each becomes a tool call
    {"type": "function",   the output is held to that function's `parameters` schema: the
     "function": {"name"}} arguments of one call of it

A response with calls has `content` null (or, under "auto", the text outside the calls), and
`finish_reason` "tool_calls" when the model stopped by itself (a call cut by max_tokens keeps
"length", and its text stays content: only whole calls are given). `parallel_tool_calls: false`
allows at most one call: "required" asks the grammar for one, "auto" keeps the first (as vLLM).
Each call gets an id `call_<24 hex>`. A stream sends content as it becomes certain and the calls
in its last chunk, in OpenAI's delta format (index, id, type, the whole name and arguments).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from dspark.sampling_params import StructuredOutputsParams
from dspark.server import hermes
from dspark.server.errors import bad_request
from dspark.server.structured_outputs import checked

MAX_TOOLS = 128  # OpenAI's limit
EMPTY_PARAMETERS = {"type": "object", "properties": {}}  # a function that takes no parameters


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no parameters
    strict: bool | None = None  # (a constrained call follows its schema whatever it says)


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
Tools = Annotated[list[Tool], Field(min_length=1, max_length=MAX_TOOLS)]


def new_call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}  # fmt: skip


@dataclass
class ToolCalling:
    """How a request's output becomes tool calls ("auto", "required" or "named")."""

    mode: Literal["auto", "required", "named"]
    tools: list[Tool]
    parallel: bool = True
    name: str | None = None  # the named function's

    def constraint(self) -> StructuredOutputsParams | None:
        """The grammar "required" and a named function hold the output to (None for "auto"),
        checked to compile; a function's bad schema is a 400 naming it."""
        if self.mode == "auto":
            return None
        schemas = {}
        for i, tool in enumerate(self.tools):
            if self.mode == "required" or tool.function.name == self.name:
                schema = tool.function.parameters or EMPTY_PARAMETERS
                checked(StructuredOutputsParams(json=schema), f"tools.{i}.function.parameters")
                schemas[tool.function.name] = schema
        if self.mode == "named":
            return StructuredOutputsParams(json=schemas[self.name])
        return checked(StructuredOutputsParams(json=self._calls_schema(schemas)), "tools")

    def _calls_schema(self, schemas: dict[str, dict]) -> dict:
        """vLLM's schema for "required": an array of {"name", "parameters"} objects, one
        alternative per function; each schema's "$defs" moved to the root, where its
        "#/$defs/..." references point."""
        defs: dict[str, Any] = {}
        alternatives = []
        for name, schema in schemas.items():
            schema = dict(schema)
            for key, value in schema.pop("$defs", {}).items():
                if defs.setdefault(key, value) != value:
                    raise bad_request(
                        f"tools: two functions' parameters define $defs {key!r} differently; "
                        "with tool_choice 'required' their definitions share one namespace",
                        "tools",
                    )
            alternatives.append({
                "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
                "required": ["name", "parameters"],
            })  # fmt: skip
        calls = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": alternatives}}
        if not self.parallel:
            calls["maxItems"] = 1
        if defs:
            calls["$defs"] = defs
        return calls

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool calls) of a whole output; no calls: the text is content."""
        if self.mode == "named":
            return (None, [new_call(self.name, text.strip())]) if _is_json(text) else (text, [])
        if self.mode == "required":
            calls = _required_calls(text)
            return (None, calls) if calls else (text, [])
        parsed = hermes.parse(text)
        if parsed is None:
            return text, []
        content, calls = parsed
        if not self.parallel:
            calls = calls[:1]
        return content.rstrip() or None, [new_call(c.name, c.arguments) for c in calls]

    def finish_reason(self, reason: str | None, calls: list[dict]) -> str | None:
        return "tool_calls" if calls and reason == "stop" else reason

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)


@dataclass
class ToolCallStream:
    """One streamed choice: content released as it becomes certain ("auto"; a constrained
    output is all call), the calls at the end."""

    calling: ToolCalling
    text: list[str] = field(default_factory=list)
    content: hermes.ContentStream | None = None

    def __post_init__(self) -> None:
        if self.calling.mode == "auto":
            self.content = hermes.ContentStream()

    def feed(self, new: str) -> str:
        """The content to send now."""
        self.text.append(new)
        return self.content.feed(new) if self.content is not None else ""

    def finish(self) -> tuple[str, list[dict]]:
        """The content not sent yet and the calls, once the output has ended."""
        content, calls = self.calling.parse("".join(self.text))
        sent = self.content.num_sent if self.content is not None else 0
        return (content or "")[sent:], calls


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _required_calls(text: str) -> list[dict]:
    """The calls of a "required" output ([{"name", "parameters"}, ..]); [] if it is not one."""
    try:
        items = json.loads(text)
    except ValueError:
        return []
    if not isinstance(items, list) or not all(
        isinstance(item, dict) and isinstance(item.get("name"), str) for item in items
    ):
        return []
    return [
        new_call(item["name"], json.dumps(item.get("parameters", {}), ensure_ascii=False))
        for item in items
    ]


def tool_calling(
    tools: list[Tool] | None, tool_choice: ToolChoice | None, parallel: bool
) -> ToolCalling | None:
    """The request's ToolCalling, or None when nothing is parsed (no tools, "none"); 400s for
    a tool_choice without tools, duplicate function names, an unknown named function."""
    if not tools:
        if tool_choice is not None and tool_choice != "none":
            raise bad_request(
                "tool_choice is only allowed with tools (or as 'none'); send tools, or omit it",
                "tool_choice",
            )
        return None
    names = [tool.function.name for tool in tools]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise bad_request(f"tools define the function {duplicate!r} twice", "tools")
    if tool_choice == "none":
        return None
    if tool_choice is None or tool_choice == "auto":
        return ToolCalling("auto", tools, parallel)
    if tool_choice == "required":
        return ToolCalling("required", tools, parallel)
    name = tool_choice.function.name
    if name not in names:
        raise bad_request(
            f"tool_choice names the function {name!r}, which is not among tools "
            f"({', '.join(repr(n) for n in names)})",
            "tool_choice",
        )
    return ToolCalling("named", tools, parallel, name)
