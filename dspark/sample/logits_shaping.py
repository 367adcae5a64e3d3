"""Logits shaping before temperature: bad words, logit_bias and the three penalties (vLLM's).

For a row whose request has prompt tokens P and output tokens O so far, in this order:

  1. bans and bias:  logits[v] += logit_bias[v]; logits[w] = -inf for every bad word whose
                     other tokens are the last tokens of O (w its last token)
  2. repetition:     for v in P or O: logits[v] / r if logits[v] > 0 else logits[v] * r
  3. frequency:      logits[v] -= frequency_penalty * count_O(v)
  4. presence:       logits[v] -= presence_penalty * [count_O(v) > 0]

Then temperature, min_p (`apply_min_p`, on the tempered logits), top-k and top-p
(sample/sampler.py). The sequence is vLLM's, so a request gets vLLM's distribution.

Worked example (tests/test_sampling_params_shaping.py): logits [2, -1, 0.5, 1], prompt {1},
outputs [0, 0, 3], repetition 2, frequency 0.5, presence 0.25:
  repetition (tokens 0, 1, 3): [1, -2, 0.5, 0.5]
  frequency (counts [2, 0, 0, 1]): [0, -2, 0.5, 0]
  presence (tokens 0, 3): [-0.25, -2, 0.5, -0.25]

Speculation: the logits at window position j (the distribution of the token after draft j) are
shaped with O extended by drafts 1..j, in the drafter's Markov loop and in verification alike.
Both then describe the next token given the same prefix, the one being verified, so the
rejection-sampling argument (SPECULATION.md §4.2, §4.7) holds position by position: the emitted
tokens follow the shaped target distribution. A bad word of several tokens depends on that
prefix too; its request verifies no drafts (Scheduler.is_windowed), so windows only ever carry
one-token bans, which do not depend on the prefix.

A step's shaping is built on the host from the requests' tokens, for the S rows of its N that
shape their raw logits (penalties, logit_bias, bad words: SamplingParams.shapes_raw_logits) and
only for them: dense [S, V] tensors, and `rows` [S], the step row of each. Applying it gathers
those rows' logits, shapes them and writes them back; every other row's logits pass untouched.
min_p, [N] (a float a row), needs no tensor of the vocabulary: a row with min_p alone is not a
shaping row.

  N = 5, rows 1 and 3 shape:  rows [1, 3]    output_counts, prompt_mask, bias [2, V]
                              logits[[1, 3]] -> shaped -> written back to rows 1, 3

In verification the rows are windows, and a shaping window's tokens are gathered
(`window_shaping_index`). So one shaping row among 256 costs one row's host work and copies,
not 256 rows'. A step with a shaping row takes the PyTorch path (no fused kernel, no captured
graph), the reason counted in the runner's stats.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dspark.request import Request


@dataclass(frozen=True)
class LogitsShaping:
    """The shaping of one step's logits (module docstring), on the device: S shaping rows of N."""

    rows: torch.Tensor  # [S] int64, the step row of each shaping row (ascending)
    output_counts: torch.Tensor  # [S, V] float32, each token's count among the outputs
    prompt_mask: torch.Tensor  # [S, V] bool, the token is in the prompt
    presence_penalty: torch.Tensor  # [S] float32 (0: none)
    frequency_penalty: torch.Tensor  # [S] float32 (0: none)
    repetition_penalty: torch.Tensor  # [S] float32 (1: none)
    bias: torch.Tensor  # [S, V] float32, logit_bias, and -inf at the banned tokens
    min_p: torch.Tensor | None  # [N] float32, every row's; None: no row has min_p


def build_shaping(
    reqs: Sequence[Request],  # [N] the rows' requests
    ends: Sequence[int],  # [N] index in token_ids of the token each row samples next
    vocab_size: int,
    device: torch.device,
) -> LogitsShaping:
    """The rows' shaping from their tokens before `ends`: outputs are token_ids[num_prompt:end].

    prompt [5, 6], token_ids [5, 6, 9, 9, 4], end 4 -> outputs [9, 9], counts[9] = 2
    """
    rows = [i for i, req in enumerate(reqs) if req.sampling_params.shapes_raw_logits]
    counts = np.zeros((len(rows), vocab_size), dtype=np.float32)
    prompt = np.zeros((len(rows), vocab_size), dtype=bool)
    bias = np.zeros((len(rows), vocab_size), dtype=np.float32)
    penalties = np.zeros((3, len(rows)), dtype=np.float32)  # presence, frequency, repetition
    for s, i in enumerate(rows):  # shaping row s is step row i
        req = reqs[i]
        sp = req.sampling_params
        penalties[:, s] = sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty
        outputs = req.token_ids[req.num_prompt_tokens : ends[i]]
        if sp.has_penalties:
            counts[s] = np.bincount(outputs, minlength=vocab_size)[:vocab_size]
            prompt[s, req.prompt_token_ids] = True
        for token, value in (sp.logit_bias or {}).items():
            bias[s, token] += value
        bias[s, banned_by_bad_words(req.bad_words_token_ids, outputs)] = float("-inf")
    min_p = np.array([req.sampling_params.min_p for req in reqs], dtype=np.float32)
    return LogitsShaping(
        rows=_on(np.array(rows, dtype=np.int64), device),
        output_counts=_on(counts, device), prompt_mask=_on(prompt, device),
        presence_penalty=_on(penalties[0], device), frequency_penalty=_on(penalties[1], device),
        repetition_penalty=_on(penalties[2], device), bias=_on(bias, device),
        min_p=_on(min_p, device) if min_p.any() else None,
    )  # fmt: skip


def _on(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(array).to(device)


def banned_by_bad_words(bad_words: list[list[int]], outputs: list[int]) -> list[int]:
    """The tokens bad words ban after `outputs`: each word's last token, where the outputs end
    in the word's other tokens (a one-token word: always). As vLLM, only outputs are matched.

      words [[7], [3, 4, 5]], outputs [1, 3, 4] -> [7, 5];  outputs [3] -> [7]
    """
    banned = []
    for word in bad_words:
        prefix = word[:-1]
        if len(prefix) <= len(outputs) and (not prefix or outputs[-len(prefix) :] == prefix):
            banned.append(word[-1])
    return banned


def has_multi_token_bad_words(req: Request) -> bool:
    """Does a bad word of `req` depend on the tokens before it (so a window could not carry
    it: module docstring)?"""
    return any(len(word) > 1 for word in req.bad_words_token_ids)


def apply_penalties(
    logits: torch.Tensor,  # [N, V] float32
    prompt_mask: torch.Tensor,  # [N, V] bool
    output_counts: torch.Tensor,  # [N, V] float32
    presence: torch.Tensor,  # [N]
    frequency: torch.Tensor,  # [N]
    repetition: torch.Tensor,  # [N]
) -> torch.Tensor:  # [N, V]
    """Steps 2-4 of the module docstring (a new tensor)."""
    output_mask = output_counts > 0  # [N, V]
    penalty = torch.where(prompt_mask | output_mask, repetition[:, None], 1.0)  # [N, V]
    logits = logits * torch.where(logits > 0, 1.0 / penalty, penalty)
    logits = logits - frequency[:, None] * output_counts
    return logits - presence[:, None] * output_mask


def apply_shaping(
    logits: torch.Tensor,  # [N, V] raw logits
    shaping: LogitsShaping,
    draft_counts: torch.Tensor | None = None,  # [S, V] counts of the drafts before each row's
) -> torch.Tensor:  # [N, V] float32, a new tensor: the shaping rows shaped, the others as given
    """Steps 1-4 of the module docstring on the shaping rows; `draft_counts` join their output
    counts (the drafter's Markov loop)."""
    out = logits.to(torch.float32, copy=True)  # [N, V]
    if len(shaping.rows):  # (a shape: no sync)
        shaped = _shape(out[shaping.rows], shaping, None, draft_counts)  # [S, V]
        out.index_copy_(0, shaping.rows, shaped)
    return out


def apply_window_shaping(
    window_logits: torch.Tensor,  # [Tw, V] raw logits at every window token
    shaping: LogitsShaping,  # of the windows: `rows` are windows
    draft_tokens: torch.Tensor,  # [R, K] the drafts of each window
    cu: torch.Tensor,  # [R + 1] window starts in window_logits
) -> torch.Tensor:  # [Tw, V] float32, a new tensor: the shaping windows' tokens shaped
    """Steps 1-4 of the module docstring on the tokens of the shaping windows, token j of a
    window with its drafts 1..j joining the outputs (as the drafter shaped draft j + 1)."""
    num_tokens, vocab_size = window_logits.shape
    # (the spare row takes the slots past a window's end: window_shaping_index)
    out = window_logits.new_empty(num_tokens + 1, vocab_size, dtype=torch.float32)
    out[:num_tokens], out[num_tokens] = window_logits, 0.0
    if len(shaping.rows):  # (a shape: no sync)
        width = draft_tokens.shape[1] + 1  # a window's most tokens: anchor and K drafts
        index, owner, offset = window_shaping_index(shaping.rows, cu, width, num_tokens)
        drafts = window_draft_counts(draft_tokens[shaping.rows], owner, offset, vocab_size)
        out.index_copy_(0, index, _shape(out[index], shaping, owner, drafts))
    return out[:num_tokens]


def window_shaping_index(
    rows: torch.Tensor,  # [S] the shaping windows
    cu: torch.Tensor,  # [R + 1] window starts
    width: int,  # W, the most tokens a window has (K + 1)
    spare: int,  # the row slots past a window's end point at
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # [S W] index, owner, offset
    """The tokens of the shaping windows, W slots each, shape-static (cu is on the device):
    slot j of shaping row s is token cu[rows[s]] + j, its window's token j, or `spare` past
    the window's end.

      cu [0, 3, 4, 6], rows [0, 2], W 3, spare 6:
        owner  [0, 0, 0, 1, 1, 1]    (shaping row)
        offset [0, 1, 2, 0, 1, 2]
        start  [0, 0, 0, 4, 4, 4], length [3, 3, 3, 2, 2, 2]
        index  [0, 1, 2, 4, 5, 6]    (window 2 has two tokens: its slot 2 is the spare)
    """
    slot = torch.arange(rows.shape[0] * width, device=rows.device)  # [S W]
    owner, offset = slot // width, slot % width
    start, length = cu[rows], cu[rows + 1] - cu[rows]  # [S]
    index = torch.where(offset < length[owner], start[owner] + offset, spare)
    return index, owner, offset


def _shape(
    logits: torch.Tensor,  # [M, V] float32, rows of shaping rows
    shaping: LogitsShaping,
    owner: torch.Tensor | None,  # [M] the shaping row of each; None: i -> i
    draft_counts: torch.Tensor | None,  # [M, V]
) -> torch.Tensor:  # [M, V]
    s = shaping
    if owner is not None:  # (one row per window token: its window's)
        s = LogitsShaping(s.rows, *(t[owner] for t in (s.output_counts, s.prompt_mask,
                          s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.bias)),
                          min_p=None)  # fmt: skip
    counts = s.output_counts if draft_counts is None else s.output_counts + draft_counts
    return apply_penalties(logits + s.bias, s.prompt_mask, counts, s.presence_penalty,
                           s.frequency_penalty, s.repetition_penalty)  # fmt: skip


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop (-inf) the tokens less likely than min_p times the row's most likely token, on the
    tempered logits [N, V]; min_p [N] 0 keeps every token.

      probs [0.5, 0.3, 0.15, 0.05], min_p 0.4 -> threshold 0.2: tokens 0 and 1 stay
    """
    probs = logits.softmax(dim=-1)  # [N, V]
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]  # [N, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


def window_draft_counts(
    draft_tokens: torch.Tensor,  # [R, K] the drafts of each window
    owner: torch.Tensor,  # [T] the window of each window token
    offset: torch.Tensor,  # [T] 0 for the anchor, j for draft j
    vocab_size: int,
) -> torch.Tensor:  # [T, V] float32: counts of drafts 1..offset of the token's window
    """What window token j adds to its request's outputs: drafts 1..j (the tokens between the
    anchor and the token it predicts).

      drafts [[4, 4, 2]], offsets [0, 1, 2, 3] -> token 4 counted [0, 1, 2, 2], token 2 [0, 0, 0, 1]
    """
    counts = torch.zeros(owner.shape[0], vocab_size, device=owner.device)
    for k in range(draft_tokens.shape[1]):  # draft k + 1 counts at offsets past k
        present = (offset > k).float()[:, None]  # [T, 1]
        counts.scatter_add_(1, draft_tokens[owner, k][:, None], present)
    return counts
