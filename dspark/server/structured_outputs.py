"""Structured output over HTTP: OpenAI's `response_format` and vLLM's `structured_outputs` body
field, mapped onto the engine's StructuredOutputsParams (dspark/structured/ enforces it).

    response_format {"type": "text"}                           -> no constraint
    response_format {"type": "json_object"}                    -> json_object=True
    response_format {"type": "json_schema",
                     "json_schema": {"name": "x", "schema": S}} -> json=S  ("strict" either way:
                                                                   the grammar enforces S)
    structured_outputs {"json": S} | {"regex": R} | {"choice": [..]} | {"grammar": G}
                       | {"json_object": true}                 -> the same field (exactly one)

Both routes take both fields (vLLM's do); a request sends at most one of them. A schema, regex
or grammar that does not compile is a 400 naming the field that carried it
(`response_format.json_schema.schema`, `structured_outputs.regex`, ...), found here with the
engine's own compiler before the request reaches the engine.

vLLM's older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (removed from vLLM
in favour of `structured_outputs`) are refused with the field that replaces them
(unsupported.py), so there is one spelling with one meaning.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dspark.sampling_params import StructuredOutputsParams
from dspark.server.errors import bad_request

MAX_CHOICES = 1024  # strings of a `choice`


class JsonSchemaFormat(BaseModel):
    """response_format.json_schema: OpenAI's fields ("schema" under its JSON name)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # the schema is enforced by the grammar whatever it says


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError(
                f"json_schema goes with type 'json_schema' and only with it (type is "
                f"{self.type!r}, json_schema {'given' if self.json_schema else 'missing'})"
            )
        return self


# vLLM's StructuredOutputsParams options beyond the constraint: accepted at the value that asks
# for nothing, refused otherwise (never ignored)
_OPTIONS_NOT_SUPPORTED = {
    "disable_fallback": False,
    "disable_any_whitespace": False,
    "disable_additional_properties": False,
    "whitespace_pattern": None,
    "structural_tag": None,
}


class StructuredOutputsRequest(BaseModel):
    """The `structured_outputs` body field: vLLM's StructuredOutputsParams, exactly one set."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = Field(None, min_length=1)
    choice: list[str] | None = Field(None, min_length=1, max_length=MAX_CHOICES)
    grammar: str | None = Field(None, min_length=1)
    json_object: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_options(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for name, neutral in _OPTIONS_NOT_SUPPORTED.items():
            if name in data and data.pop(name) not in (neutral, None):
                raise ValueError(f"{name} is not supported; omit it")
        return data

    def params(self) -> StructuredOutputsParams:
        try:
            return StructuredOutputsParams(
                json=self.json_, regex=self.regex, choice=self.choice, grammar=self.grammar,
                json_object=bool(self.json_object),
            )  # fmt: skip
        except ValueError as e:
            raise bad_request(str(e), "structured_outputs") from None


def requested_constraint(
    response_format: ResponseFormat | None, structured_outputs: StructuredOutputsRequest | None
) -> tuple[StructuredOutputsParams, str] | None:
    """The constraint a request's response_format or structured_outputs asks for, with the field
    that carried it (for errors), checked to compile; None for none."""
    asks_format = response_format is not None and response_format.type != "text"
    if asks_format and structured_outputs is not None:
        raise bad_request(
            f"response_format {response_format.type!r} and structured_outputs both constrain "
            "the output; send one of them",
            "structured_outputs",
        )
    if structured_outputs is not None:
        params = structured_outputs.params()
        return checked(params, f"structured_outputs.{params.kind}"), "structured_outputs"
    if not asks_format:
        return None
    if response_format.type == "json_object":
        return StructuredOutputsParams(json_object=True), "response_format"
    params = StructuredOutputsParams(json=response_format.json_schema.schema_)
    return checked(params, "response_format.json_schema.schema"), "response_format"


def checked(params: StructuredOutputsParams, param: str) -> StructuredOutputsParams:
    """`params` once the engine's compiler accepts it; else a 400 naming `param`."""
    from dspark.structured import validate

    try:
        validate(params)
    except ValueError as e:
        reason = str(e).split(" is invalid: ", 1)[-1]
        raise bad_request(f"{param} is invalid: {reason}", param) from None
    return params
