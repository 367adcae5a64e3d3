"""What generate() and step() return, with vLLM's names.

Cumulative and final-only requests (SamplingParams.output_kind) report a `RequestOutput`: the
text and tokens so far. Delta requests report a `DeltaOutput` per step in which they changed:
only what is new, so a step costs the same whatever the length of the outputs so far, and the
tuple crosses a process boundary cheaply (pickle writes tuples in C; a dataclass goes through
its __reduce__ in Python, some 3x slower per object). Concatenated, a request's deltas equal its
final cumulative output:

    step 1: DeltaOutput("r", "Hel", [9906], None, None)
    step 2: DeltaOutput("r", "lo", [385], None, FinalInfo("length", None, 3, 2, None, {...}))
            -> text "Hello", token_ids [9906, 385], finish_reason "length"
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    # per emitted token: {token_id: logprob} holding the token itself and the top-n alternatives
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict[str, float] = field(default_factory=dict)
    # prompt_logprobs: per prompt token {token id: logprob} of it and the top alternatives
    # there (raw model), None for the first token; None without prompt_logprobs
    prompt_logprobs: list[dict[int, float] | None] | None = None


class FinalInfo(NamedTuple):
    """How a delta request ended: carried by its last DeltaOutput only."""

    finish_reason: str  # "stop" | "length" | "abort"
    stop_reason: int | str | None
    num_prompt_tokens: int
    num_output_tokens: int  # the whole output's, not this delta's
    cumulative_logprob: float | None  # None without logprobs
    metrics: dict[str, float]  # as RequestOutput.metrics (times, preemptions, speculation)


class DeltaOutput(NamedTuple):
    """What one request gained in one step (output_kind "delta").

    While the request runs, `text` holds back the last (longest stop string - 1) characters
    when it has stop strings (and does not include them in its output): the engine cuts the
    text before a stop string once it is complete, so a character sent early might not belong
    to the final text. The final delta releases what was held back."""

    request_id: str
    text: str  # new text
    token_ids: list[int]  # new tokens
    logprobs: list[dict[int, float]] | None  # per new token, as CompletionOutput.logprobs
    final: FinalInfo | None  # set on the request's last delta

    @property
    def finished(self) -> bool:
        return self.final is not None

    @classmethod
    def of_final(cls, out: RequestOutput) -> DeltaOutput:
        """A finished RequestOutput as one delta holding all of it."""
        assert out.finished, f"request {out.request_id} has not finished"
        c = out.outputs[0]
        final = FinalInfo(c.finish_reason, c.stop_reason, len(out.prompt_token_ids),
                          len(c.token_ids), c.cumulative_logprob, out.metrics)  # fmt: skip
        return cls(out.request_id, c.text, c.token_ids, c.logprobs, final)
