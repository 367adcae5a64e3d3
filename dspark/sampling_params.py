"""Per-request sampling parameters, with vLLM's field names and defaults."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

# A seed is folded to 64 bits before hashing; larger values are a user error, not silently wrapped.
MAX_SEED = 2**63 - 1
# What step() reports for a request, as vLLM's RequestOutputKind: "cumulative" (a RequestOutput
# every step, the text so far), "final_only" (once, when it finishes: no per-step outputs or
# detokenization) or "delta" (a DeltaOutput per step it changed in: only the new text and
# tokens, the finish reason and usage on the last; dspark/outputs.py). "delta_tokens" is
# "delta" without text: the engine never decodes, the caller does (the server decodes its
# streams, off the engine's step loop); it needs no stop strings, which only decoding finds.
OUTPUT_KINDS = ("cumulative", "final_only", "delta", "delta_tokens")
# StructuredOutputsParams' constraint fields, vLLM's names (exactly one is set)
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on a request's output, vLLM's `StructuredOutputsParams` (exactly one set):

      json         a JSON schema (a dict, or its JSON text): the output is JSON valid under it
      regex        the output matches this regular expression (Rust `regex` syntax) in full
      choice       the output is one of these strings
      grammar      a context-free grammar in Lark syntax (llguidance's, which also reads GBNF)
      json_object  True: the output is a JSON object (OpenAI's response_format json_object)

    The engine masks the target's distribution by the grammar at every sampled and verified
    position and ends the request ("stop") once the grammar admits nothing more
    (dspark/structured/, docs/SPECULATION.md 4.9). The shapes are checked here; whether a
    schema, regex or grammar compiles is checked when the request is added, or earlier by
    `dspark.structured.validate`.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.choice, tuple):  # (frozen: a tuple is what it keeps)
            object.__setattr__(self, "choice", list(self.choice))
        given = [name for name in STRUCTURED_OUTPUT_KINDS if _is_set(getattr(self, name))]
        _check(
            len(given) == 1,
            f"structured_outputs sets {', '.join(given) if given else 'none'} of "
            f"{', '.join(STRUCTURED_OUTPUT_KINDS)}: exactly one must be set",
        )
        kind = given[0]
        value = getattr(self, kind)
        if kind == "json":
            _check(
                isinstance(value, (dict, str)),
                f"structured_outputs.json must be a JSON schema (a dict or its JSON text), "
                f"got {type(value).__name__}",
            )
            if isinstance(value, str):
                try:
                    json.loads(value)
                except ValueError as e:
                    raise ValueError(f"structured_outputs.json is not JSON text: {e}") from None
        elif kind in ("regex", "grammar"):
            _check(
                isinstance(value, str) and value != "",
                f"structured_outputs.{kind} must be a non-empty string, got {value!r}",
            )
        elif kind == "choice":
            _check(
                isinstance(value, list) and bool(value)
                and all(isinstance(c, str) and c for c in value),
                f"structured_outputs.choice must be a non-empty list of non-empty strings, "
                f"got {value!r}",
            )  # fmt: skip
        else:
            _check(
                value is True,
                f"structured_outputs.json_object must be True or False, got {value!r}",
            )

    @property
    def kind(self) -> str:
        """The field that is set: one of STRUCTURED_OUTPUT_KINDS."""
        return next(name for name in STRUCTURED_OUTPUT_KINDS if _is_set(getattr(self, name)))

    @property
    def key(self) -> tuple[str, str]:
        """(kind, canonical text): equal for equal constraints (a schema dict and its JSON
        text alike), the key compiled grammars are cached by."""
        kind, value = self.kind, getattr(self, self.kind)
        if kind == "json":
            schema = json.loads(value) if isinstance(value, str) else value
            return kind, json.dumps(schema, sort_keys=True, separators=(",", ":"))
        if kind == "choice":
            return kind, json.dumps(value)
        return kind, "" if kind == "json_object" else value


@dataclass
class SamplingParams:
    """How one request samples.

    temperature 0 means greedy. top_k -1 (or 0) disables top-k; top_p 1.0 disables top-p.
    max_tokens None means "until the context is full". logprobs n returns, for every emitted
    token, its log-probability and the n most likely tokens (under the model's raw distribution,
    as vLLM does by default).

    Logits shaping, as vLLM defines it (dspark/sample/logits_shaping.py), in this order before
    temperature: bad_words and logit_bias, then repetition_penalty (over prompt and output
    tokens: a positive logit divided by it, a negative one multiplied), frequency_penalty
    (minus penalty x the token's count among the outputs) and presence_penalty (minus penalty
    once the token is among the outputs); min_p after temperature (tokens whose probability is
    below min_p x the most likely token's are dropped), then top-k and top-p. logit_bias maps
    token id -> bias in [-100, 100] (OpenAI's range). bad_words are strings, each tokenised
    alone and with a leading space (`bad_words_token_ids`): the last token of a word is banned
    wherever the outputs end in the tokens before it. prompt_logprobs n returns, for every
    prompt token after the first, its log-probability and the n most likely tokens there.

    structured_outputs (StructuredOutputsParams) constrains the output to a JSON schema, a
    regex, a choice of strings or a grammar: the tokens the grammar does not allow next are
    masked (-inf) on the raw logits, before all the shaping above, so that penalties, min_p,
    top-k and top-p only ever choose among allowed tokens (dspark/structured/).

    n > 1 (offline only, `LLM.generate`) runs n requests of the prompt; sample i takes seed
    seed + i when a seed is given, as vLLM derives its children's seeds (each without one draws
    its own). They share the prompt's full KV pages only through prefix caching
    (engine/prefix_cache.py), as any requests with a common prefix do: a sample admitted after
    another's prompt pages are computed starts on them, samples admitted in the same step
    prefill the prompt each.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    bad_words: list[str] | None = None
    skip_special_tokens: bool = True
    # Per-request opt-out of speculation (verify length 0 every step).
    use_speculation: bool = True
    # a constraint on the output (JSON schema, regex, choice, grammar, any JSON object)
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: str = "cumulative"
    _stop_strings: tuple[str, ...] = field(default=(), init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self._stop_strings = (self.stop,)
        elif self.stop is None:
            self._stop_strings = ()
        else:
            self._stop_strings = tuple(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None:  # (JSON object keys arrive as strings: "50256")
            self.logit_bias = {_token_id(k): v for k, v in self.logit_bias.items()}
        self.bad_words = list(self.bad_words or [])
        self._validate()

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return self._stop_strings

    def with_eos_ids(self, eos_ids: tuple[int, ...]) -> SamplingParams:
        """These params with a checkpoint's further EOS ids (generation_config.json's: Qwen3
        ends a chat turn on <|im_end|>, plain text on <|endoftext|>) among the stop token ids,
        as vLLM adds them; unchanged with ignore_eos or none missing."""
        missing = [t for t in eos_ids if t not in self.stop_token_ids]
        if self.ignore_eos or not missing:
            return self
        return replace(self, stop_token_ids=self.stop_token_ids + missing)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Does any penalty read the request's tokens?"""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)  # fmt: skip

    @property
    def reads_outputs(self) -> bool:
        """Does the shaping read the request's output tokens (so they must be on the host)?
        Penalties and bad words do, and a grammar: its mask is the state its matcher reached
        over them."""
        return self.has_penalties or bool(self.bad_words) or self.structured_outputs is not None

    @property
    def shapes_logits(self) -> bool:
        """Does the request shape its logits beyond temperature, top-k and top-p?"""
        return self.shapes_raw_logits or self.min_p > 0.0

    @property
    def shapes_raw_logits(self) -> bool:
        """Does the request shape its logits before temperature (penalties, logit_bias, bad
        words: a row of sample/logits_shaping.py's tensors)?"""
        return self.has_penalties or bool(self.logit_bias or self.bad_words)

    def bad_words_token_ids(self, encode: Callable[[str], list[int]]) -> list[list[int]]:
        """The token sequences bad_words bans, as vLLM tokenises them: each word (leading
        spaces stripped) alone, and with one leading space when that gives another first token
        and as many tokens (the word in mid-text). `encode` adds no special tokens.

          "hello" -> encode("hello") = [15339], encode(" hello") = [24748]: both banned
          "a b"   -> [64, 293], [264, 293]: "b" is banned after "a" or " a"
        """
        banned: list[list[int]] = []
        for word in self.bad_words:
            alone = encode(word.lstrip())
            spaced = encode(" " + word.lstrip())
            _check(bool(alone), f"bad word {word!r} encodes to no tokens")
            banned.append(alone)
            if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
                banned.append(spaced)
        return banned

    def _validate(self) -> None:
        _check(isinstance(self.n, int) and self.n >= 1, f"n must be at least 1, got {self.n!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(
                _is_number(value) and -2.0 <= value <= 2.0,
                f"{name} must be in [-2, 2], got {value!r}",
            )
        _check(
            _is_number(self.repetition_penalty) and self.repetition_penalty > 0.0,
            f"repetition_penalty must be greater than 0, got {self.repetition_penalty!r}",
        )
        _check(
            _is_number(self.min_p) and 0.0 <= self.min_p <= 1.0,
            f"min_p must be in [0, 1], got {self.min_p!r}",
        )
        for token, bias in (self.logit_bias or {}).items():
            _check(
                _is_number(bias) and -100.0 <= bias <= 100.0,
                f"logit_bias of token {token} must be in [-100, 100], got {bias!r}",
            )
        for word in self.bad_words:
            _check(
                isinstance(word, str) and word.strip() != "",
                f"bad_words must be non-empty strings, got {word!r}",
            )
        _check(
            isinstance(self.temperature, (int, float)) and self.temperature >= 0.0,
            f"temperature must be >= 0, got {self.temperature!r}",
        )
        _check(
            isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0,
            f"top_p must be in (0, 1], got {self.top_p!r}",
        )
        _check(
            isinstance(self.top_k, int) and self.top_k >= -1,
            f"top_k must be -1 (disabled), 0 (disabled) or a positive integer, got {self.top_k!r}",
        )
        if self.max_tokens is not None:
            _check(
                isinstance(self.max_tokens, int) and self.max_tokens >= 1,
                f"max_tokens must be at least 1, got {self.max_tokens!r}",
            )
        _check(
            isinstance(self.min_tokens, int) and self.min_tokens >= 0,
            f"min_tokens must be >= 0, got {self.min_tokens!r}",
        )
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens,
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
            )
        if self.seed is not None:
            _check(
                isinstance(self.seed, int) and 0 <= self.seed <= MAX_SEED,
                f"seed must be an integer in [0, 2**63 - 1], got {self.seed!r}",
            )
        if self.logprobs is not None:
            _check(
                isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20,
                f"logprobs must be an integer in [0, 20], got {self.logprobs!r}",
            )
        if self.prompt_logprobs is not None:
            _check(
                isinstance(self.prompt_logprobs, int) and 0 <= self.prompt_logprobs <= 20,
                f"prompt_logprobs must be an integer in [0, 20], got {self.prompt_logprobs!r}",
            )
        _check(
            self.output_kind in OUTPUT_KINDS,
            f"output_kind must be one of {OUTPUT_KINDS}, got {self.output_kind!r}",
        )
        for s in self._stop_strings:
            _check(isinstance(s, str) and s != "", f"stop strings must be non-empty, got {s!r}")
        _check(
            not (self.output_kind == "delta_tokens" and self._stop_strings),
            f"output_kind 'delta_tokens' reports no text, so it cannot watch stop strings "
            f"(got stop {list(self._stop_strings)}): use 'delta'",
        )
        for t in self.stop_token_ids:
            _check(isinstance(t, int) and t >= 0, f"stop_token_ids must be >= 0, got {t!r}")
        _check(
            self.structured_outputs is None
            or isinstance(self.structured_outputs, StructuredOutputsParams),
            f"structured_outputs must be a StructuredOutputsParams, got "
            f"{type(self.structured_outputs).__name__}",
        )


def _is_set(value: object) -> bool:
    """Is a StructuredOutputsParams field set? None and False are not (an empty string or
    list is, and is refused by its own check; an empty schema {} admits any JSON value)."""
    return value is not None and value is not False


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _token_id(key: object) -> int:
    """A logit_bias key as a token id: an int, or a string of one (JSON object keys)."""
    digits = key.strip().removeprefix("-") if isinstance(key, str) else ""
    if digits.isascii() and digits.isdigit():
        return int(key)
    _check(
        isinstance(key, int) and not isinstance(key, bool),
        f"logit_bias key {key!r} is not a token id",
    )
    return key  # type: ignore[return-value]


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
