"""Delta outputs (output_kind "delta"): what a request gained since its last report.

A `DeltaCursor` per request remembers how much of its text and tokens were reported; a step
reports the slices past it. Only the new tokens are sliced, so a step costs the same at token
10 and token 10,000 (a cumulative output copies the whole token list every step).

Stop strings: the engine cuts the text before a stop string once it is complete, but its first
characters may have been decoded a step earlier. So while a request runs, its last
(longest stop - 1) characters are held back:

    stop ["END"], text "abcEN"  -> reported "abc"; next step "abcEND" is cut to "abc": no
    character the final text lacks was ever reported.

With include_stop_str_in_output the text is cut after the stop string, which only drops
characters decoded in the step that completed it (never reported), so nothing is held back.

Output kind "delta_tokens" reports the tokens alone (text ""): the detokenizer only collects
them and is never read, and the caller decodes (the server decodes its streams itself).

A stream interval of N (EngineConfig.stream_interval) reports a running request once it has N
output tokens unreported (its first token at once, its end always): the engine and the server
then handle one delta per N tokens, which at high batch is what bounds streamed throughput.
"""

from __future__ import annotations

from dspark.engine.detokenizer import Detokenizer
from dspark.outputs import DeltaOutput, FinalInfo
from dspark.request import PENDING_TOKEN, Request
from dspark.sampling_params import SamplingParams


class DeltaCursor:
    __slots__ = ("num_chars", "num_tokens", "num_unreported", "holdback", "with_text")

    def __init__(self, params: SamplingParams) -> None:
        self.with_text = params.output_kind != "delta_tokens"  # (else tokens only: never decoded)
        self.num_chars = 0  # characters of the text reported
        self.num_tokens = 0  # output tokens reported
        self.num_unreported = 0  # output tokens emitted since (the stream interval counts them)
        stops = params.stop_strings
        is_cut_before = stops and not params.include_stop_str_in_output
        self.holdback = max(len(s) for s in stops) - 1 if is_cut_before else 0

    def advance(self, req: Request, detok: Detokenizer, final: FinalInfo | None) -> DeltaOutput:
        """The request's delta since the last call (`final` set on its last one)."""
        new_text, end = "", 0
        if self.with_text:
            text = detok.text
            end = len(text) if final is not None else max(self.num_chars, len(text) - self.holdback)
            new_text = text[self.num_chars : end]
        start = req.num_prompt_tokens + self.num_tokens
        tokens = req.token_ids
        stop = len(tokens)
        while stop > start and tokens[stop - 1] == PENDING_TOKEN:  # the step in flight's
            stop -= 1
        new_tokens = tokens[start:stop]
        logprobs = None
        if req.sampling_params.logprobs is not None:
            new = req.logprobs[self.num_tokens : self.num_tokens + len(new_tokens)]
            logprobs = [{**lp.top, lp.token_id: lp.logprob} for lp in new]
        self.num_chars = end
        self.num_tokens += len(new_tokens)
        self.num_unreported = 0
        return DeltaOutput(req.request_id, new_text, new_tokens, logprobs, final)
