"""Incremental detokenization and stop strings.

Decoding token by token is wrong for byte-level BPE (a character can span tokens) and decoding
the whole output each step is quadratic. `tokenizers.decoders.DecodeStream` does it
incrementally in Rust: it returns the text a new token completes, or None while a character is
still incomplete. Text still held back when a request ends is recovered by one full decode.

Stop strings: output text is cut before the first stop string (kept if
include_stop_str_in_output). Only the tail that could hold a new match is searched. Tokens are
fed one at a time so that, when a step emits several tokens (speculation), the engine learns
exactly which token completed the stop string and drops the ones after it.

Without stop strings nothing needs the text before it is read, so tokens are only collected
and `text` decodes what arrived since the last read in one DecodeStream call. A stream reports
every few tokens (stream_interval), and one call per report costs less than one per token.
A batch that ends inside a character decodes to nothing until a later token completes it:

    tokens of "日本" = [a, b, c, d] ("日" = a b, "本" = c d); read after [a, b, c] -> "" (the
    whole batch waits), after [d] -> "日本"

Per token the stream would have given "", "日", "", "本": the same text, sometimes later.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers.decoders import DecodeStream

from dspark.models.tokenizer import Tokenizer


@dataclass(frozen=True)
class StopHit:
    stop: str
    num_tokens: int  # tokens of the ones just added that belong to the output (the hit included)


class Detokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = True,
        stop_strings: tuple[str, ...] = (),
        include_stop_str_in_output: bool = False,
        incremental: bool = True,  # False: decode once at flush (no stop strings to watch)
    ) -> None:
        assert incremental or not stop_strings, "stop strings need incremental decoding"
        self._incremental = incremental
        self._tokenizer = tokenizer
        self._backend = tokenizer.backend  # the Rust tokenizer DecodeStream steps through
        self._skip_special = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._stops = stop_strings
        self._include_stop = include_stop_str_in_output
        self._tokens: list[int] = []
        self._is_pending = False  # the stream holds bytes of an incomplete character
        self._num_unread = 0  # tokens collected but not yet decoded (no stop strings)
        self._text = ""

    @property
    def text(self) -> str:
        """The output text so far (without stop strings: decoded now, what arrived since the
        last read in one call)."""
        if self._num_unread:  # (one token is passed as an int: a list costs more to convert)
            n, tokens = self._num_unread, self._tokens
            chunk = self._stream.step(self._backend, tokens[-1] if n == 1 else tokens[-n:])
            self._num_unread = 0
            self._is_pending = chunk is None
            if chunk:
                self._text += chunk
        return self._text

    def add_tokens(self, new_tokens: list[int]) -> StopHit | None:
        """Append output tokens; on a stop string the text is final and the hit says where."""
        if not self._incremental:
            self._tokens.extend(new_tokens)
            self._is_pending = True
            return None
        if not self._stops:  # decoded when read
            self._tokens.extend(new_tokens)
            self._num_unread += len(new_tokens)
            return None
        for i, token in enumerate(new_tokens):
            self._tokens.append(token)
            chunk = self._stream.step(self._backend, token)
            self._is_pending = chunk is None
            if not chunk:
                continue
            old_len = len(self._text)
            self._text += chunk
            stop = self._check_stop(old_len)
            if stop is not None:
                return StopHit(stop, i + 1)
        return None

    def flush(self) -> None:
        """At the end of a request, emit text still held back for an incomplete character."""
        text = self.text
        if self._is_pending:
            full = self._tokenizer.decode(self._tokens, self._skip_special)
            self._text = text + full[len(text) :]
            self._is_pending = False

    def _check_stop(self, old_len: int) -> str | None:
        hits = []
        for stop in self._stops:
            # a match must end in the new text, so it starts at most len(stop)-1 before it
            idx = self._text.find(stop, max(old_len - len(stop) + 1, 0))
            if idx != -1:
                hits.append((idx, stop))
        if not hits:
            return None
        idx, stop = min(hits)  # the earliest match wins
        self._text = self._text[: idx + len(stop) if self._include_stop else idx]
        return stop
