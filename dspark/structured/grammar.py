"""A StructuredOutputsParams as llguidance grammar text, and its validation.

  json={"type": "integer"}   -> the JSON schema's grammar (llguidance's JSON compiler)
  json_object=True           -> the schema {"type": "object"}: any JSON object
  regex="[0-9]+"             -> the regex's grammar (Rust `regex` syntax, matched in full)
  choice=["yes", "no"]       -> the Lark grammar  start: "yes" | "no"
  grammar="start: ..."       -> Lark (llguidance's dialect), or GBNF converted to Lark

JSON whitespace is flexible (llguidance's default, as vLLM's `disable_any_whitespace` off):
between tokens the model may put spaces and newlines, as a JSON writer would. Schema keywords
that constrain values but that llguidance does not implement ("uniqueItems", "contains") are
refused, never ignored (its strict mode): a schema the grammar cannot enforce is an error, not a
looser constraint. (Keywords that constrain nothing, "title" or a vendor's "x-...", pass.)
"""

from __future__ import annotations

import json

import llguidance

from dspark.sampling_params import StructuredOutputsParams


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar of `spec`; ValueError for JSON text that does not parse or GBNF
    that does not convert (other errors show when it is compiled: `validate`)."""
    kind = spec.kind
    if kind == "json":
        schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
        return llguidance.LLMatcher.grammar_from_json_schema(schema)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}')
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        return llguidance.grammar_from("choice", spec.choice)
    return llguidance.grammar_from("grammar", spec.grammar)


def validate(spec: StructuredOutputsParams) -> str:
    """The grammar text of `spec` once llguidance has compiled it (without a tokenizer), else
    ValueError naming the field and what is wrong:

      StructuredOutputsParams(regex="[0-9+")  -> ValueError: structured_outputs.regex is
          invalid: ... unclosed character class
    """
    if not isinstance(spec, StructuredOutputsParams):
        raise ValueError(
            f"structured_outputs must be a StructuredOutputsParams, got {type(spec).__name__}"
        )
    try:
        grammar = grammar_text(spec)
    except ValueError as e:
        raise ValueError(f"structured_outputs.{spec.kind} is invalid: {e}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"structured_outputs.{spec.kind} is invalid: {error.strip()}")
    return grammar
