"""The few-row GEMV (dspark/kernels/gemv_triton.py) against F.linear.

On the CPU (Triton's interpreter) the shapes are small, with K spanning several blocks and a
ragged tail of N (N 42 = 10 programs of 4 + 2) and of K; on a GPU the SmolLM2 projections
(qkv 960 x 576, o_proj 576 x 576, gate_up 3,072 x 576, down 576 x 1,536), launched with PDL
there when the device has it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dspark.kernels.gemv_triton import GEMV_MAX_ROWS, _block_k, gemv

GPU_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
CPU_SHAPES = [(42, 72), (8, 300)]


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    if dtype == torch.float32:  # only the order of float32 additions differs
        return {"rtol": 1e-4, "atol": 1e-4}
    return {"rtol": 1.6e-2, "atol": 1.6e-2}  # one bf16 rounding of O(1) outputs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, GEMV_MAX_ROWS])
def test_gemv_equals_linear(device, dtype, rows):
    shapes = GPU_SHAPES if device.type == "cuda" else CPU_SHAPES
    g = torch.Generator().manual_seed(rows)
    for n, k in shapes:
        w = (torch.randn(n, k, generator=g) / k**0.5).to(device, dtype)
        x = torch.randn(rows, k, generator=g).to(device, dtype)
        torch.testing.assert_close(gemv(x, w), F.linear(x, w), **_tolerance(dtype))


def test_gemv_strided_rows_and_bias(device):
    """Rows of a wider buffer (a view's stride) and a bias, as Qwen2's qkv has."""
    n, k = (960, 576) if device.type == "cuda" else (42, 72)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g).to(device) / k**0.5
    b = torch.randn(n, generator=g).to(device)
    wide = torch.randn(5, k + 24, generator=g).to(device)
    x = wide[:, 8 : 8 + k]  # stride(0) = k + 24
    torch.testing.assert_close(gemv(x, w, b), F.linear(x, w, b), rtol=1e-4, atol=1e-4)


def test_gemv_no_rows_and_too_many_rows(device):
    w = torch.randn(8, 16, device=device)
    assert gemv(torch.empty(0, 16, device=device), w).shape == (0, 8)
    with pytest.raises(AssertionError, match=f"at most {GEMV_MAX_ROWS}"):
        gemv(torch.randn(GEMV_MAX_ROWS + 1, 16, device=device), w)


def test_block_k_pads_k_by_at_most_an_eighth():
    assert _block_k(576, 512) == 128  # 640: 768 or 1,024 would waste a third or more
    assert _block_k(1536, 512) == 512
    assert _block_k(576, 64) == 64
    assert _block_k(48, 512) == 16
    for k in (40, 72, 300, 576, 1536, 4096):
        for cap in (64, 256, 512):
            b = _block_k(k, cap)
            assert b <= max(16, cap) and -(-k // b) * b <= k * 9 / 8 or b == 16
