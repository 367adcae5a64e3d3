"""Small helpers shared by tests: run the model once over a prompt with a fresh KV cache."""

from __future__ import annotations

import torch

from dspark.engine.kv_cache import allocate_kv_caches, pages_for
from dspark.layers.attention_metadata import AttentionMetadata


def single_prefill_metadata(num_tokens: int, page_size: int) -> AttentionMetadata:
    """One request prefilling `num_tokens` tokens into pages 1, 2, ... (page 0 is scratch)."""
    pages = list(range(1, pages_for(num_tokens, page_size) + 1))
    slots = [pages[p // page_size] * page_size + p % page_size for p in range(num_tokens)]
    return AttentionMetadata(
        cu_num_tokens=torch.tensor([0, num_tokens], dtype=torch.int32),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_table=torch.tensor([pages], dtype=torch.int32),
        cu_num_tokens_cpu=(0, num_tokens),
        seq_lens_cpu=(num_tokens,),
    )


@torch.no_grad()
def full_logits(model, token_ids: list[int], page_size: int = 16, hidden_layers=()):
    """Logits [T, V] of every position (and optional hidden states) of one prompt."""
    cfg = model.config
    num_pages = pages_for(len(token_ids), page_size) + 1
    kv = allocate_kv_caches(cfg, num_pages, page_size, torch.float32, torch.device("cpu"))
    attn = single_prefill_metadata(len(token_ids), page_size)
    ids = torch.tensor(token_ids)
    return model(ids, torch.arange(len(token_ids)), attn, kv, None, hidden_layers)
