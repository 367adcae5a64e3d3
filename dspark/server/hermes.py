"""Hermes-style tool calls in a model's text: the format Qwen2.5's and Qwen3's chat templates
(and many others, after NousResearch's Hermes models) teach the model to write,

    I'll look it up.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`parse` takes the calls out of a whole text; the content is what is left. A last `<tool_call>`
the model did not close (it stopped at its end-of-turn token instead) still counts when its
JSON is whole, as vLLM's Hermes parser reads it. A call whose JSON does not parse, or without a
string "name", makes the whole text content: nothing is guessed. "arguments" (or "parameters",
which some models write) may be an object, given back as its JSON text, or a string, given back
as it is.

`ContentStream` is the streaming half: it releases the text before the first `<tool_call>` as
it comes, holding back what might still turn out to be one (a trailing "<tool_c") and trailing
whitespace (which the whole response drops before a call), so what it released is always a
prefix of the whole response's content.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

START, END = "<tool_call>", "</tool_call>"
_CALL = re.compile(rf"{START}(.*?)(?:{END}|\Z)", re.DOTALL)


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text


def parse(text: str) -> tuple[str, list[ParsedCall]] | None:
    """(the text outside the calls, the calls in order), or None when the text holds no call or
    a malformed one (then all of it is content)."""
    if START not in text:
        return None
    calls, parts, position = [], [], 0
    for match in _CALL.finditer(text):
        parts.append(text[position : match.start()])
        position = match.end()
        call = _call(match.group(1))
        if call is None:
            return None
        calls.append(call)
    parts.append(text[position:])
    return "".join(parts), calls


def _call(inner: str) -> ParsedCall | None:
    try:
        body = json.loads(inner)
    except ValueError:
        return None
    if not isinstance(body, dict) or not isinstance(body.get("name"), str):
        return None
    arguments = body.get("arguments", body.get("parameters", {}))
    if isinstance(arguments, str):
        return ParsedCall(body["name"], arguments)
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(body["name"], json.dumps(arguments, ensure_ascii=False))


def _partial_start(text: str) -> int:
    """The length of the longest end of `text` that begins START (but is not all of it)."""
    for k in range(min(len(START) - 1, len(text)), 0, -1):
        if text.endswith(START[:k]):
            return k
    return 0


class ContentStream:
    """One stream's content before its first tool call, released as it becomes certain."""

    def __init__(self) -> None:
        self.text = ""  # everything fed
        self.num_sent = 0  # characters of `text` released
        self._start: int | None = None  # where the first START begins, once seen

    def feed(self, new: str) -> str:
        """The content `new` makes certain (possibly "")."""
        searched = max(0, len(self.text) - len(START))
        self.text += new
        if self._start is None:
            found = self.text.find(START, searched)
            self._start = found if found >= 0 else None
        end = self._start if self._start is not None else len(self.text) - _partial_start(self.text)
        certain = end  # less trailing whitespace
        while certain > self.num_sent and self.text[certain - 1].isspace():
            certain -= 1
        if certain <= self.num_sent:
            return ""
        released, self.num_sent = self.text[self.num_sent : certain], certain
        return released
