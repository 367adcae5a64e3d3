"""The vocabulary-sized terms of the drafter's loss (CE and L1), a chunk of slots at a time.

`drafter_losses` (losses.py) is the reference: it materialises [N K, V] logits,
log-probabilities, probabilities and target probabilities in fp32 for autograd. At the default
batch (32 sequences x 64 blocks x 7 slots = 14,336 slots, a 49,152-token vocabulary) each is
2.8 GB, and forward + backward stream about a dozen of them. Both terms are sums over slots, so
their gradient with respect to a slot's logits is known as soon as the slot's loss is. For each
chunk of supervised slots:

    z  = h Wh^T + u W2^T     draft logits: Wh the frozen LM head, u = W1[prev] (Markov head)
    zt = ht Wh^T             target logits, from the target's final normed hidden states
    p = softmax(z), t = softmax(zt), s = sign(p - t)
    ce = -log p[y]           dce/dz   = p - onehot(y)
    l1 = sum_v |p_v - t_v|   dl1/dz_j = p_j (s_j - sum_v s_v p_v)
    dz = w (a_ce dce/dz + a_l1 dl1/dz)        w: the slot's normalised position weight
    grad_h = dz Wh,  grad_u = dz W2,  grad_W2 += dz^T u

Only grad_h, grad_u and grad_W2 are kept for backward; a chunk's [C, V] tensors are freed
before the next. Slots outside the prefix mask weigh nothing and are never computed. The soft
confidence label 1 - l1 / 2 comes out detached (0 at unsupervised slots).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

DEFAULT_CHUNK_SLOTS = 2048


@dataclass(frozen=True)
class VocabTerms:
    loss: torch.Tensor  # scalar a_ce ce + a_l1 l1, differentiable
    ce: torch.Tensor  # scalar weighted mean, detached
    l1: torch.Tensor  # scalar weighted mean, detached
    soft_label: torch.Tensor  # [M] detached 1 - l1 / 2, 0 where the slot weighs nothing


def vocab_terms(
    hidden: torch.Tensor,  # [M, d] drafter final hidden states (autograd)
    markov_u: torch.Tensor | None,  # [M, r] W1[prev] (autograd), None: no Markov head
    markov_w2: torch.Tensor | None,  # [V, r] W2 (trainable)
    head: torch.Tensor,  # [V, d] the frozen LM head
    target_hidden: torch.Tensor,  # [M, d] the target's final normed hidden states, no grad
    labels: torch.Tensor,  # [M] int64
    slot_weights: torch.Tensor,  # [M] mask * w_k / sum(mask * w_k)
    a_ce: float,
    a_l1: float,
    chunk_slots: int = DEFAULT_CHUNK_SLOTS,
) -> VocabTerms:
    """a_ce * weighted-mean CE + a_l1 * weighted-mean L1, as drafter_losses computes them."""
    if markov_u is None:
        markov_u = hidden.new_zeros(hidden.shape[0], 0)
        markov_w2 = head.new_zeros(head.shape[0], 0)
    loss, ce, l1, soft = _VocabLoss.apply(
        hidden, markov_u, markov_w2, head, target_hidden, labels, slot_weights, a_ce, a_l1,
        chunk_slots,
    )  # fmt: skip
    return VocabTerms(loss, ce, l1, soft)


class _VocabLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, u, w2, head, target_hidden, labels, slot_weights, a_ce, a_l1,
                chunk_slots):  # fmt: skip
        dtype = head.dtype  # GEMMs in the head's dtype (bf16 on the GPU), softmax math in fp32
        rows = slot_weights.nonzero()[:, 0]  # sync: the supervised slots' count sizes the loop
        grad_h = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        grad_u = torch.zeros(u.shape, dtype=torch.float32, device=u.device)
        grad_w2 = torch.zeros(w2.shape, dtype=torch.float32, device=w2.device)
        soft = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        ce_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        l1_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        w2_c = w2.to(dtype)
        for start in range(0, rows.numel(), chunk_slots):
            idx = rows[start : start + chunk_slots]  # [C]
            h, uc = hidden[idx].to(dtype), u[idx].to(dtype)  # [C, d], [C, r]
            z = (h @ head.T).float()  # [C, V]
            if uc.shape[1]:
                z += (uc @ w2_c.T).float()
            logp = F.log_softmax(z, dim=-1)
            del z
            p = logp.exp()  # [C, V]
            t = F.softmax((target_hidden[idx].to(dtype) @ head.T).float(), dim=-1)
            y = labels[idx, None]  # [C, 1]
            ce = -logp.gather(-1, y)[:, 0]  # [C]
            del logp
            diff = p - t
            del t
            l1 = diff.abs().sum(-1)  # [C]
            s = diff.sign_()  # [C, V], in place: diff is not needed again
            w = slot_weights[idx]  # [C]
            # dz = w (a_ce (p - onehot) + a_l1 p (s - <s, p>)), built in s's storage
            sp = (s * p).sum(-1, keepdim=True)  # [C, 1]
            dz = s.sub_(sp).mul_(p).mul_(a_l1).add_(p, alpha=a_ce)
            dz.scatter_add_(-1, y, torch.full_like(y, -a_ce, dtype=dz.dtype))
            dz.mul_(w[:, None])
            del p
            dz = dz.to(dtype)
            grad_h[idx] = (dz @ head).float()
            if uc.shape[1]:
                grad_u[idx] = (dz @ w2_c).float()
                grad_w2 += (dz.T @ uc).float()
            ce_sum += (w * ce).sum()
            l1_sum += (w * l1).sum()
            soft[idx] = (1.0 - 0.5 * l1).clamp(0.0, 1.0)
        ctx.save_for_backward(grad_h, grad_u, grad_w2)
        ctx.dtypes = (hidden.dtype, u.dtype, w2.dtype)
        ce_mean, l1_mean = ce_sum.detach(), l1_sum.detach()
        ctx.mark_non_differentiable(ce_mean, l1_mean, soft)
        return a_ce * ce_sum + a_l1 * l1_sum, ce_mean, l1_mean, soft

    @staticmethod
    def backward(ctx, g_loss, *_):
        grad_h, grad_u, grad_w2 = ctx.saved_tensors
        dt_h, dt_u, dt_w2 = ctx.dtypes
        return (
            (grad_h * g_loss).to(dt_h),
            (grad_u * g_loss).to(dt_u),
            (grad_w2 * g_loss).to(dt_w2),
            None, None, None, None, None, None, None,
        )  # fmt: skip
