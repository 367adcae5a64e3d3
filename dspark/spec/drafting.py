"""Drafting one block: the Markov head's left-to-right loop over the K slots of every row.

The backbone gives base logits U[k] for all K slots in one forward; the Markov head then makes
slot k depend on the token drafted at slot k - 1: logits_k = U[k] + bias(x[k-1]), x[0] = anchor.
Each row samples with its own parameters (temperature, top-k, top-p; greedy = argmax), and the
exact distribution each draft was drawn from is kept: verification needs draft_probs. The raw
confidence logit of slot k is a function of h[k] and x[k-1] only, never of x[k]; all K are
computed in one call after the loop, when every (h[k], x[k-1]) is known.

A batch of greedy rows on the triton backend draws each slot in one launch
(kernels/markov_greedy_triton.py) from the base logits as the LM head made them (bf16 on the
GPU: no float32 copy of [R, K, V]); elsewhere a slot is PyTorch's six. A sampled batch without
top-k or top-p draws each slot in three launches (kernels/markov_sample_triton.py) instead of
about 22: on the H200 the sampled speculative step cost 0.64-0.79x the PyTorch slot's
(DSPARK_REFERENCE_OPS keeps the PyTorch slot). A block whose rows shape their logits (penalties,
min_p, logit_bias, bad words) takes the PyTorch slot: the kernels read the LM head's logits as
they are.

Randomness: the draft at position t (= anchor_pos + 1 + k) uses STREAM_DRAFT at t, a pure
function of (seed, position), like every other random number in the engine. A draft is drawn by
inversion, one uniform per slot (sampler.inverse_cdf). Verification only needs the distribution
a draft was drawn from, not how it was drawn.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark import envs
from dspark.models.dspark_drafter import DSparkDrafter
from dspark.sample.logits_shaping import LogitsShaping, apply_shaping
from dspark.sample.random import STREAM_DRAFT, uniform
from dspark.sample.sampler import SamplingTensors, inverse_cdf, sampling_probs

# the fused sampled slot (module docstring); off under DSPARK_REFERENCE_OPS
FUSED_SAMPLED = not envs.ENVS.reference_ops


@dataclass(frozen=True)
class DraftBlock:
    tokens: torch.Tensor  # [R, K] int64
    probs: torch.Tensor | None  # [R, K, V] float32, each draft's distribution; None: all greedy
    confidence_logits: torch.Tensor | None  # [R, K] float32, raw (before STS calibration)


def draft_block(
    drafter: DSparkDrafter,
    hidden: torch.Tensor,  # [R, K, d] backbone output for the block
    anchors: torch.Tensor,  # [R] int64
    anchor_positions: torch.Tensor,  # [R] int64
    st: SamplingTensors,  # per-row parameters (positions field unused here)
    shaping: LogitsShaping | None = None,  # penalties, bias, bans per row (logits_shaping.py)
) -> DraftBlock:
    R, K, _ = hidden.shape
    tokens = torch.empty(R, K, dtype=torch.int64, device=hidden.device)
    fused = shaping is None and drafter.use_triton and _kernel_takes(drafter.config.markov_rank)
    if st.all_greedy and fused:
        _draft_greedy_fused(drafter, drafter.target.lm_head(hidden), anchors, tokens)
        probs = None
    elif fused and FUSED_SAMPLED and not (st.any_top_k or st.any_top_p or st.min_p is not None):
        probs = _draft_sampled_fused(
            drafter, drafter.target.lm_head(hidden), anchors, anchor_positions, st, tokens
        )
    else:
        base = drafter.base_logits(hidden)  # [R, K, V] float32
        # a batch of greedy rows needs no distributions: greedy verification compares argmaxes
        probs = None if st.all_greedy else torch.empty_like(base)
        prev = anchors
        is_greedy = st.temperature == 0
        # a shaping row's slot k is shaped with its outputs and drafts 1..k-1: the prefix
        # verification judges it under (sample/logits_shaping.py)
        draft_counts = None
        if shaping is not None:
            draft_counts = base.new_zeros(len(shaping.rows), base.shape[-1])  # [S, V]
        for k in range(K):
            logits = base[:, k] + drafter.markov_bias(prev)  # [R, V]
            if shaping is not None:
                logits = apply_shaping(logits, shaping, draft_counts)
            if st.all_greedy:
                tokens[:, k] = logits.argmax(dim=-1)
            else:
                p = sampling_probs(logits, st)  # [R, V]
                u = uniform(st.seeds, anchor_positions + 1 + k, STREAM_DRAFT)  # [R, 1]
                tokens[:, k] = torch.where(is_greedy, logits.argmax(dim=-1), inverse_cdf(p, u))
                probs[:, k] = p
            prev = tokens[:, k]
            if draft_counts is not None:  # (the shaping rows' drafts)
                drafted = prev[shaping.rows][:, None]  # [S, 1]
                draft_counts.scatter_add_(1, drafted, torch.ones_like(draft_counts[:, :1]))
    conf = None
    if drafter.confidence is not None:  # slot k from h[k] and x[k-1]: [anchor, x1 .. x(K-1)]
        prev_tokens = torch.cat([anchors[:, None], tokens[:, :-1]], dim=1)  # [R, K]
        conf = drafter.confidence_logit(hidden, prev_tokens)  # [R, K]
    return DraftBlock(tokens, probs, conf)


def _kernel_takes(rank: int) -> bool:
    from dspark.kernels.markov_greedy_triton import supports_rank

    return supports_rank(rank)


def _draft_greedy_fused(
    drafter: DSparkDrafter,
    base: torch.Tensor,  # [R, K, V] the LM head's output, in the model's dtype
    anchors: torch.Tensor,  # [R]
    tokens: torch.Tensor,  # [R, K] int64, written slot by slot
) -> None:
    from dspark.kernels.markov_greedy_triton import markov_greedy

    w1, w2 = drafter.markov_in.weight, drafter.markov_out.weight
    prev = anchors
    for k in range(tokens.shape[1]):
        markov_greedy(base[:, k], prev, w1, w2, out=tokens[:, k])
        prev = tokens[:, k]


def _draft_sampled_fused(
    drafter: DSparkDrafter,
    base: torch.Tensor,  # [R, K, V] the LM head's output, in the model's dtype
    anchors: torch.Tensor,  # [R]
    anchor_positions: torch.Tensor,  # [R]
    st: SamplingTensors,
    tokens: torch.Tensor,  # [R, K] int64, written slot by slot
) -> torch.Tensor:  # [R, K, V] float32, each draft's distribution
    from dspark.kernels.markov_sample_triton import markov_sample

    R, K, V = base.shape
    probs = torch.empty(R, K, V, dtype=torch.float32, device=base.device)
    w1, w2 = drafter.markov_in.weight, drafter.markov_out.weight
    prev = anchors
    for k in range(K):
        u = uniform(st.seeds, anchor_positions + 1 + k, STREAM_DRAFT)  # [R, 1]
        markov_sample(base[:, k], prev, w1, w2, st.temperature, u, out=tokens[:, k],
                      probs=probs[:, k])  # fmt: skip
        prev = tokens[:, k]
    return probs
