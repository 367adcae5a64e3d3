"""A prompt's logprobs as vLLM returns them (`prompt_logprobs`), and as the legacy completions
`logprobs` lists of an echoed prompt.

The engine reports, per prompt token after the first, {token id: logprob} holding the prompt
token itself first, then the `computed` most likely tokens at that position (the raw model's),
the prompt token's entry not repeated (RequestOutput.prompt_logprobs). vLLM's shape, per prompt
token (None for the first, which nothing scores):

    [None, {1234: {"logprob": -2.3, "rank": 4, "decoded_token": " fox"},
            262: {"logprob": -0.9, "rank": 1, "decoded_token": " the"}, ...}, ...]

(token ids are JSON object keys, so strings on the wire). A rank is the token's place among the
position's most likely tokens, 1 the likeliest. The engine counts no rank past `computed`, so a
prompt token outside the top `computed` has rank null (vLLM counts it exactly). A request that
asks for fewer alternatives than the engine computed (echo with `logprobs` 5 beside
`prompt_logprobs` 1) gets the prompt token and those ranked up to its own number. Log
probabilities of -inf are written -9999.0, as vLLM and OpenAI write them (JSON has no infinity).
"""

from __future__ import annotations

from collections.abc import Callable

FLOOR = -9999.0  # -inf, as vLLM writes it

Entry = dict[int, float]  # one prompt position: {token id: logprob}


def _clamped(logprob: float) -> float:
    return max(logprob, FLOOR)


def ranks(entry: Entry, token: int, computed: int) -> dict[int, int | None]:
    """Each token of a position's entry -> its rank (1: the likeliest); None for the prompt
    token when it is not among the `computed` likeliest (the entry then has one more)."""
    outside = len(entry) > computed  # the prompt token came on top of the top `computed`
    ranked: dict[int, int | None] = {}
    rank = 0
    for t in sorted(entry, key=lambda t: -entry[t]):  # (stable: ties keep the engine's order)
        if t == token and outside:
            ranked[t] = None
        else:
            rank += 1
            ranked[t] = rank
    return ranked


class PromptLogprobs:
    """One request's prompt logprobs, formatted. `computed`: how many alternatives per position
    the engine was asked for (SamplingParams.prompt_logprobs); `asked`: the request's
    `prompt_logprobs` (None when only echo with logprobs asked for them: `prompt_logprobs` then
    shows all that was computed, as vLLM's); `text` decodes one token."""

    def __init__(self, computed: int, asked: int | None, text: Callable[[int], str]) -> None:
        self.computed = computed
        self.num_shown = computed if asked is None else asked
        self.text = text

    def _kept(self, entry: Entry, token: int, num: int) -> list[tuple[int, float, int | None]]:
        """(token, logprob, rank) of the prompt token, then those ranked 1..num, engine order."""
        ranked = ranks(entry, token, self.computed)
        return [(t, lp, ranked[t]) for t, lp in entry.items()
                if t == token or (ranked[t] is not None and ranked[t] <= num)]  # fmt: skip

    def vllm(self, prompt_ids: list[int], entries: list[Entry | None]) -> list:
        """vLLM's `prompt_logprobs`: None for the first token, then each position's dict."""
        num = self.num_shown
        out: list[dict | None] = []
        for token, entry in zip(prompt_ids, entries, strict=True):
            if entry is None:
                out.append(None)
                continue
            out.append({
                t: {"logprob": _clamped(lp), "rank": rank, "decoded_token": self.text(t)}
                for t, lp, rank in self._kept(entry, token, num)
            })  # fmt: skip
        return out

    def legacy(
        self, prompt_ids: list[int], entries: list[Entry | None], num: int
    ) -> tuple[list[str], list[float | None], list[dict[str, float] | None]]:
        """An echoed prompt's part of the completions `logprobs` lists (tokens, token_logprobs,
        top_logprobs), as vLLM writes them: null logprob and alternatives for the first."""
        tokens, token_logprobs, top_logprobs = [], [], []
        for token, entry in zip(prompt_ids, entries, strict=True):
            tokens.append(self.text(token))
            if entry is None:
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            token_logprobs.append(_clamped(entry[token]))
            kept = self._kept(entry, token, num)
            top_logprobs.append({self.text(t): _clamped(lp) for t, lp, _ in kept})
        return tokens, token_logprobs, top_logprobs
