"""Triton scatter of this step's K/V into the paged cache: the fast twin of `store_kv_ref`.

One program per token copies its [nkv, hd] K and V rows to slot_mapping[t]. Slots are read on
the device, so a CUDA graph can replay it; every slot must be a real one (pad rows write to the
scratch page, see dspark/engine/kv_cache.py), there is no skip sentinel.

Under TRITON_INTERPRET=1 (CPU tensors) it runs in Triton's interpreter; set the variable before
this module is imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    s_kt, s_kh, s_vt, s_vh, s_cp, s_cs, s_ch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    # Element i of a token's [nkv, hd] row is head i // HEAD_DIM, dim i % HEAD_DIM; the slot
    # splits into page and offset. PAGE_SIZE 16, slot 37 -> page 2, offset 5.
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok)
    page, offset = slot // PAGE_SIZE, slot % PAGE_SIZE
    i = tl.arange(0, BLOCK)
    head, dim = i // HEAD_DIM, i % HEAD_DIM
    mask = i < NUM_KV_HEADS * HEAD_DIM
    dst = page * s_cp + offset * s_cs + head * s_ch + dim
    k = tl.load(k_ptr + tok * s_kt + head * s_kh + dim, mask=mask)
    v = tl.load(v_ptr + tok * s_vt + head * s_vh + dim, mask=mask)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def store_kv_triton(
    k: torch.Tensor,  # [T, nkv, hd]
    v: torch.Tensor,  # [T, nkv, hd]
    kv_cache: torch.Tensor,  # [2, num_pages, page_size, nkv, hd]
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    T, num_kv_heads, head_dim = k.shape
    assert v.shape == k.shape and kv_cache.shape[3:] == k.shape[1:], (k.shape, kv_cache.shape)
    assert k.dtype == v.dtype == kv_cache.dtype, (k.dtype, v.dtype, kv_cache.dtype)
    assert k.stride(2) == 1 and v.stride(2) == 1 and kv_cache.stride(4) == 1
    if T == 0:
        return
    _store_kv_kernel[(T,)](
        k, v, kv_cache[0], kv_cache[1], slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, PAGE_SIZE=kv_cache.shape[2],
        BLOCK=triton.next_power_of_2(num_kv_heads * head_dim),
    )  # fmt: skip
