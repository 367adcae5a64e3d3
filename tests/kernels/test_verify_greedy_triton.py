"""Greedy verification's bookkeeping in one launch (kernels/verify_greedy_triton.py) gives
verify_greedy's PyTorch results (spec/verifier.py) exactly."""

from __future__ import annotations

import pytest
import torch

from dspark.kernels.verify_greedy_triton import verify_greedy_triton
from dspark.spec.verifier import verify_greedy


def test_the_docstring_example(device):
    tokens, n = verify_greedy_triton(
        torch.tensor([7, 8, 2, 5, 9], device=device),
        torch.tensor([[7, 8, 4], [1, 1, 1]], device=device),
        torch.tensor([3, 0], device=device),
        torch.tensor([0, 4, 5], device=device),
    )  # fmt: skip
    assert tokens.tolist() == [[7, 8, 2, 0], [9, 0, 0, 0]] and n.tolist() == [2, 0]


@pytest.mark.parametrize("uniform", [True, False])  # K + 1 wide windows, or 1 + verify_len
@pytest.mark.parametrize("K", [1, 4, 7])
def test_random_windows_equal_the_pytorch_verification(device, uniform, K):
    g = torch.Generator().manual_seed(K)
    for _ in range(20):
        R, V = int(torch.randint(1, 10, (1,), generator=g)), 6
        verify_len = torch.randint(0, K + 1, (R,), generator=g)
        widths = torch.full((R,), K + 1) if uniform else 1 + verify_len
        cu = torch.zeros(R + 1, dtype=torch.int64)
        cu[1:] = widths.cumsum(0)
        drafts = torch.randint(0, V, (R, K), generator=g)
        # each window's target agrees with its drafts for a random prefix, then at random
        logits = torch.randn(int(cu[-1]), V, generator=g)
        for r in range(R):
            agree = int(torch.randint(0, int(verify_len[r]) + 1, (1,), generator=g))
            for k in range(agree):
                logits[cu[r] + k, drafts[r, k]] = 10.0
        want = verify_greedy(logits, drafts, verify_len, cu)  # CPU tensors: PyTorch
        strided = drafts.t().contiguous().t()  # column-major: any strides are read as such
        tokens, n = verify_greedy_triton(logits.argmax(-1).to(device), strided.to(device),
                                         verify_len.to(device), cu.to(device))  # fmt: skip
        assert n.cpu().tolist() == want.num_accepted.tolist()
        assert tokens.cpu().tolist() == want.tokens.tolist()
        assert tokens.dtype == want.tokens.dtype == torch.int64


def test_no_rows(device):
    tokens, n = verify_greedy_triton(torch.zeros(0, dtype=torch.int64, device=device),
                                     torch.zeros(0, 7, dtype=torch.int64, device=device),
                                     torch.zeros(0, dtype=torch.int64, device=device),
                                     torch.zeros(1, dtype=torch.int64, device=device))  # fmt: skip
    assert tokens.shape == (0, 8) and n.shape == (0,)
