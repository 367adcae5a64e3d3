"""The fused elementwise kernels (RMSNorm, add + RMSNorm, rotary, SiLU-and-mul) against their
PyTorch references, on random data, with NaN-poisoned outputs so a missed element shows.

On the CPU the kernels run in Triton's interpreter (tests/kernels/conftest.py sets it up), so the
shapes stay small there. The interpreter rounds float32 -> bfloat16 by truncation where GPUs
round to nearest even, so each bf16 rounding step of a kernel may land one ulp away from the
reference on the CPU: the CPU bf16 tolerance allows for it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dspark.kernels.rmsnorm_triton import (
    fused_add_rmsnorm,
    fused_add_rmsnorm_ref,
    rmsnorm,
    rmsnorm_ref,
)
from dspark.kernels.rotary_triton import apply_rotary, apply_rotary_ref, rotary_qkv
from dspark.kernels.silu_mul_triton import silu_and_mul, silu_and_mul_ref
from dspark.layers.norm import RMSNorm
from dspark.layers.rotary import RotaryEmbedding
from dspark.models.model_config import ModelConfig

EPS = 1e-5
DTYPES = [torch.float32, torch.bfloat16]
# (num_tokens, width, is_strided): width is d for the norms, I for SiLU-and-mul
ROW_CASES = [(1, 576, False), (3, 576, True), (3, 64, False), (257, 64, True)]
# (num_tokens, num_heads, num_kv_heads, head_dim); hd/2 = 12 is not a power of two
ROTARY_CASES = [(1, 9, 3, 64), (3, 9, 3, 64), (257, 2, 1, 8), (3, 5, 1, 24)]


def tolerance(dtype: torch.dtype, device: torch.device) -> dict[str, float]:
    if dtype == torch.float32:
        return {"rtol": 1e-5, "atol": 1e-5}
    # Rotary adds two rounded products: with operands up to ~8, one bf16 ulp of each is 2^-5.
    return {"rtol": 1.6e-2, "atol": 6.25e-2 if device.type == "cpu" else 3.2e-2}


def rows(
    T: int, d: int, dtype: torch.dtype, device: torch.device, is_strided: bool
) -> torch.Tensor:  # [T, d] of random values; a column window of a wider buffer when strided
    if not is_strided:
        return (2 * torch.randn(T, d, device=device)).to(dtype)
    wide = (2 * torch.randn(T, d + 40, device=device)).to(dtype)  # [T, d + 40]
    return wide[:, 8 : 8 + d]


def poisoned(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def norm_weight(d: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:  # [d]
    return (1 + 0.2 * torch.randn(d, device=device)).to(dtype)


def inv_freq(head_dim: int, device: torch.device) -> torch.Tensor:  # [hd/2] float32
    return 1.0 / (1e5 ** (torch.arange(0, head_dim, 2, device=device) / head_dim))


def random_positions(T: int, device: torch.device) -> torch.Tensor:  # [T] int64
    return torch.randint(0, 4096, (T,), device=device)


# -- RMSNorm ---------------------------------------------------------------------------------


def test_rmsnorm_ref_is_the_layer():
    layer = RMSNorm(64, EPS)
    layer.weight.data = norm_weight(64, torch.bfloat16, torch.device("cpu"))
    layer.to(torch.bfloat16)
    x = rows(5, 64, torch.bfloat16, torch.device("cpu"), False)
    assert torch.equal(rmsnorm_ref(x, layer.weight.data, EPS), layer(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,d,is_strided", ROW_CASES)
def test_rmsnorm(device: torch.device, T: int, d: int, is_strided: bool, dtype: torch.dtype):
    x = rows(T, d, dtype, device, is_strided)  # [T, d]
    weight = norm_weight(d, dtype, device)  # [d]
    out = rmsnorm(x, weight, EPS, out=poisoned((T, d), dtype, device))
    torch.testing.assert_close(out, rmsnorm_ref(x, weight, EPS), **tolerance(dtype, device))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,d,is_strided", ROW_CASES)
def test_fused_add_rmsnorm(
    device: torch.device, T: int, d: int, is_strided: bool, dtype: torch.dtype
):
    x, residual = rows(T, d, dtype, device, is_strided), rows(T, d, dtype, device, is_strided)
    weight = norm_weight(d, dtype, device)
    out, new_residual = fused_add_rmsnorm(
        x, residual, weight, EPS,
        out=poisoned((T, d), dtype, device), residual_out=poisoned((T, d), dtype, device),
    )  # fmt: skip
    expected_out, expected_residual = fused_add_rmsnorm_ref(x, residual, weight, EPS)
    torch.testing.assert_close(out, expected_out, **tolerance(dtype, device))
    torch.testing.assert_close(new_residual, expected_residual, **tolerance(dtype, device))


def test_fused_add_rmsnorm_in_place(device: torch.device):
    # out aliasing x and residual_out aliasing residual: the decoder's in-place use
    x, residual = rows(3, 64, torch.float32, device, True), rows(3, 64, torch.float32, device, True)
    weight = norm_weight(64, torch.float32, device)
    expected_out, expected_residual = fused_add_rmsnorm_ref(x, residual, weight, EPS)
    out, new_residual = fused_add_rmsnorm(x, residual, weight, EPS, out=x, residual_out=residual)
    assert out.data_ptr() == x.data_ptr() and new_residual.data_ptr() == residual.data_ptr()
    torch.testing.assert_close(x, expected_out, **tolerance(torch.float32, device))
    torch.testing.assert_close(residual, expected_residual, **tolerance(torch.float32, device))


def test_rmsnorm_float32_weight_promotes(device: torch.device):
    # weight * x_normed promotes, as in eager: a float32 weight on bf16 rows gives float32
    x = rows(3, 64, torch.bfloat16, device, False)
    weight = norm_weight(64, torch.float32, device)
    out = rmsnorm(x, weight, EPS)
    assert out.dtype == torch.float32
    # the normed row is still rounded to bf16 before the weight multiplies it
    torch.testing.assert_close(out, rmsnorm_ref(x, weight, EPS), **tolerance(x.dtype, device))


# -- rotary ----------------------------------------------------------------------------------


def test_rotary_ref_is_the_layer():
    config = ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=8, hidden_size=96, intermediate_size=8,
        num_layers=1, num_heads=3, num_kv_heads=1, head_dim=32, rms_norm_eps=EPS,
        rope_theta=1e5, max_position_embeddings=4096, tie_word_embeddings=False,
        attention_bias=False,
    )  # fmt: skip
    rotary = RotaryEmbedding(config)
    q = torch.randn(7, 3, 32).to(torch.bfloat16)  # [T, nh, hd]
    k = torch.randn(7, 1, 32).to(torch.bfloat16)  # [T, nkv, hd]
    positions = random_positions(7, torch.device("cpu"))
    expected_q, expected_k = rotary(positions, q, k)
    got_q, got_k = apply_rotary_ref(q, k, positions, rotary.inv_freq)
    assert torch.equal(got_q, expected_q) and torch.equal(got_k, expected_k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,num_heads,num_kv_heads,head_dim", ROTARY_CASES)
def test_rotary_qkv(
    device: torch.device,
    T: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
):
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    width = q_size + 2 * kv_size
    wide = (2 * torch.randn(T, width + 16, device=device)).to(dtype)  # [T, width + 16]
    wide[:, width:] = float("nan")  # past the row: must stay NaN and must not leak in
    qkv = wide[:, :width]  # [T, width], row stride width + 16
    positions, freqs = random_positions(T, device), inv_freq(head_dim, device)
    q = qkv[:, :q_size].unflatten(1, (num_heads, head_dim)).clone()  # [T, nh, hd]
    k = qkv[:, q_size : q_size + kv_size].unflatten(1, (num_kv_heads, head_dim)).clone()
    v = qkv[:, q_size + kv_size :].clone()  # [T, kv_size]
    expected_q, expected_k = apply_rotary_ref(q, k, positions, freqs)

    rotary_qkv(qkv, positions, freqs, num_heads, num_kv_heads, head_dim)
    tol = tolerance(dtype, device)
    torch.testing.assert_close(qkv[:, :q_size], expected_q.flatten(1), **tol)
    torch.testing.assert_close(qkv[:, q_size : q_size + kv_size], expected_k.flatten(1), **tol)
    assert torch.equal(qkv[:, q_size + kv_size :], v) and wide[:, width:].isnan().all()


def test_apply_rotary_strided_heads(device: torch.device):
    # q stored head-major ([nh, T, hd] transposed), k token-major; int32 positions
    T, num_heads, num_kv_heads, head_dim = 5, 3, 2, 16
    q = torch.randn(num_heads, T, head_dim, device=device).transpose(0, 1)  # [T, nh, hd]
    k = torch.randn(T, num_kv_heads, head_dim, device=device)  # [T, nkv, hd]
    positions = random_positions(T, device).to(torch.int32)
    freqs = inv_freq(head_dim, device)
    expected_q, expected_k = apply_rotary_ref(q, k, positions, freqs)
    apply_rotary(q, k, positions, freqs)
    torch.testing.assert_close(q, expected_q, **tolerance(torch.float32, device))
    torch.testing.assert_close(k, expected_k, **tolerance(torch.float32, device))


# -- SiLU-and-mul ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,inter,is_strided", ROW_CASES + [(3, 1536, True)])
def test_silu_and_mul(
    device: torch.device, T: int, inter: int, is_strided: bool, dtype: torch.dtype
):
    gate_up = rows(T, 2 * inter, dtype, device, is_strided)  # [T, 2I]
    out = silu_and_mul(gate_up, out=poisoned((T, inter), dtype, device))
    torch.testing.assert_close(out, silu_and_mul_ref(gate_up), **tolerance(dtype, device))


def test_silu_and_mul_ref_is_the_mlp():
    gate_up = torch.randn(4, 32).to(torch.bfloat16)  # [T, 2I]
    gate, up = gate_up.split(16, dim=-1)
    assert torch.equal(silu_and_mul_ref(gate_up), F.silu(gate) * up)


# -- edges -----------------------------------------------------------------------------------


def test_allocating_calls(device: torch.device):
    x = rows(3, 64, torch.float32, device, False)
    weight = norm_weight(64, torch.float32, device)
    tol = tolerance(torch.float32, device)
    torch.testing.assert_close(rmsnorm(x, weight, EPS), rmsnorm_ref(x, weight, EPS), **tol)
    out, new_residual = fused_add_rmsnorm(x, 2 * x, weight, EPS)
    torch.testing.assert_close(out, rmsnorm_ref(3 * x, weight, EPS), **tol)
    torch.testing.assert_close(new_residual, 3 * x, **tol)
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_ref(x), **tol)


def test_no_tokens(device: torch.device):
    empty = torch.empty(0, 64, device=device)
    weight = norm_weight(64, torch.float32, device)
    assert rmsnorm(empty, weight, EPS).shape == (0, 64)
    assert [t.shape for t in fused_add_rmsnorm(empty, empty, weight, EPS)] == [(0, 64)] * 2
    assert silu_and_mul(empty).shape == (0, 32)
    qkv = torch.empty(0, 3 * 16, device=device)
    rotary_qkv(
        qkv, torch.empty(0, dtype=torch.int64, device=device), inv_freq(16, device), 1, 1, 16
    )


def assert_matches_eager(got: torch.Tensor, expected: torch.Tensor) -> None:
    # Compiled, the kernels round like the eager ops: nearly every element is bit-identical
    # (the norms' reductions sum in another order, so a few may sit one ulp away).
    torch.testing.assert_close(got, expected, **tolerance(got.dtype, got.device))
    assert (got == expected).float().mean().item() > 0.999


@pytest.mark.gpu
def test_smollm2_shapes_on_gpu():
    # Full-size SmolLM2 shapes at a prefill-sized T, compiled kernels only.
    device, dtype, T = torch.device("cuda"), torch.bfloat16, 2048
    x, residual = rows(T, 576, dtype, device, False), rows(T, 576, dtype, device, False)
    weight = norm_weight(576, dtype, device)
    assert_matches_eager(rmsnorm(x, weight, EPS), rmsnorm_ref(x, weight, EPS))
    got, expected = (
        fused_add_rmsnorm(x, residual, weight, EPS),
        fused_add_rmsnorm_ref(x, residual, weight, EPS),
    )
    assert_matches_eager(got[0], expected[0])
    assert_matches_eager(got[1], expected[1])
    gate_up = rows(T, 2 * 1536, dtype, device, False)
    assert_matches_eager(silu_and_mul(gate_up), silu_and_mul_ref(gate_up))
    qkv = rows(T, 960, dtype, device, False)
    positions, freqs = random_positions(T, device), inv_freq(64, device)
    q, k = qkv[:, :576].unflatten(1, (9, 64)), qkv[:, 576:768].unflatten(1, (3, 64))
    expected_q, expected_k = apply_rotary_ref(q, k, positions, freqs)
    rotary_qkv(qkv, positions, freqs, 9, 3, 64)
    assert_matches_eager(qkv[:, :576], expected_q.flatten(1))
    assert_matches_eager(qkv[:, 576:768], expected_k.flatten(1))
