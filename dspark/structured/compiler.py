"""Grammars compiled for one engine's tokenizer: once per distinct constraint, then copied.

llguidance compiles a grammar against a tokenizer into a matcher (about 1 ms for a small JSON
schema on the development CPU, far more for a large one); a copy of a fresh matcher costs about a
microsecond. So the compiler keeps one fresh matcher per constraint (StructuredOutputsParams.key:
a schema dict and its JSON text are one key) and each request gets a copy. The most recently used
`max_cached` are kept; one evicted is compiled again when it returns (both counted in `stats`).

The llguidance tokenizer is built from the engine's on the first structured request (a fraction
of a second), so an engine that never sees one never pays for it. Its vocabulary is the target's
(the logits' width: token ids the tokenizer lacks are never allowed) and its EOS ids are all the
checkpoint's: a complete grammar may end on any of them.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict

import llguidance

from dspark.models.tokenizer import Tokenizer
from dspark.sampling_params import StructuredOutputsParams
from dspark.structured.grammar import validate
from dspark.structured.matcher import GrammarMatcher

logger = logging.getLogger(__name__)


class GrammarCompiler:
    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,  # the target's logits width
        eos_token_ids: list[int],  # every id that ends a sequence (the first is the main one)
        max_cached: int = 256,
    ) -> None:
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, eos_token_ids
        self.max_cached = max_cached
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self.stats: Counter[str] = Counter()  # grammars compiled, cache hits, evictions

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        if self._ll_tokenizer is None:
            self._ll_tokenizer = llguidance.LLTokenizer(
                self.tokenizer.backend_json(), n_vocab=self.vocab_size,
                eos_token=list(self.eos_token_ids) or None,  # (None: the tokenizer's)
            )  # fmt: skip
        return self._ll_tokenizer

    def compile(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        """The fresh matcher of `spec`, compiled now or found in the cache; ValueError naming
        the field when the schema, regex or grammar is invalid."""
        key = spec.key
        fresh = self._compiled.get(key)
        if fresh is not None:
            self._compiled.move_to_end(key)
            self.stats["grammar_cache_hits"] += 1
            return fresh
        grammar = validate(spec)
        fresh = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if fresh.is_error():  # (what validate cannot see without the tokenizer)
            raise ValueError(f"structured_outputs.{spec.kind} is invalid: {fresh.get_error()}")
        self.stats["grammars_compiled"] += 1
        self._compiled[key] = fresh
        if len(self._compiled) > self.max_cached:
            self._compiled.popitem(last=False)
            self.stats["grammar_cache_evictions"] += 1
        return fresh

    def matcher(self, spec: StructuredOutputsParams) -> GrammarMatcher:
        """A request's own matcher for `spec`, at the grammar's start."""
        return GrammarMatcher(self.compile(spec).deep_copy())
