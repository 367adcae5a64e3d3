"""store_kv_triton against store_kv_ref: a NaN-poisoned cache must come out bit-identical."""

from __future__ import annotations

import pytest
import torch

from dspark.kernels.paged_attention_ref import store_kv_ref
from dspark.kernels.store_kv_triton import store_kv_triton

SHAPES = {  # device -> (num_kv_heads, head_dim, num_tokens of the "many" case)
    "cpu": (2, 16, 40),
    "cuda": (3, 64, 2048),
}


def make_cache(
    num_pages: int, page_size: int, nkv: int, hd: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:  # [2, num_pages, page_size, nkv, hd], NaN everywhere
    return torch.full((2, num_pages, page_size, nkv, hd), float("nan"), dtype=dtype, device=device)


def check_store(
    k: torch.Tensor,  # [T, nkv, hd]
    v: torch.Tensor,  # [T, nkv, hd]
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    expected = kv_cache.clone()
    store_kv_ref(k, v, expected, slot_mapping)
    store_kv_triton(k, v, kv_cache, slot_mapping)
    torch.testing.assert_close(kv_cache, expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("case", ["one_token", "many_tokens"])
def test_matches_reference(device: torch.device, case: str, page_size: int, dtype: torch.dtype):
    nkv, hd, many = SHAPES[device.type]
    num_tokens = 1 if case == "one_token" else many
    num_pages = -(-num_tokens // page_size) * 2 + 1
    # distinct random slots spread over shuffled pages, crossing page boundaries
    slots = torch.randperm(num_pages * page_size)[:num_tokens].to(device)  # [T]
    k = torch.randn(num_tokens, nkv, hd, device=device).to(dtype)  # [T, nkv, hd]
    v = torch.randn(num_tokens, nkv, hd, device=device).to(dtype)
    check_store(k, v, make_cache(num_pages, page_size, nkv, hd, dtype, device), slots)


def test_no_tokens(device: torch.device):
    kv_cache = make_cache(3, 4, 2, 16, torch.float32, device)
    empty = torch.empty(0, 2, 16, device=device)
    store_kv_triton(empty, empty, kv_cache, torch.empty(0, dtype=torch.int64, device=device))
    assert kv_cache.isnan().all()


def test_strided_k_v_from_fused_qkv(device: torch.device):
    # k and v as views of a [T, (nh + 2 nkv) hd] projection, as Attention.forward produces them
    T, nh, nkv, hd = 9, 6, 2, 32
    qkv = torch.randn(T, (nh + 2 * nkv) * hd, device=device)
    k = qkv[:, nh * hd : (nh + nkv) * hd].view(T, nkv, hd)  # [T, nkv, hd], row stride != nkv hd
    v = qkv[:, (nh + nkv) * hd :].view(T, nkv, hd)
    slots = torch.tensor([5, 6, 7, 8, 9, 20, 21, 0, 3], device=device)
    check_store(k, v, make_cache(6, 4, nkv, hd, torch.float32, device), slots)
