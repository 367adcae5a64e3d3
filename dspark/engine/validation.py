"""What a request must satisfy before the engine accepts it.

Every check raises with the value and what is allowed, and runs before anything is enqueued,
so a rejected request leaves the engine as it was (the server answers 400 with the message).
"""

from __future__ import annotations

from dspark.sampling_params import SamplingParams


def check_request(
    prompt_ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int
) -> None:
    """Raise TypeError or ValueError if the prompt or its parameters cannot run here."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
    if params.n != 1:
        raise ValueError(
            f"n must be 1 for one engine request, got {params.n}: LLM.generate runs n requests "
            f"(the server expands n into choices itself)"
        )
    if params.prompt_logprobs is not None and params.output_kind in ("delta", "delta_tokens"):
        raise ValueError(
            f"prompt_logprobs comes with a RequestOutput (output_kind 'cumulative' or "
            f"'final_only'), not with output_kind {params.output_kind!r}"
        )
    n = len(prompt_ids)
    if n == 0:
        raise ValueError("prompt is empty: give at least one token")
    bad = [t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {vocab_size})")
    bad = [t for t in params.stop_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"stop_token_ids has {bad[0]!r}, outside the vocabulary [0, {vocab_size})")
    bad = [t for t in params.logit_bias or {} if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"logit_bias has token {bad[0]!r}, outside the vocabulary [0, {vocab_size})"
        )
    if n >= max_model_len:
        raise ValueError(
            f"prompt has {n} tokens but max_model_len is {max_model_len}: "
            f"at most {max_model_len - 1} prompt tokens leave room for one new token"
        )
    if params.max_tokens is not None and n + params.max_tokens > max_model_len:
        raise ValueError(
            f"max_tokens {params.max_tokens} plus the {n} prompt tokens exceeds max_model_len "
            f"{max_model_len}: allowed max_tokens here is 1..{max_model_len - n}"
        )
