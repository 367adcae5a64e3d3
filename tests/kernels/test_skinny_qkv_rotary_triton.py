"""The fused norm + qkv + rotary + KV store kernel against the unfused sequence: q, the cache
(NaN-poisoned: only this step's slots may change) and the new residual.

CPU (interpreter): 3 q heads, 1 kv head, head_dim 24 (a half of 12: not a power of two, padded
to tl.dot's 16), d 72 over BLOCK_K 32 (a ragged tail). GPU: SmolLM2's 9 / 3 heads, 64, 576.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dspark.kernels.rmsnorm_triton import fused_add_rmsnorm
from dspark.kernels.rotary_triton import rotary_qkv
from dspark.kernels.skinny_gemm_triton import SkinnyConfig
from dspark.kernels.skinny_qkv_rotary_triton import qkv_rotary_ref, skinny_qkv_rotary

EPS = 1e-5
PAGE_SIZE, NUM_PAGES = 4, 6
# (num_heads, num_kv_heads, head_dim, d) and the configs tried, per device type; one row also
# runs tl.dot (it takes the GEMV by default)
SHAPES = {"cpu": (3, 1, 24, 72), "cuda": (9, 3, 64, 576)}
CONFIGS = {"cpu": [SkinnyConfig(block_k=32), SkinnyConfig(block_k=32, split_k=3)],
           "cuda": [None, SkinnyConfig(block_k=128, split_k=2)]}  # fmt: skip
ONE_ROW_DOT = SkinnyConfig(block_k=32, split_k=2, use_gemv=False)


def tolerance(dtype: torch.dtype, device: torch.device) -> dict[str, float]:
    if dtype == torch.float32:
        return {"rtol": 1e-4, "atol": 1e-4}
    # rotary adds two rounded products of values up to ~8: a bf16 ulp there is 2^-5 (one more
    # per step on the CPU, whose interpreter truncates)
    return {"rtol": 1.6e-2, "atol": 6.25e-2 if device.type == "cpu" else 3.2e-2}


def inputs(T: int, dtype: torch.dtype, device: torch.device, has_residual: bool) -> dict:
    num_heads, num_kv_heads, head_dim, d = SHAPES[device.type]
    g = torch.Generator(device=device).manual_seed(T)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(*shape, generator=g, device=device)).to(dtype)

    n = (num_heads + 2 * num_kv_heads) * head_dim
    wide = randn(T, d + 16)  # [T, d + 16]: strided rows
    slots = torch.randperm(NUM_PAGES * PAGE_SIZE, generator=g, device=device)[:T]  # [T]
    return {
        "x": wide[:, 8 : 8 + d],
        "residual": randn(T, d) if has_residual else None,
        "norm_weight": (1 + randn(d, scale=0.2).float()).to(dtype),
        "eps": EPS,
        "weight": randn(n, d, scale=d**-0.5),
        "bias": randn(n),
        "positions": torch.randint(0, 4096, (T,), generator=g, device=device),
        "inv_freq": 1.0 / (1e5 ** (torch.arange(0, head_dim, 2, device=device) / head_dim)),
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "slot_mapping": slots,
    }


def poisoned_cache(args: dict, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    head_dim = args["inv_freq"].shape[0] * 2
    shape = (2, NUM_PAGES, PAGE_SIZE, args["num_kv_heads"], head_dim)
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# the first layer (no residual yet) of a Llama; a later layer of a Qwen2 (a qkv bias)
@pytest.mark.parametrize("has_residual,has_bias", [(False, False), (True, True)])
@pytest.mark.parametrize("T", [1, 3, 16])
def test_matches_unfused_sequence(
    device: torch.device, T: int, has_residual: bool, has_bias: bool, dtype: torch.dtype
):
    args = inputs(T, dtype, device, has_residual)
    if not has_bias:
        args["bias"] = None
    residual_before = None if args["residual"] is None else args["residual"].clone()
    expected_cache = poisoned_cache(args, dtype, device)
    expected_q, expected_residual = qkv_rotary_ref(**args, kv_cache=expected_cache)
    tol = tolerance(dtype, device)
    for config in CONFIGS[device.type] + ([ONE_ROW_DOT] if T == 1 else []):
        cache = poisoned_cache(args, dtype, device)
        q, new_residual = skinny_qkv_rotary(**args, kv_cache=cache, config=config)
        torch.testing.assert_close(q, expected_q, **tol, msg=str(config))
        torch.testing.assert_close(cache, expected_cache, **tol, equal_nan=True, msg=str(config))
        if has_residual:
            torch.testing.assert_close(new_residual, expected_residual, **tol)
            assert torch.equal(args["residual"], residual_before)  # not written in place
        else:
            assert new_residual is None


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 16])  # the GEMV and tl.dot
def test_rounds_like_the_unfused_kernels_on_gpu(T: int):
    # Against fused_add_rmsnorm, a float32 GEMM rounded once, and rotary_qkv: only the order of
    # float32 additions differs, so nearly every bf16 output is bit-identical.
    device, dtype = torch.device("cuda"), torch.bfloat16
    args = inputs(T, dtype, device, has_residual=True)
    cache, expected_cache = (poisoned_cache(args, dtype, device) for _ in range(2))
    q, _ = skinny_qkv_rotary(**args, kv_cache=cache)
    h, _ = fused_add_rmsnorm(args["x"], args["residual"], args["norm_weight"], EPS)
    qkv = F.linear(h.float(), args["weight"].float(), args["bias"].float()).to(dtype)
    rotary_qkv(qkv, args["positions"], args["inv_freq"], args["num_heads"], args["num_kv_heads"],
               cache.shape[-1], expected_cache, args["slot_mapping"])  # fmt: skip
    assert (q == qkv[:, : q.shape[1]]).float().mean().item() > 0.99
    written = ~expected_cache.isnan()
    assert torch.equal(written, ~cache.isnan())
    assert (cache[written] == expected_cache[written]).float().mean().item() > 0.99


def test_no_rows(device: torch.device):
    args = inputs(0, torch.float32, device, has_residual=True)
    q, new_residual = skinny_qkv_rotary(
        **args, kv_cache=poisoned_cache(args, torch.float32, device)
    )
    assert q.shape == (0, args["num_heads"] * 2 * args["inv_freq"].shape[0])
    assert new_residual.shape == args["x"].shape
