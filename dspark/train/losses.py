"""The drafter's training losses (docs/SPECULATION.md 3.1), per supervised slot, with position
weights.

For slot k = 1..K of a block (label x_{i+k}, supervised where the prefix mask is true):
  draft_probs  = softmax(U[k] + bias(prev)), prev = the label before (teacher forcing; the anchor
                 for k = 1): the Markov-corrected draft distribution
  target_probs = softmax of the target's logits at position i + k - 1, which predict x_{i+k}
  ce           = -log draft_probs[x_{i+k}]                                        weight 0.1
  l1           = ||draft_probs - target_probs||_1 over the vocabulary              weight 0.9
  confidence   = BCE(c_raw[k], 1 - 1/2 ||draft_probs - target_probs||_1), the soft label
                 detached                                                        weight 1.0
1 - 1/2 ||d - t||_1 = sum_v min(d(v), t(v)) is exactly the probability that rejection sampling
accepts a draft drawn from d at this slot (docs/SPECULATION.md 4), given the slots before were
accepted: the conditional acceptance the confidence head predicts.

Each term is a weighted mean over supervised slots with w_k = exp(-(k-1)/4):
  term = sum_{b,k} mask w_k loss / sum_{b,k} mask w_k
so a batch of long blocks and a batch of short ones weigh their slots alike.

drafter_losses is the reference and takes the logits; chunked_drafter_losses gives the same
terms from hidden states, a chunk of slots at a time, without keeping [N K, V] tensors for
backward (vocab_loss.py): what training runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dspark.train.vocab_loss import DEFAULT_CHUNK_SLOTS, vocab_terms


@dataclass(frozen=True)
class LossWeights:
    ce: float = 0.1
    l1: float = 0.9
    confidence: float = 1.0
    position_decay: float = 4.0  # w_k = exp(-(k-1) / position_decay)


@dataclass(frozen=True)
class LossTerms:
    total: torch.Tensor  # scalar, what backward() runs on
    ce: torch.Tensor  # scalar, weighted mean
    l1: torch.Tensor
    confidence: torch.Tensor  # 0 without a confidence head
    soft_label: torch.Tensor  # [N, K] detached 1 - 1/2 L1 (conditional acceptance at T = 1)
    mask: torch.Tensor  # [N, K] the supervised slots


def position_weights(draft_len: int, decay: float = 4.0, device=None) -> torch.Tensor:
    """w_k = exp(-(k-1)/decay) for k = 1..K: [1, 0.78, 0.61, ...] for decay 4."""
    k = torch.arange(draft_len, dtype=torch.float32, device=device)
    return torch.exp(-k / decay)


def weighted_mean(values: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum(mask w v) / sum(mask w) over [N, K]; 0 when nothing is supervised."""
    w = mask.float() * weights  # [N, K]
    return (values * w).sum() / w.sum().clamp(min=1e-8)


def drafter_losses(
    draft_logits: torch.Tensor,  # [N, K, V] Markov-corrected draft logits
    target_logits: torch.Tensor,  # [N, K, V] target logits predicting the same tokens
    labels: torch.Tensor,  # [N, K] int64
    mask: torch.Tensor,  # [N, K] bool, contiguous prefix of supervised slots
    confidence_logits: torch.Tensor | None,  # [N, K] raw c logits, None: no confidence head
    weights: LossWeights = LossWeights(),
) -> LossTerms:
    K = labels.shape[-1]
    w = position_weights(K, weights.position_decay, labels.device)  # [K]
    log_draft = F.log_softmax(draft_logits.float(), dim=-1)  # [N, K, V]
    ce = -log_draft.gather(-1, labels[..., None])[..., 0]  # [N, K]
    target_probs = F.softmax(target_logits.float(), dim=-1).detach()  # the target is frozen
    l1 = (log_draft.exp() - target_probs).abs().sum(dim=-1)  # [N, K], in [0, 2]
    soft_label = (1.0 - 0.5 * l1).detach().clamp(0.0, 1.0)  # [N, K]
    ce_mean, l1_mean = weighted_mean(ce, mask, w), weighted_mean(l1, mask, w)
    total = weights.ce * ce_mean + weights.l1 * l1_mean
    slot_w = mask.float() * w / (mask.float() * w).sum().clamp(min=1e-8)  # [N, K]
    total, conf_mean = _add_confidence(total, confidence_logits, soft_label, slot_w, weights)
    return LossTerms(total, ce_mean, l1_mean, conf_mean, soft_label, mask)


def _add_confidence(
    total: torch.Tensor,
    confidence_logits: torch.Tensor | None,  # [N, K] raw c logits, None: no confidence head
    soft_label: torch.Tensor,  # [N, K] detached
    slot_weights: torch.Tensor,  # [N, K] mask * w_k / sum(mask * w_k)
    weights: LossWeights,
) -> tuple[torch.Tensor, torch.Tensor]:  # total with the confidence term, the term
    if confidence_logits is None:
        return total, torch.zeros((), device=soft_label.device)
    bce = F.binary_cross_entropy_with_logits(
        confidence_logits.float(), soft_label, reduction="none"
    )  # [N, K]
    conf_mean = (bce * slot_weights).sum()
    return total + weights.confidence * conf_mean, conf_mean


def chunked_drafter_losses(
    hidden: torch.Tensor,  # [N, K, d] drafter final hidden states
    markov_u: torch.Tensor | None,  # [N, K, r] W1[prev], None: no Markov head
    markov_w2: torch.Tensor | None,  # [V, r]
    head: torch.Tensor,  # [V, d] the frozen LM head
    target_hidden: torch.Tensor,  # [N, K, d] the target's final normed hidden states
    labels: torch.Tensor,  # [N, K] int64
    mask: torch.Tensor,  # [N, K] bool
    confidence_logits: torch.Tensor | None,  # [N, K]
    weights: LossWeights = LossWeights(),
    chunk_slots: int = DEFAULT_CHUNK_SLOTS,
) -> LossTerms:
    """drafter_losses' terms without [N K, V] tensors kept for backward (vocab_loss.py)."""
    N, K, d = hidden.shape
    w = mask.float() * position_weights(K, weights.position_decay, labels.device)  # [N, K]
    slot_w = (w / w.sum().clamp(min=1e-8)).reshape(-1)  # [N K]
    u = None if markov_u is None else markov_u.reshape(N * K, -1)
    terms = vocab_terms(
        hidden.reshape(N * K, d), u, markov_w2, head, target_hidden.reshape(N * K, d),
        labels.reshape(-1), slot_w, weights.ce, weights.l1, chunk_slots,
    )  # fmt: skip
    soft_label = terms.soft_label.view(N, K)
    total, conf_mean = _add_confidence(
        terms.loss, confidence_logits, soft_label, slot_w.view(N, K), weights
    )
    return LossTerms(total, terms.ce, terms.l1, conf_mean, soft_label, mask)


def expected_block_tokens(soft_label: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean of 1 + sum_k prod_{i<=k} acc_i over blocks whose K slots are all supervised: the
    acceptance length tau a full-block verify at temperature 1 would give on these contexts
    (teacher forcing, so an estimate, logged during training)."""
    full = mask.all(dim=-1)  # [N]
    if not bool(full.any()):  # sync: training statistics only
        return math.nan
    survival = soft_label[full].cumprod(dim=-1)  # [n, K]
    return float(1.0 + survival.sum(dim=-1).mean())  # sync: training statistics only
