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

The tensors are dense [N, V], built on the host each step from the requests' tokens: a row that
shapes its logits takes the PyTorch path (no fused kernel, no captured graph), the reason
counted in the runner's stats.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dspark.request import Request


@dataclass(frozen=True)
class LogitsShaping:
    """Per-row shaping of one step's logits (module docstring), on the device."""

    output_counts: torch.Tensor  # [N, V] float32, each token's count among the outputs
    prompt_mask: torch.Tensor  # [N, V] bool, the token is in the prompt
    presence_penalty: torch.Tensor  # [N] float32 (0: none)
    frequency_penalty: torch.Tensor  # [N] float32 (0: none)
    repetition_penalty: torch.Tensor  # [N] float32 (1: none)
    bias: torch.Tensor  # [N, V] float32, logit_bias, and -inf at the banned tokens
    min_p: torch.Tensor | None  # [N] float32; None: no row has min_p


def build_shaping(
    reqs: Sequence[Request],  # the rows' requests
    ends: Sequence[int],  # [N] index in token_ids of the token each row samples next
    vocab_size: int,
    device: torch.device,
) -> LogitsShaping:
    """The rows' shaping from their tokens before `ends`: outputs are token_ids[num_prompt:end].

    prompt [5, 6], token_ids [5, 6, 9, 9, 4], end 4 -> outputs [9, 9], counts[9] = 2
    """
    n = len(reqs)
    counts = np.zeros((n, vocab_size), dtype=np.float32)
    prompt = np.zeros((n, vocab_size), dtype=bool)
    bias = np.zeros((n, vocab_size), dtype=np.float32)
    penalties = np.zeros((3, n), dtype=np.float32)  # presence, frequency, repetition
    min_p = np.zeros(n, dtype=np.float32)
    for i, (req, end) in enumerate(zip(reqs, ends, strict=True)):
        sp = req.sampling_params
        penalties[:, i] = sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty
        min_p[i] = sp.min_p
        if not sp.shapes_logits:
            continue
        outputs = req.token_ids[req.num_prompt_tokens : end]
        if sp.has_penalties:
            counts[i] = np.bincount(outputs, minlength=vocab_size)[:vocab_size]
            prompt[i, req.prompt_token_ids] = True
        for token, value in (sp.logit_bias or {}).items():
            bias[i, token] += value
        bias[i, banned_by_bad_words(req.bad_words_token_ids, outputs)] = float("-inf")
    return LogitsShaping(
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
    logits: torch.Tensor,  # [N, V] float32 raw logits
    shaping: LogitsShaping,
    rows: torch.Tensor | None = None,  # [N] the shaping row of each logits row; None: i -> i
    draft_counts: torch.Tensor | None = None,  # [N, V] counts of the window's earlier drafts
) -> torch.Tensor:  # [N, V] shaped logits
    """Steps 1-4 of the module docstring; `draft_counts` join the output counts (speculation)."""
    s = shaping
    if rows is not None:  # (one row per window token: its window's)
        s = LogitsShaping(*(t[rows] for t in (s.output_counts, s.prompt_mask, s.presence_penalty,
                                              s.frequency_penalty, s.repetition_penalty, s.bias)),
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
