"""Small helpers shared by tests: run the model once over a prompt with a fresh KV cache."""

from __future__ import annotations

import torch

from dspark.engine.kv_cache import allocate_kv_caches, pages_for
from dspark.layers.attention_metadata import single_prefill_metadata


@torch.no_grad()
def full_logits(model, token_ids: list[int], page_size: int = 16, hidden_layers=()):
    """Logits [T, V] of every position (and optional hidden states) of one prompt."""
    cfg = model.config
    device = model.embed_tokens.weight.device
    dtype = model.embed_tokens.weight.dtype
    num_pages = pages_for(len(token_ids), page_size) + 1
    kv = allocate_kv_caches(cfg, num_pages, page_size, dtype, device)
    attn = single_prefill_metadata(len(token_ids), page_size, device)
    ids = torch.tensor(token_ids, device=device)
    positions = torch.arange(len(token_ids), device=device)
    return model(ids, positions, attn, kv, None, hidden_layers)


def chi2_critical_001(dof: int) -> float:
    """Chi-square critical value at significance 0.001 (Wilson-Hilferty, z = 3.09)."""
    return dof * (1 - 2 / (9 * dof) + 3.09 * (2 / (9 * dof)) ** 0.5) ** 3
