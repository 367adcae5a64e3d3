"""The fused norm + gate_up + SiLU-and-mul kernel against the unfused sequence: the activation
and the new residual.

CPU (interpreter): d 72 over BLOCK_K 32 (a ragged tail), I 40 over BLOCK_N 16 (a ragged last
block). GPU: SmolLM2's d 576, I 1536. Biases are small (0.1) so the activations stay of order
1: silu(g) * u carries the rounding error of g times |u|, and the interpreter's bf16 truncation
adds up to an ulp at each of its six rounding steps.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dspark.kernels.rmsnorm_triton import fused_add_rmsnorm
from dspark.kernels.silu_mul_triton import silu_and_mul
from dspark.kernels.skinny_gate_up_silu_triton import gate_up_silu_ref, skinny_gate_up_silu
from dspark.kernels.skinny_gemm_triton import SkinnyConfig

EPS = 1e-5
SHAPES = {"cpu": (72, 40), "cuda": (576, 1536)}  # (d, I)
CONFIGS = {"cpu": [SkinnyConfig(block_k=32), SkinnyConfig(block_k=32, split_k=3)],
           "cuda": [None, SkinnyConfig(block_n=32, block_k=128, split_k=2)]}  # fmt: skip
ONE_ROW_DOT = SkinnyConfig(block_k=32, split_k=2, use_gemv=False)  # one row takes the GEMV


def tolerance(dtype: torch.dtype, device: torch.device) -> dict[str, float]:
    if dtype == torch.float32:
        return {"rtol": 1e-4, "atol": 1e-4}
    return {"rtol": 3.2e-2 if device.type == "cpu" else 1.6e-2, "atol": 6.25e-2}


def inputs(T: int, dtype: torch.dtype, device: torch.device, has_residual: bool) -> dict:
    d, inter = SHAPES[device.type]
    g = torch.Generator(device=device).manual_seed(T)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(*shape, generator=g, device=device)).to(dtype)

    return {
        "x": randn(T, d + 16)[:, 8 : 8 + d],  # strided rows
        "residual": randn(T, d) if has_residual else None,
        "norm_weight": (1 + randn(d, scale=0.2).float()).to(dtype),
        "eps": EPS,
        "weight": randn(2 * inter, d, scale=d**-0.5),
        "bias": randn(2 * inter, scale=0.1),
    }


# a later layer of a Qwen2-like MLP with a bias; no residual (a stream of x alone), no bias
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("has_residual,has_bias", [(True, True), (False, False)])
@pytest.mark.parametrize("T", [1, 3, 16])
def test_matches_unfused_sequence(
    device: torch.device, T: int, has_residual: bool, has_bias: bool, dtype: torch.dtype
):
    args = inputs(T, dtype, device, has_residual)
    if not has_bias:
        args["bias"] = None
    residual_before = None if args["residual"] is None else args["residual"].clone()
    expected_act, expected_residual = gate_up_silu_ref(**args)
    for config in CONFIGS[device.type] + ([ONE_ROW_DOT] if T == 1 else []):
        act, new_residual = skinny_gate_up_silu(**args, config=config)
        torch.testing.assert_close(act, expected_act, **tolerance(dtype, device), msg=str(config))
        if has_residual:
            torch.testing.assert_close(new_residual, expected_residual, **tolerance(dtype, device))
            assert torch.equal(args["residual"], residual_before)  # not written in place
        else:
            assert new_residual is None


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 16])
def test_rounds_like_the_unfused_kernels_on_gpu(T: int):
    # Against fused_add_rmsnorm, a float32 GEMM rounded once, and silu_and_mul: only the order
    # of float32 additions differs, so nearly every bf16 output is bit-identical.
    device, dtype = torch.device("cuda"), torch.bfloat16
    args = inputs(T, dtype, device, has_residual=True)
    act, _ = skinny_gate_up_silu(**args)
    h, _ = fused_add_rmsnorm(args["x"], args["residual"], args["norm_weight"], EPS)
    gate_up = F.linear(h.float(), args["weight"].float(), args["bias"].float()).to(dtype)
    assert (act == silu_and_mul(gate_up)).float().mean().item() > 0.99


def test_no_rows(device: torch.device):
    args = inputs(0, torch.float32, device, has_residual=True)
    act, new_residual = skinny_gate_up_silu(**args)
    assert act.shape == (0, SHAPES[device.type][1]) and new_residual.shape == args["x"].shape
