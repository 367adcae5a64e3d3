"""The PyTorch paged attention reference against dense causal attention, over ragged batches."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from dspark.attention_metadata import AttentionMetadata
from dspark.kernels.paged_attention_ref import paged_attention_ref, store_kv_ref


def _ragged_batch(q_lens, kv_lens, page_size, nh, nkv, hd, seed=0):
    """Random K/V for whole sequences, scattered into shuffled pages; queries for the tails."""
    g = torch.Generator().manual_seed(seed)
    total_pages = sum(-(-n // page_size) for n in kv_lens) + 1
    perm = (torch.randperm(total_pages - 1, generator=g) + 1).tolist()  # page 0 is scratch
    kv_cache = torch.randn(2, total_pages, page_size, nkv, hd, generator=g)
    tables, dense_k, dense_v = [], [], []
    for kv_len in kv_lens:
        n = -(-kv_len // page_size)
        pages, perm = perm[:n], perm[n:]
        tables.append(pages)
        k, v = torch.randn(kv_len, nkv, hd, generator=g), torch.randn(kv_len, nkv, hd, generator=g)
        slots = torch.tensor(
            [pages[p // page_size] * page_size + p % page_size for p in range(kv_len)]
        )
        store_kv_ref(k, v, kv_cache, slots)
        dense_k.append(k)
        dense_v.append(v)
    width = max(len(t) for t in tables)
    cu = [0]
    for q_len in q_lens:
        cu.append(cu[-1] + q_len)
    attn = AttentionMetadata(
        cu_num_tokens=torch.tensor(cu, dtype=torch.int32),
        seq_lens=torch.tensor(kv_lens, dtype=torch.int32),
        slot_mapping=torch.zeros(cu[-1], dtype=torch.int64),
        block_table=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        cu_num_tokens_cpu=tuple(cu),
        seq_lens_cpu=tuple(kv_lens),
    )
    q = torch.randn(cu[-1], nh, hd, generator=g)
    return q, kv_cache, attn, dense_k, dense_v


def _dense_causal(q, k, v, scale):
    # q [L, nh, hd] are the last L positions of a sequence with keys k [S, nkv, hd]
    L, nh, _ = q.shape
    S, nkv, _ = k.shape
    k = k.repeat_interleave(nh // nkv, dim=1)
    v = v.repeat_interleave(nh // nkv, dim=1)
    scores = torch.einsum("lhd,shd->hls", q, k) * scale  # [nh, L, S]
    q_pos = torch.arange(S - L, S)[:, None]
    scores = scores.masked_fill(torch.arange(S)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hls,shd->lhd", scores.softmax(-1), v)


@pytest.mark.parametrize(
    "q_lens,kv_lens,page_size",
    [
        ([7], [7], 4),  # one prefill, crosses page boundaries
        ([3, 1, 2], [10, 5, 2], 4),  # the worked example: chunk, decode, window
        ([1, 1, 1, 1], [1, 16, 17, 33], 16),  # decode at page boundaries
        ([0, 5, 1], [4, 9, 1], 4),  # a request with no query tokens this step
        ([8, 8], [8, 40], 16),  # a whole-prompt prefill next to a verify-sized window
    ],
)
@pytest.mark.parametrize("nh,nkv", [(4, 4), (6, 2)])
def test_paged_attention_matches_dense(q_lens, kv_lens, page_size, nh, nkv):
    hd = 16
    q, kv_cache, attn, ks, vs = _ragged_batch(q_lens, kv_lens, page_size, nh, nkv, hd)
    scale = 1 / math.sqrt(hd)
    out = paged_attention_ref(q, kv_cache, attn, scale)
    cu = attn.cu_num_tokens_cpu
    for r in range(len(q_lens)):
        if q_lens[r] == 0:
            continue
        expected = _dense_causal(q[cu[r] : cu[r + 1]], ks[r], vs[r], scale)
        torch.testing.assert_close(out[cu[r] : cu[r + 1]], expected, atol=1e-5, rtol=1e-5)


def test_store_kv_writes_only_its_slots():
    kv_cache = torch.zeros(2, 3, 4, 1, 2)
    k = torch.ones(2, 1, 2)
    store_kv_ref(k, 2 * k, kv_cache, torch.tensor([5, 11]))
    flat_k, flat_v = kv_cache[0].view(-1, 1, 2), kv_cache[1].view(-1, 1, 2)
    assert flat_k[[5, 11]].eq(1).all() and flat_v[[5, 11]].eq(2).all()
    assert flat_k.abs().sum() == 4  # nothing else written


def test_non_causal_sees_every_key_of_its_request():
    hd = 16
    q, kv_cache, attn, ks, vs = _ragged_batch([4, 2], [9, 6], 4, 4, 2, hd)
    attn = dataclasses.replace(attn, causal=False)
    out = paged_attention_ref(q, kv_cache, attn, 1 / math.sqrt(hd))
    for r, (start, end) in enumerate([(0, 4), (4, 6)]):
        k = ks[r].repeat_interleave(2, dim=1)
        v = vs[r].repeat_interleave(2, dim=1)
        scores = torch.einsum("lhd,shd->hls", q[start:end], k) / math.sqrt(hd)
        expected = torch.einsum("hls,shd->lhd", scores.softmax(-1), v)
        torch.testing.assert_close(out[start:end], expected, atol=1e-5, rtol=1e-5)
