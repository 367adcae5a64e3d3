"""Lossless verification of drafted tokens: speculative rejection sampling on a ragged batch.

Request r sends its window [anchor, x_1 .. x_l] (l = verify_len[r] drafted positions, 0..K) to
the target, which returns target distributions at the l + 1 window positions. Then:

  accepted   drafts the target keeps: x_k is kept with probability
             min(1, target_probs[k][x_k] / draft_probs[k][x_k]), left to right, stopping at the
             first rejection (greedy: kept iff x_k is the target's argmax).
  recovered  at the first rejection k, one token drawn from normalize(max(0, target_probs[k] -
             draft_probs[k])) (target_probs[k] itself if that mass is ~0; greedy: the argmax).
  bonus      when all l are accepted, one token drawn from target_probs[l + 1] (greedy: argmax).

Each request emits its accepted drafts plus exactly one recovered-or-bonus token: 1 .. l + 1.
Why this is exact: at a position whose draft was drawn from q, P(emit v) = q(v) min(1, p(v)/q(v))
+ (1 - sum_u min(q(u), p(u))) (p(v) - q(v))+ / sum_u (p(u) - q(u))+ = min(q(v), p(v)) +
(p(v) - q(v))+ = p(v), and the emitted token conditions the next position as the target would.

Randomness is a pure function of (seed, position): the acceptance coin of the draft at position
t uses STREAM_ACCEPT at t, the recovered or bonus token at t uses STREAM_SAMPLE at t (the stream
plain decoding samples position t from, so a request with l = 0 emits the very token plain
decoding would). Nothing depends on batch mates or on where a row sits in the batch.

Shapes: R requests, K drafted slots each, V vocabulary; target rows are laid out ragged
(cu_num_tokens), one per window token:

  verify_len:      [2, 0, 1]             windows [3, 1, 2]
  cu_num_tokens:   [0, 3, 4, 6]
  target row of (r, k) (k = 0 is the anchor's distribution, which judges draft 1):
                   r0: 0 1 2 | r1: 3 | r2: 4 5
  bonus row (k = l): [2, 3, 5]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark import envs
from dspark.sample.random import STREAM_ACCEPT, STREAM_SAMPLE, uniform
from dspark.sample.sampler import inverse_cdf

# Below this residual mass the recovered token falls back to the target distribution itself.
RESIDUAL_EPS = 1e-9


def fused_verify_enabled() -> bool:
    return not envs.ENVS.reference_ops


@dataclass(frozen=True)
class VerifyInput:
    target_probs: torch.Tensor  # [T, V] float32, the target's sampling distribution per token
    draft_probs: torch.Tensor  # [R, K, V] float32, the distribution each draft was drawn from
    draft_tokens: torch.Tensor  # [R, K] int64
    verify_len: torch.Tensor  # [R] int64, 0 .. K
    cu_num_tokens: torch.Tensor  # [R + 1] int64 window starts (a window has >= 1 + verify_len)
    anchor_positions: torch.Tensor  # [R] int64, position of each window's anchor
    seeds: torch.Tensor  # [R] int64
    is_greedy: torch.Tensor  # [R] bool


@dataclass(frozen=True)
class VerifyOutput:
    tokens: torch.Tensor  # [R, K + 1] int64: accepted drafts, then the recovered/bonus token
    num_accepted: torch.Tensor  # [R] int64, 0 .. verify_len
    # tokens[r, :num_accepted[r] + 1] is what request r emits this step


def verify(inp: VerifyInput) -> VerifyOutput:
    R, K = inp.draft_tokens.shape
    dev = inp.draft_tokens.device
    slots = torch.arange(K, device=dev)  # [K]
    is_verified = slots[None, :] < inp.verify_len[:, None]  # [R, K]
    # target row judging draft k+1 (0-based slot k): cu[r] + k; clamp keeps unverified slots
    # in range (their values are masked out below). Only [R, K] values are read at these rows:
    # never a [R, K, V] copy (at G = 256, K = 7 that would be 352 MB of float32)
    rows = (inp.cu_num_tokens[:-1, None] + slots[None, :]).clamp(max=inp.target_probs.shape[0] - 1)
    p_t = inp.target_probs[rows, inp.draft_tokens]  # [R, K]
    p_d = inp.draft_probs.gather(-1, inp.draft_tokens[..., None])[..., 0]  # [R, K]
    draft_pos = inp.anchor_positions[:, None] + 1 + slots[None, :]  # [R, K]
    coins = uniform(inp.seeds.repeat_interleave(K), draft_pos.reshape(-1), STREAM_ACCEPT)
    coins = coins.view(R, K)
    accept = coins * p_d < p_t  # u < p_t / p_d without dividing by a zero p_d
    target_argmax = inp.target_probs.argmax(dim=-1)  # [T]: the greedy rows' choices
    greedy_accept = inp.draft_tokens == target_argmax[rows]
    accept = torch.where(inp.is_greedy[:, None], greedy_accept, accept) & is_verified
    # accepted prefix length: index of the first False in accept, K if none
    num_accepted = (~accept).cumsum(dim=1).eq(0).sum(dim=1)  # [R]
    final = _final_token(inp, num_accepted, target_argmax)  # [R]
    tokens = torch.where(slots[None, :] < num_accepted[:, None], inp.draft_tokens, 0)
    tokens = torch.cat([tokens, torch.zeros_like(tokens[:, :1])], dim=1)  # [R, K + 1]
    tokens.scatter_(1, num_accepted[:, None], final[:, None])
    return VerifyOutput(tokens, num_accepted)


def verify_greedy(
    target_logits: torch.Tensor,  # [T, V] the target's logits at every window token
    draft_tokens: torch.Tensor,  # [R, K]
    verify_len: torch.Tensor,  # [R]
    cu_num_tokens: torch.Tensor,  # [R + 1]
) -> VerifyOutput:
    """Verification when every row is greedy: a draft is kept iff it is the target's argmax,
    and the final token is the argmax at the first disagreement (or after the last draft).
    The argmax of the logits, exactly as plain greedy decoding takes it: no distribution over
    the vocabulary is ever built. On CUDA everything after the argmax is one Triton launch
    (kernels/verify_greedy_triton.py; DSPARK_REFERENCE_OPS keeps this code)."""
    R, K = draft_tokens.shape
    target_tokens = target_logits.argmax(dim=-1)  # [T]
    if target_tokens.is_cuda and fused_verify_enabled():  # the rest in one launch
        from dspark.kernels.verify_greedy_triton import verify_greedy_triton

        return VerifyOutput(*verify_greedy_triton(target_tokens, draft_tokens, verify_len,
                                                  cu_num_tokens))  # fmt: skip
    slots = torch.arange(K, device=draft_tokens.device)  # [K]
    rows = (cu_num_tokens[:-1, None] + slots[None, :]).clamp(max=target_tokens.shape[0] - 1)
    accept = (draft_tokens == target_tokens[rows]) & (slots[None, :] < verify_len[:, None])
    num_accepted = (~accept).cumsum(dim=1).eq(0).sum(dim=1)  # [R]
    final = target_tokens[cu_num_tokens[:-1] + num_accepted]  # [R]
    tokens = torch.where(slots[None, :] < num_accepted[:, None], draft_tokens, 0)
    tokens = torch.cat([tokens, torch.zeros_like(tokens[:, :1])], dim=1)  # [R, K + 1]
    tokens.scatter_(1, num_accepted[:, None], final[:, None])
    return VerifyOutput(tokens, num_accepted)


def _final_token(
    inp: VerifyInput, num_accepted: torch.Tensor, target_argmax: torch.Tensor
) -> torch.Tensor:  # [R] the recovered (a draft was rejected) or bonus (all accepted) token
    R, K = inp.draft_tokens.shape
    rejected = num_accepted < inp.verify_len  # [R]
    # distribution at the final position: row cu[r] + num_accepted[r] of the target
    final_row = inp.cu_num_tokens[:-1] + num_accepted
    p_t = inp.target_probs[final_row]  # [R, V]
    k = num_accepted.clamp(max=K - 1)
    p_d = inp.draft_probs[torch.arange(R, device=p_t.device), k]  # [R, V]
    residual = (p_t - p_d).clamp(min=0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    residual = torch.where(mass > RESIDUAL_EPS, residual / mass.clamp(min=RESIDUAL_EPS), p_t)
    probs = torch.where(rejected[:, None], residual, p_t)  # [R, V]
    position = inp.anchor_positions + 1 + num_accepted  # where the final token lands
    sampled = inverse_cdf(probs, uniform(inp.seeds, position, STREAM_SAMPLE))  # a draw from probs
    return torch.where(inp.is_greedy, target_argmax[final_row], sampled)
