"""The q/k norm kernel against its PyTorch reference: in place on views of a fused qkv output,
ragged token counts (0, 1, several), keys-only calls (the drafter's context), float32 and bf16."""

from __future__ import annotations

import pytest
import torch

from dspark.kernels.qk_norm_triton import qk_norm, qk_norm_ref


@pytest.mark.parametrize("num_tokens", [0, 1, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads", [6, 0])  # 0: keys only
def test_qk_norm_matches_reference(device, num_tokens, dtype, num_heads):
    nkv, hd = 2, 32
    g = torch.Generator().manual_seed(0)
    width = num_heads * hd + 2 * nkv * hd
    qkv = (3 * torch.randn(num_tokens, width, generator=g)).to(device, dtype)
    q_w = torch.rand(hd, generator=g).add(0.5).to(device, dtype)
    k_w = torch.rand(hd, generator=g).add(0.5).to(device, dtype)
    q = qkv[:, : num_heads * hd].view(num_tokens, num_heads, hd)  # strided views, as attention's
    k = qkv[:, num_heads * hd : (num_heads + nkv) * hd].view(num_tokens, nkv, hd)
    v_before = qkv[:, (num_heads + nkv) * hd :].clone()
    want_q, want_k = qk_norm_ref(q, k, q_w, k_w, 1e-6)
    qk_norm(q, k, q_w, k_w, 1e-6)
    # the reductions' order differs (a float32 ulp, which may flip a bf16 rounding), and the
    # interpreter rounds its bf16 casts its own way: the tolerances of test_fused_ops_triton
    tol = {"atol": 1e-5, "rtol": 1e-5}
    if dtype == torch.bfloat16:
        tol = {"rtol": 1.6e-2, "atol": 6.25e-2 if device.type == "cpu" else 3.2e-2}
    torch.testing.assert_close(q, want_q, **tol)
    torch.testing.assert_close(k, want_k, **tol)
    assert torch.equal(qkv[:, (num_heads + nkv) * hd :], v_before)  # v untouched
