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

from dspark.kernels.gemv_triton import (
    GEMV_MAX_ROWS,
    GemvConfig,
    _launch,
    default_config,
    gemv,
    gemv_add_rmsnorm,
    gemv_rmsnorm,
    gemv_silu_mul,
)
from dspark.kernels.rmsnorm_triton import fused_add_rmsnorm_ref, rmsnorm_ref
from dspark.kernels.silu_mul_triton import silu_and_mul_ref
from dspark.layers import linear

GPU_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
CPU_SHAPES = [(42, 72), (8, 300)]


def _tolerance(dtype: torch.dtype, device: torch.device | None = None) -> dict[str, float]:
    if dtype == torch.float32:  # only the order of float32 additions differs
        return {"rtol": 1e-4, "atol": 1e-4}
    # one bf16 rounding of O(1) outputs; on the CPU the interpreter truncates where GPUs round
    # to nearest, and a fused prologue rounds three times before the product
    cpu = device is not None and device.type == "cpu"
    return {"rtol": 1.6e-2, "atol": 4e-2 if cpu else 1.6e-2}


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
    (bench/pdl_chain.py on the H200)."""
    assert default_config(960, 576) == GemvConfig(4, 1024, 2)
    assert default_config(576, 1536) == GemvConfig(2, 1024, 2)
    assert default_config(42, 72) == GemvConfig(4, 128, 2)  # never wider than K needs
    assert linear.GEMV_ROWS <= linear.GEMV_MAX_ROWS == GEMV_MAX_ROWS


def _prologue_inputs(prologue, device, dtype, rows, g):
    n, k = (960, 576) if device.type == "cuda" else (42, 72)
    if prologue == "silu_mul":
        n, k = (576, 1536) if device.type == "cuda" else (40, 72)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(device, dtype)
    width = 2 * k if prologue == "silu_mul" else k
    x = torch.randn(rows, width, generator=g).to(device, dtype)
    res = torch.randn(rows, k, generator=g).to(device, dtype)
    norm_w = (1 + 0.1 * torch.randn(k, generator=g)).to(device, dtype)
    return x, res, norm_w, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("prologue", ["rmsnorm", "add_rmsnorm", "silu_mul"])
def test_gemv_prologues_equal_the_unfused_ops(device, dtype, rows, prologue):
    """Each fused prologue against its reference op followed by F.linear; with add_rmsnorm the
    new residual too (bit for bit on a GPU: one rounding of one sum). On the CPU K 72 is one
    block of 128 and, with a 32-wide config, three blocks (32 + 32 + 8)."""
    g = torch.Generator().manual_seed(rows)
    x, res, norm_w, w = _prologue_inputs(prologue, device, dtype, rows, g)
    eps = 1e-5
    configs = [None] if device.type == "cuda" else [None, GemvConfig(4, 32, 2)]
    for config in configs:
        if prologue == "silu_mul":
            got = _launch("silu_mul", x, w, None, None, None, 0.0, None, config)[0]
            want = F.linear(silu_and_mul_ref(x), w)
        elif prologue == "rmsnorm":
            got = _launch("rmsnorm", x, w, None, None, norm_w, eps, None, config)[0]
            want = F.linear(rmsnorm_ref(x, norm_w, eps), w)
        else:
            got, new_res = _launch("add_rmsnorm", x, w, None, res, norm_w, eps, None, config)
            normed, want_res = fused_add_rmsnorm_ref(x, res, norm_w, eps)
            want = F.linear(normed, w)
            if dtype == torch.float32 or device.type == "cuda":
                assert torch.equal(new_res, want_res)
            else:  # the interpreter rounds float32 -> bfloat16 by truncation, GPUs to nearest
                torch.testing.assert_close(new_res, want_res, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(got, want, **_tolerance(dtype, device))


def test_gemv_prologue_wrappers(device):
    g = torch.Generator().manual_seed(5)
    x, res, norm_w, w = _prologue_inputs("add_rmsnorm", device, torch.float32, 2, g)
    y, new_res = gemv_add_rmsnorm(x, res, norm_w, 1e-5, w)
    torch.testing.assert_close(y, F.linear(fused_add_rmsnorm_ref(x, res, norm_w, 1e-5)[0], w),
                               rtol=1e-4, atol=1e-4)  # fmt: skip
    assert new_res.data_ptr() not in (x.data_ptr(), res.data_ptr())  # never in place
    want = F.linear(rmsnorm_ref(x, norm_w, 1e-5), w)
    torch.testing.assert_close(gemv_rmsnorm(x, norm_w, 1e-5, w), want, rtol=1e-4, atol=1e-4)
    gu, _, _, wd = _prologue_inputs("silu_mul", device, torch.float32, 2, g)
    torch.testing.assert_close(gemv_silu_mul(gu, wd), F.linear(silu_and_mul_ref(gu), wd),
                               rtol=1e-4, atol=1e-4)  # fmt: skip


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
    """The model's projections (layers/linear.py): the GEMV on CUDA up to GEMV_ROWS rows,
    F.linear otherwise; DSPARK_REFERENCE_OPS or the torch backend never take it."""
    layer = linear.Linear(16, 8, True, use_triton=True)
    assert layer.gemv_rows == linear.GEMV_ROWS
    assert not layer.takes_gemv(torch.randn(1, 16))  # a CPU tensor
    assert linear.Linear(16, 8, False, use_triton=False).gemv_rows == 0
    set_envs(reference_ops=True)
    assert linear.Linear(16, 8, False, use_triton=True).gemv_rows == 0
    x = torch.randn(3, 16)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
