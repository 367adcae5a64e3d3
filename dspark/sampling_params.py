"""Per-request sampling parameters, with vLLM's field names and defaults."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

# A seed is folded to 64 bits before hashing; larger values are a user error, not silently wrapped.
MAX_SEED = 2**63 - 1
# What step() reports for a request, as vLLM's RequestOutputKind: "cumulative" (a RequestOutput
# every step, the text so far), "final_only" (once, when it finishes: no per-step outputs or
# detokenization) or "delta" (a DeltaOutput per step it changed in: only the new text and
# tokens, the finish reason and usage on the last; dspark/outputs.py). "delta_tokens" is
# "delta" without text: the engine never decodes, the caller does (the server decodes its
# streams, off the engine's step loop); it needs no stop strings, which only decoding finds.
OUTPUT_KINDS = ("cumulative", "final_only", "delta", "delta_tokens")


@dataclass
class SamplingParams:
    """How one request samples.

    temperature 0 means greedy. top_k -1 (or 0) disables top-k; top_p 1.0 disables top-p.
    max_tokens None means "until the context is full". logprobs n returns, for every emitted
    token, its log-probability and the n most likely tokens (under the model's raw distribution,
    as vLLM does by default).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    # Per-request opt-out of speculation (verify length 0 every step).
    use_speculation: bool = True
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

    def _validate(self) -> None:
        _check(self.n == 1, f"n must be 1 (parallel sampling is not supported), got {self.n}")
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


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
