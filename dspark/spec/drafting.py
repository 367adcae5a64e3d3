"""Drafting one block: the Markov head's left-to-right loop over the K slots of every row.

The backbone gives base logits U[k] for all K slots in one forward; the Markov head then makes
slot k depend on the token drafted at slot k - 1: logits_k = U[k] + bias(x[k-1]), x[0] = anchor.
Each row samples with its own parameters (temperature, top-k, top-p; greedy = argmax), and the
exact distribution each draft was drawn from is kept: verification needs draft_probs. The raw
confidence logit of slot k is computed from h[k] and x[k-1] only, before x[k] exists.

Randomness: the draft at position t (= anchor_pos + 1 + k) uses STREAM_DRAFT at t, a pure
function of (seed, position), like every other random number in the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.models.dspark_drafter import DSparkDrafter
from dspark.sample.random import STREAM_DRAFT, uniform
from dspark.sample.sampler import SamplingTensors, sampling_probs


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
) -> DraftBlock:
    R, K, _ = hidden.shape
    base = drafter.base_logits(hidden)  # [R, K, V]
    tokens = torch.empty(R, K, dtype=torch.int64, device=hidden.device)
    # a batch of greedy rows needs no distributions: greedy verification compares argmaxes
    probs = None if st.all_greedy else torch.empty_like(base)
    has_conf = drafter.confidence is not None
    conf = torch.empty(R, K, device=hidden.device) if has_conf else None
    prev = anchors
    is_greedy = st.temperature == 0
    for k in range(K):
        if has_conf:
            conf[:, k] = drafter.confidence_logit(hidden[:, k], prev)  # before x[k] is drawn
        logits = base[:, k] + drafter.markov_bias(prev)  # [R, V]
        if st.all_greedy:
            tokens[:, k] = logits.argmax(dim=-1)
        else:
            p = sampling_probs(logits, st)  # [R, V]
            u = uniform(st.seeds, anchor_positions + 1 + k, STREAM_DRAFT, p.shape[-1])
            sampled = (p / -torch.log(u)).argmax(dim=-1)  # exponential race: a draw from p
            tokens[:, k] = torch.where(is_greedy, logits.argmax(dim=-1), sampled)
            probs[:, k] = p
        prev = tokens[:, k]
    return DraftBlock(tokens, probs, conf)
