"""Pure-PyTorch ragged paged attention: the reference every faster kernel is tested against.

Runs on the CPU and the GPU. It loops over requests on the host, gathers each request's KV
from its pages, and applies a causal-within-request mask. The KV lengths and the windows come
from the device tensors, not the host mirrors: a mirror may be an upper bound (a window whose
anchor position was written on the device, or whose verify length was chosen there;
docs/SPECULATION.md 8).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dspark.attention_metadata import AttentionMetadata


def store_kv_ref(
    k: torch.Tensor,  # [T, nkv, hd]
    v: torch.Tensor,  # [T, nkv, hd]
    kv_cache: torch.Tensor,  # [2, num_pages, page_size, nkv, hd]
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    nkv, hd = k.shape[1:]
    kv_cache[0].view(-1, nkv, hd)[slot_mapping] = k
    kv_cache[1].view(-1, nkv, hd)[slot_mapping] = v


def paged_attention_ref(
    q: torch.Tensor,  # [T, nh, hd]
    kv_cache: torch.Tensor,  # [2, num_pages, page_size, nkv, hd]
    attn: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, nh, hd]
    num_heads = q.shape[1]
    page_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    out = torch.empty_like(q)
    # sync: the reference loops on the host (free on the CPU; on a GPU it is the oracle, not a
    # fast path, and never runs inside a captured graph)
    R = attn.num_reqs
    lens = torch.cat([attn.cu_num_tokens[: R + 1], attn.seq_lens[:R]]).tolist()
    cu, seq_lens = lens[: R + 1], lens[R + 1 :]
    for r, kv_len in enumerate(seq_lens):
        start, end = cu[r], cu[r + 1]
        q_len = end - start
        if q_len == 0:
            continue
        num_pages = -(-kv_len // page_size)
        pages = attn.block_table[r, :num_pages].long()
        k = kv_cache[0, pages].reshape(-1, num_kv_heads, q.shape[2])[:kv_len]  # [S, nkv, hd]
        v = kv_cache[1, pages].reshape(-1, num_kv_heads, q.shape[2])[:kv_len]
        # query j sits at position kv_len - q_len + j and sees keys 0 .. that position
        q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)[:, None]  # [L, 1]
        k_pos = torch.arange(kv_len, device=q.device)[None, :]  # [1, S]
        mask = (k_pos <= q_pos) if attn.causal else torch.ones_like(k_pos <= q_pos)  # [L, S]
        group = num_heads // num_kv_heads
        qh = q[start:end].transpose(0, 1)  # [nh, L, hd]
        kh = k.transpose(0, 1).repeat_interleave(group, dim=0)  # [nh, S, hd]
        vh = v.transpose(0, 1).repeat_interleave(group, dim=0)
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
        out[start:end] = o.transpose(0, 1)
    return out
