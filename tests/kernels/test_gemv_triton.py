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

from dspark.kernels.gemv_triton import GEMV_MAX_ROWS, GemvConfig, default_config, gemv
from dspark.layers import linear

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


@pytest.mark.parametrize(
    "config",
    [GemvConfig(4, 32, 2), GemvConfig(1, 64, 4), GemvConfig(8, 16, 1), GemvConfig(2, 64, 1)],
)  # fmt: skip
def test_gemv_other_tiles(device, config):
    """Tiles other than the default at one row and at several (the W tile held in registers
    across rows): K 72 = 32 + 32 + 8 and N 42 = 10 x 4 + 2 on the CPU."""
    n, k = (960, 576) if device.type == "cuda" else (42, 72)
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(device)
    for rows in (1, 3, GEMV_MAX_ROWS):
        x = torch.randn(rows, k, generator=g).to(device)
        torch.testing.assert_close(gemv(x, w, config=config), F.linear(x, w), rtol=1e-4, atol=1e-4)


def test_gemv_writes_into_a_given_output(device):
    w, x = torch.randn(8, 16, device=device), torch.randn(2, 16, device=device)
    wide = torch.zeros(2, 24, device=device)
    out = gemv(x, w, out=wide[:, 4:12])
    assert out.data_ptr() == wide[:, 4:12].data_ptr()
    torch.testing.assert_close(wide[:, 4:12], F.linear(x, w), rtol=1e-4, atol=1e-4)
    assert wide[:, :4].abs().sum() == 0 and wide[:, 12:].abs().sum() == 0


def test_default_config_follows_the_sweep():
    """All of K in one step up to 1,024, 4 columns a program (2 where K > 1,024), two warps
    (the H200 sweep: gemv_triton.default_config)."""
    assert default_config(960, 576) == GemvConfig(4, 1024, 2)
    assert default_config(576, 1536) == GemvConfig(2, 1024, 2)
    assert default_config(42, 72) == GemvConfig(4, 128, 2)  # never wider than K needs
    assert linear.GEMV_ROWS <= linear.GEMV_MAX_ROWS == GEMV_MAX_ROWS


def test_pdl_is_off_on_the_cpu_and_for_reference_ops(monkeypatch, set_envs):
    """PDL launches need Hopper or later: never on the CPU or under the interpreter, and
    DSPARK_REFERENCE_OPS turns them off on any device (kernels then take PDL=False)."""
    from dspark.kernels.pdl import pdl_enabled, pdl_options

    assert pdl_options(torch.device("cpu")) == {"PDL": False}
    set_envs(reference_ops=True)
    assert not pdl_enabled(torch.device("cuda", 0))
    set_envs(reference_ops=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl_enabled(torch.device("cuda", 0))


def test_linear_takes_the_gemv_only_on_cuda_rows_it_beats_cublas(set_envs):
    """The model's projections (layers/linear.py): the GEMV on CUDA up to GEMV_ROWS rows for
    weights up to GEMV_MAX_WEIGHT_ELEMENTS, F.linear otherwise; DSPARK_REFERENCE_OPS or the
    torch backend never take it."""
    layer = linear.Linear(16, 8, True, use_triton=True)
    assert layer.gemv_rows == linear.GEMV_ROWS
    assert not layer.takes_gemv(torch.randn(1, 16))  # a CPU tensor
    assert linear.Linear(16, 8, False, use_triton=False).gemv_rows == 0
    # a bandwidth-bound weight (Qwen3-8B's o_proj, say) goes to cuBLAS
    big = linear.GEMV_MAX_WEIGHT_ELEMENTS // 1024 + 1
    assert linear.Linear(1024, big, False, use_triton=True).gemv_rows == 0
    assert linear.Linear(1024, big - 1, False, use_triton=True).gemv_rows == linear.GEMV_ROWS
    set_envs(reference_ops=True)
    assert linear.Linear(16, 8, False, use_triton=True).gemv_rows == 0
    x = torch.randn(3, 16)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
