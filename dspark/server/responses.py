"""Engine outputs as OpenAI response bodies: completions and chat, whole or as stream chunks.

The two routes differ only in how one choice looks, so each has a small formatter with the same
two methods (`choice` for a whole response, `delta_choice` for a chunk); the envelopes are
shared. Usage follows OpenAI (prompt tokens counted once per prompt, completion tokens summed
over choices); with speculation it also carries each request's own figures:

    "usage": {"prompt_tokens": 12, "completion_tokens": 30, "total_tokens": 42,
              "completion_tokens_details": {"accepted_prediction_tokens": 17,
                                            "rejected_prediction_tokens": 11},
              "speculation": {"num_drafts": 13, "num_draft_tokens": 28,
                              "num_accepted_tokens": 17, "mean_acceptance_length": 2.31}}

(vLLM's definitions: a draft is one verified window, the acceptance length counts the bonus
token, so it is 1 + accepted / drafts.)
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from dspark.models.tokenizer import Tokenizer
from dspark.outputs import FinalInfo
from dspark.server.prompt_logprobs import PromptLogprobs
from dspark.server.tool_calls import ToolCalling, ToolCallStream


@dataclass
class Delta:
    """What one choice gained since its last chunk."""

    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None  # per new token, as CompletionOutput.logprobs
    finish_reason: str | None
    stop_reason: int | str | None = None
    # the prompt's logprobs (RequestOutput.prompt_logprobs), on a whole response's choice
    prompt_logprobs: list[dict[int, float] | None] | None = None


# json.dumps(obj, ensure_ascii=False) builds an encoder per call; one shared encoder is the same
# text at a third of the cost (a stream encodes a chunk per few tokens)
to_json = json.JSONEncoder(ensure_ascii=False).encode


def usage(finals: list[FinalInfo], num_prompt_tokens: int) -> dict:
    """The usage of a request whose choices ended as `finals`."""
    completion = sum(f.num_output_tokens for f in finals)
    body = {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": num_prompt_tokens + completion,
    }
    if finals and "num_drafts" in finals[0].metrics:
        keys = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
        spec = {k: sum(int(f.metrics.get(k, 0)) for f in finals) for k in keys}
        drafts, accepted = spec["num_drafts"], spec["num_accepted_tokens"]
        spec["mean_acceptance_length"] = 1 + accepted / drafts if drafts else None
        body["speculation"] = spec
        body["completion_tokens_details"] = {
            "accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": spec["num_draft_tokens"] - accepted,
        }
    return body


class _Format:
    """Shared by both routes: the token text used by logprobs, the prompts' logprobs."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        return_token_ids: bool,
        num_logprobs: int | None,
        prompt_logprobs: PromptLogprobs | None = None,
        prompt_ids: list[list[int]] | None = None,  # each prompt's (prompt_logprobs, echo)
    ) -> None:
        self.tokenizer = tokenizer
        self.return_token_ids = return_token_ids
        self.num_logprobs = num_logprobs  # top alternatives per token; None: logprobs off
        self.prompt_logprobs = prompt_logprobs  # None: the engine computes none
        self.prompt_ids = prompt_ids

    @property
    def wants_tokens(self) -> bool:
        """Whether a chunk carries per-token fields (ids or logprobs) beside the text."""
        return self.return_token_ids or self.num_logprobs is not None

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def response_fields(self, choices: list[Delta]) -> dict:
        """Fields of a whole response beside its choices (a route's own)."""
        return {}

    @property
    def streams_text_as_is(self) -> bool:
        """Whether a stream's chunk of new text alone is `text_delta_json` of that text."""
        return True

    def take_trailing(self) -> list[dict]:
        """Choices for an event of their own after the current one (and forgotten here)."""
        return []

    def _ids(self, body: dict, token_ids: list[int]) -> dict:
        if self.return_token_ids:
            body["token_ids"] = token_ids
        return body


class CompletionFormat(_Format):
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def __init__(
        self,
        tokenizer: Tokenizer,
        return_token_ids: bool,
        num_logprobs: int | None,
        echo_texts: list[str] | None = None,  # echo: each prompt's text (choice i: i // n)
        n: int = 1,
        prompt_logprobs: PromptLogprobs | None = None,
        prompt_ids: list[list[int]] | None = None,
    ):
        super().__init__(tokenizer, return_token_ids, num_logprobs, prompt_logprobs, prompt_ids)
        self._offsets: dict[int, int] = {}  # choice -> characters of the tokens already sent
        self.echo_texts, self.n = echo_texts, n

    def choice(self, index: int, delta: Delta, is_first: bool = True) -> dict:
        """A whole choice, or a chunk's; echo puts the prompt's text before the choice's first
        text, as vLLM does (choice index of prompt i, sample j: i * n + j), and with logprobs
        the prompt's tokens before the choice's. With prompt logprobs (asked for, or computed
        for echo) a whole choice carries its prompt's, vLLM's `prompt_logprobs`."""
        is_echoed = bool(self.echo_texts) and is_first
        echo = self.echo_texts[index // self.n] if is_echoed else ""
        body = {
            "index": index,
            "text": echo + delta.text,
            "logprobs": self._logprobs(index, delta, is_echoed),
            "finish_reason": delta.finish_reason,
            "stop_reason": delta.stop_reason,
        }
        if delta.prompt_logprobs is not None:
            prompt = self.prompt_ids[index // self.n]
            body["prompt_logprobs"] = self.prompt_logprobs.vllm(prompt, delta.prompt_logprobs)
        return self._ids(body, delta.token_ids)

    def delta_choice(self, index: int, delta: Delta, is_first: bool = False) -> dict:
        return self.choice(index, delta, is_first)  # a completions chunk has a choice's shape

    def text_delta_json(self, index: int, text: str) -> str:
        """to_json(delta_choice(index, Delta(text, [], None, None))) without the dict: a
        stream's common chunk (new text only, not empty), rendered from a template."""
        return (
            f'{{"index": {index}, "text": {to_json(text)}, "logprobs": null, '
            '"finish_reason": null, "stop_reason": null}'
        )

    def _logprobs(self, index: int, delta: Delta, is_echoed: bool = False) -> dict | None:
        """Legacy completions logprobs: parallel lists over the new tokens (an echoed prompt's
        first, when its logprobs came: a whole response's); text_offset counts the characters
        of the choice's earlier tokens (kept per choice across chunks)."""
        if self.num_logprobs is None or delta.logprobs is None:
            return None
        tokens, token_logprobs, top_logprobs = [], [], []
        if is_echoed and delta.prompt_logprobs is not None:
            prompt = self.prompt_ids[index // self.n]
            tokens, token_logprobs, top_logprobs = self.prompt_logprobs.legacy(
                prompt, delta.prompt_logprobs, self.num_logprobs
            )
        tokens += [self.token_text(t) for t in delta.token_ids]
        token_logprobs += [lp[t] for t, lp in zip(delta.token_ids, delta.logprobs, strict=True)]
        top_logprobs += [{self.token_text(k): v for k, v in _ranked(lp)} for lp in delta.logprobs]
        offsets, offset = [], self._offsets.get(index, 0)
        for text in tokens:
            offsets.append(offset)
            offset += len(text)
        self._offsets[index] = offset
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": offsets,
        }


class ChatFormat(_Format):
    """A chat choice; with tool calling (tool_calls.py) its text becomes content and
    `tool_calls`, a stream's content held back until certain and its calls sent last."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(
        self,
        tokenizer: Tokenizer,
        return_token_ids: bool,
        num_logprobs: int | None,
        prompt_logprobs: PromptLogprobs | None = None,
        prompt_ids: list[list[int]] | None = None,
        tools: ToolCalling | None = None,
    ) -> None:
        super().__init__(tokenizer, return_token_ids, num_logprobs, prompt_logprobs, prompt_ids)
        self.tools = tools
        self._tool_streams: dict[int, ToolCallStream] = {}  # choice -> its stream's state
        self._finishes: list[dict] = []  # finish chunks due after their calls' chunk

    @property
    def streams_text_as_is(self) -> bool:
        return self.tools is None

    def take_trailing(self) -> list[dict]:
        finishes, self._finishes = self._finishes, []
        return finishes

    def response_fields(self, choices: list[Delta]) -> dict:
        """vLLM's chat `prompt_logprobs`, once for the response (every choice has the one
        prompt)."""
        if not choices or choices[0].prompt_logprobs is None:
            return {}
        (prompt,) = self.prompt_ids
        return {"prompt_logprobs": self.prompt_logprobs.vllm(prompt, choices[0].prompt_logprobs)}

    def choice(self, index: int, delta: Delta) -> dict:
        message = {"role": "assistant", "content": delta.text}
        reason = delta.finish_reason
        if self.tools is not None:
            message["content"], calls = self.tools.parse(delta.text)
            if calls:
                message["tool_calls"] = calls
            reason = self.tools.finish_reason(reason, calls)
        body = {
            "index": index,
            "message": message,
            "logprobs": self._logprobs(delta),
            "finish_reason": reason,
            "stop_reason": delta.stop_reason,
        }
        return self._ids(body, delta.token_ids)

    def delta_choice(self, index: int, delta: Delta, is_first: bool = False) -> dict | None:
        """A chunk's choice; None when it has nothing to send (tool calling held its text)."""
        text, calls, reason = delta.text, [], delta.finish_reason
        if self.tools is not None:
            stream = self._tool_streams.get(index)
            if stream is None:
                stream = self._tool_streams[index] = self.tools.stream()
            text = stream.feed(delta.text)
            if reason is not None:
                rest, calls = stream.finish()
                text += rest
                reason = self.tools.finish_reason(reason, calls)
            has_tokens = bool(delta.token_ids) and self.wants_tokens
            if not (text or calls or reason or is_first or has_tokens):
                return None
        message = {"role": "assistant"} if is_first else {}
        if text or is_first:
            message["content"] = text
        if calls:  # OpenAI's order (the client's stream helper needs it): calls, then finish
            message["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
            finish = {"index": index, "delta": {}, "logprobs": None, "finish_reason": reason,
                      "stop_reason": delta.stop_reason}  # fmt: skip
            self._finishes.append(finish)
            reason = None
        body = {
            "index": index,
            "delta": message,
            "logprobs": self._logprobs(delta),
            "finish_reason": reason,
            "stop_reason": delta.stop_reason,
        }
        return self._ids(body, delta.token_ids)

    def text_delta_json(self, index: int, text: str) -> str:
        """to_json(delta_choice(index, Delta(text, [], None, None))) without the dict: a
        stream's common chunk (new text, not empty; not the first), from a template."""
        return (
            f'{{"index": {index}, "delta": {{"content": {to_json(text)}}}, "logprobs": null, '
            '"finish_reason": null, "stop_reason": null}'
        )

    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def _logprobs(self, delta: Delta) -> dict | None:
        if self.num_logprobs is None or delta.logprobs is None:
            return None
        content = []
        for token_id, lp in zip(delta.token_ids, delta.logprobs, strict=True):
            entry = self._entry(token_id, lp[token_id])
            top = _ranked(lp)[: self.num_logprobs]
            entry["top_logprobs"] = [self._entry(k, v) for k, v in top]
            content.append(entry)
        return {"content": content}


def _ranked(logprobs: dict[int, float]) -> list[tuple[int, float]]:
    """Most likely first (the engine's dict holds the top-n and the emitted token)."""
    return sorted(logprobs.items(), key=lambda kv: (-kv[1], kv[0]))


def envelope(kind: str, request_id: str, created: int, model: str, choices: list[dict]) -> dict:
    return {
        "id": request_id,
        "object": kind,
        "created": created,
        "model": model,
        "choices": choices,
    }
