"""Incremental detokenization and stop strings.

Decoding token by token is wrong for byte-level BPE (a character can span tokens) and decoding
the whole output each step is quadratic. We keep two offsets into the output tokens: text is
decoded from `prefix_offset`, and the part before `read_offset` is already emitted. New text is
what decoding [prefix_offset:] adds beyond decoding [prefix_offset:read_offset]; it is held
back while it ends in an incomplete character (U+FFFD).

Stop strings: output text is cut before the first stop string (kept if
include_stop_str_in_output). Only the tail that could contain a new match is searched.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dspark.models.tokenizer import Tokenizer

INCOMPLETE_CHAR = "\ufffd"
# tokens of left context decoded with the new ones, so merges at the boundary render correctly
CONTEXT_TOKENS = 5


@dataclass
class Detokenizer:
    tokenizer: Tokenizer
    skip_special_tokens: bool = True
    stop_strings: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    _tokens: list[int] = field(default_factory=list)

    def add_tokens(self, new_tokens: list[int]) -> str | None:
        """Append output tokens; returns the stop string hit, if any (text is then final)."""
        self._tokens.extend(new_tokens)
        new_text = self._pending_text()
        if new_text.endswith(INCOMPLETE_CHAR):
            return None
        old_len = len(self.text)
        self._emit(new_text)
        return self._check_stop(old_len)

    def flush(self) -> None:
        """At the end of a request, emit text still held back for an incomplete character."""
        if self.read_offset < len(self._tokens):
            self._emit(self._pending_text())

    def _pending_text(self) -> str:
        decode, skip = self.tokenizer.decode, self.skip_special_tokens
        prefix = decode(self._tokens[self.prefix_offset : self.read_offset], skip)
        full = decode(self._tokens[self.prefix_offset :], skip)
        return full[len(prefix) :]

    def _emit(self, new_text: str) -> None:
        self.text += new_text
        self.read_offset = len(self._tokens)
        self.prefix_offset = max(self.read_offset - CONTEXT_TOKENS, 0)

    def _check_stop(self, old_len: int) -> str | None:
        hits = []
        for stop in self.stop_strings:
            # a match must end in the new text, so it starts at most len(stop)-1 before it
            idx = self.text.find(stop, max(old_len - len(stop) + 1, 0))
            if idx != -1:
                hits.append((idx, stop))
        if not hits:
            return None
        idx, stop = min(hits)  # the earliest match wins
        self.text = self.text[: idx + len(stop) if self.include_stop_str_in_output else idx]
        return stop
