"""A request's state through its life: waiting -> running (-> preempted -> waiting) -> finished."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

from dspark.sampling_params import SamplingParams

# A sampled token whose value is still on the device (async scheduling): the scheduler counts it,
# the runner feeds it to the next step from the device, the step's results replace it.
PENDING_TOKEN = -1

_serials = itertools.count()  # one per Request object: ids may be reused once a request ends


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"  # aborted by the caller


@dataclass
class TokenLogprobs:
    """The target's log-probability of one emitted token and its top-n alternatives."""

    token_id: int
    logprob: float
    top: dict[int, float]


# eq=False: a request is an entity, equal only to itself; a generated field-by-field __eq__
# would make every `running.remove(req)` (and `in`) compare hundreds of requests' fields
@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seed: int  # sampling_params.seed, or one drawn from the engine's generator
    eos_token_id: int | None
    arrival_time: float  # when it reached the server (the API handler), else added_time
    prompt: str | None = None
    added_time: float | None = None  # when the engine added it (monotonic clock)
    # prompt + output tokens; the last one is not in the KV cache yet once sampled. Under async
    # scheduling the last one or two may be PENDING_TOKEN until their step's results arrive.
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    page_ids: list[int] = field(default_factory=list)
    # prefix caching (engine/prefix_cache.py): the hash chain of its full pages whose tokens
    # are known (kept through preemption: its tokens stay), and how many of page_ids, from the
    # first, are in the cache (shared at admission or published since)
    page_hashes: list[bytes] = field(default_factory=list)
    num_published_pages: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_preemptions: int = 0
    # prompt_logprobs: per prompt token, {token id: logprob} of it and the top alternatives
    # at its position; None for the first (nothing predicts it), as vLLM returns them
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # sampling_params.bad_words as token sequences (SamplingParams.bad_words_token_ids)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # the structured output's matcher (structured/matcher.py's GrammarMatcher, built by the
    # engine from sampling_params.structured_outputs), advanced by the tokens the request
    # emits; None without structured output
    grammar: Any = None
    # sampling_params.reads_outputs, read once at creation (the parameters are validated then and
    # not changed after): ModelRunner.can_feed asks it of every row of a step launched ahead
    reads_outputs: bool = False
    # the token count at which it ends by length (max_tokens or max_model_len): set once by
    # Scheduler.add, which knows max_model_len, so the per-step checks are one comparison
    max_num_tokens: int = 0
    # windows of this request launched and not yet applied by update() (0 or 1 between steps;
    # 1 while a speculative step launched ahead sits behind the one in flight): while > 0 its
    # token_ids and num_computed_tokens stop at that window's anchor
    num_windows_in_flight: int = 0
    # this request's speculation, with vLLM's counter definitions: windows verified, drafted
    # positions sent to the target, and the drafts it accepted
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # vLLM's request timestamps (monotonic clock), read by the server's latency histograms:
    # first admitted by the scheduler (queue time ends, prefill starts), first and latest step
    # that gave it tokens, and the gap before each step that gave it tokens after the first
    # (vLLM's inter-token latencies: one per step, however many tokens it accepted)
    scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_time: float | None = None
    serial: int = field(default_factory=lambda: next(_serials), init=False)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.sampling_params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_prefilling(self) -> bool:
        """Part of its prompt still has no KV (a chunked prefill in progress, or not begun)."""
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """Output tokens known on the host (pending ones, always at the end, left out)."""
        out = self.token_ids[self.num_prompt_tokens :]
        while out and out[-1] == PENDING_TOKEN:
            out = out[:-1]
        return out

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED
