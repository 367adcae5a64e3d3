"""One request's grammar state: an llguidance matcher advanced by the tokens the request emits.

Only emitted tokens move it (a plain row's token; a window's accepted drafts and its recovered
or bonus token), in Scheduler.update once they are on the host, never a draft that verification
may still reject: the masks a window needs at its draft positions are filled from a copy of the
state and rolled back (structured/masks.py). So after every step the matcher is exactly a fresh
one fed the request's outputs (tests/test_structured_output.py holds it to that).

  regex [0-9]{2}:  emitted ["1"] -> takes 1, not stopped
                   emitted ["2", <eos>] -> takes 1: after "2" the grammar is complete (stopped);
                   the <eos> after it is not the request's, which ends on "2" as plain
                   decoding ends it
  regex [0-9]+:    emitted ["1", "2", <eos>] -> takes 3: EOS is allowed after "12" and stops it
"""

from __future__ import annotations

import llguidance


class GrammarMatcher:
    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.ll = matcher  # (masks.py hands it to llguidance's executor)

    def advance(self, tokens: list[int] | tuple[int, ...]) -> int:
        """Consume the emitted tokens in order until the grammar completes (it then admits
        nothing but EOS) or meets a token it does not allow; returns how many it took. The
        request keeps exactly those: a token after the grammar completed is not its output
        (a window may emit one: the recovered or bonus token after the completing draft).
        A token not allowed puts the matcher in error (`error` says why): masking should
        have made that impossible, and the request cannot go on."""
        ll = self.ll
        for i, token in enumerate(tokens):
            if ll.is_stopped() or not ll.consume_token(token):
                return i
        return len(tokens)

    @property
    def is_stopped(self) -> bool:
        """The grammar admits no further token (only EOS): the request is complete."""
        return self.ll.is_stopped()

    @property
    def is_accepting(self) -> bool:
        """The output so far satisfies the grammar (EOS is allowed next)."""
        return self.ll.is_accepting()

    @property
    def error(self) -> str:
        """Why the matcher failed ("" while it has not)."""
        return self.ll.get_error()
