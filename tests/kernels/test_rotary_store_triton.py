"""rotary_qkv with a KV cache: rotates in place and writes K/V exactly as store_kv_ref would."""

from __future__ import annotations

import pytest
import torch

from dspark.kernels.paged_attention_ref import store_kv_ref
from dspark.kernels.rotary_triton import apply_rotary_ref, rotary_kv, rotary_qkv


@pytest.mark.parametrize("num_tokens", [1, 5])
def test_rotary_qkv_stores_rotated_k_and_v(device, num_tokens):
    nh, nkv, hd, ps, pages = 6, 2, 16, 4, 5
    g = torch.Generator().manual_seed(num_tokens)
    qkv = torch.randn(num_tokens, (nh + 2 * nkv) * hd, generator=g).to(device)
    positions = torch.randint(0, 50, (num_tokens,), generator=g).to(device)
    slots = torch.randperm(pages * ps, generator=g)[:num_tokens].to(device)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)).to(device)
    cache = torch.full((2, pages, ps, nkv, hd), float("nan"), device=device)
    expected_cache = cache.clone()
    q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
    q_ref, k_ref = apply_rotary_ref(q.reshape(-1, nh, hd), k.reshape(-1, nkv, hd), positions,
                                    inv_freq)  # fmt: skip
    store_kv_ref(k_ref, v.reshape(-1, nkv, hd), expected_cache, slots)
    v_before = v.clone()
    rotary_qkv(qkv, positions, inv_freq, nh, nkv, hd, cache, slots)
    torch.testing.assert_close(qkv[:, : nh * hd].reshape(-1, nh, hd), q_ref)
    torch.testing.assert_close(cache, expected_cache, equal_nan=True)
    assert torch.equal(qkv[:, (nh + nkv) * hd :], v_before)


@pytest.mark.parametrize("num_tokens", [1, 6])
def test_rotary_kv_stores_the_context_keys_as_the_reference(device, num_tokens):
    """rotary_kv (no query heads): the cache gets rotated k and v, as the eager store does."""
    nkv, hd, ps, pages = 3, 16, 4, 5
    g = torch.Generator().manual_seed(10 + num_tokens)
    kv = torch.randn(num_tokens, 2 * nkv * hd, generator=g).to(device)
    positions = torch.randint(0, 50, (num_tokens,), generator=g).to(device)
    slots = torch.randperm(pages * ps, generator=g)[:num_tokens].to(device)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)).to(device)
    cache = torch.full((2, pages, ps, nkv, hd), float("nan"), device=device)
    expected_cache = cache.clone()
    k, v = (x.reshape(-1, nkv, hd) for x in kv.split([nkv * hd, nkv * hd], dim=-1))
    _, k_ref = apply_rotary_ref(k, k, positions, inv_freq)
    store_kv_ref(k_ref, v, expected_cache, slots)
    rotary_kv(kv, positions, inv_freq, nkv, hd, cache, slots)
    torch.testing.assert_close(cache, expected_cache, equal_nan=True)
    torch.testing.assert_close(kv[:, : nkv * hd].reshape(-1, nkv, hd), k_ref)  # k in place
