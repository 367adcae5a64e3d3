"""Structured output: a request's output held to a JSON schema, regex, choice or grammar.

The grammar engine is llguidance (docs/SPECULATION.md 4.9 says why). Host side only:
  grammar.py   StructuredOutputsParams -> llguidance grammar text, and `validate` (no tokenizer)
  compiler.py  grammars compiled for the engine's tokenizer, once per distinct constraint
  matcher.py   one request's grammar state, advanced by the tokens it emits
  masks.py     the allowed-token bitmasks a step needs, filled from the matchers
The device half, applying a bitmask to logits, is dspark/sample/token_bitmask.py.

`validate(spec)` is what a front end calls to refuse a bad schema, regex or grammar before the
request reaches the engine (ValueError naming the field and the compiler's message).
"""

from dspark.structured.grammar import validate

__all__ = ["validate"]
