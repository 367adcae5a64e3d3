"""The one-launch uniforms equal random.uniform bit for bit: seeds of every sign and size,
positions past 2^32, every stream, one column and many, strided inputs, no rows."""

from __future__ import annotations

import torch

from dspark.kernels.uniform_triton import BLOCK_COLS, BLOCK_ROWS, uniform_triton
from dspark.sample.random import STREAM_ACCEPT, STREAM_DRAFT, STREAM_SAMPLE, uniform


def test_bits_equal_the_pytorch_generator(device):
    seeds = torch.tensor([0, 1, -1, 2**31, 2**32 + 5, -(2**62), 2**63 - 1, 12345] * 5,
                         device=device)  # fmt: skip
    positions = torch.arange(seeds.numel(), device=device) * 7919 + 2**32 - 3
    for stream in (STREAM_SAMPLE, STREAM_DRAFT, STREAM_ACCEPT):
        for num in (1, 3, BLOCK_COLS + 5):
            expect = uniform(seeds, positions, stream, num)
            got = uniform_triton(seeds, positions, stream, num)
            assert torch.equal(got, expect), (stream, num)
    assert seeds.numel() > BLOCK_ROWS  # several row blocks
    pairs = torch.stack([seeds, positions], dim=1)  # strided columns
    assert torch.equal(uniform_triton(pairs[:, 0], pairs[:, 1], STREAM_DRAFT),
                       uniform(seeds, positions, STREAM_DRAFT))  # fmt: skip
    empty = torch.zeros(0, dtype=torch.int64, device=device)
    assert uniform_triton(empty, empty, STREAM_SAMPLE, 4).shape == (0, 4)


def test_the_first_use_check_accepts_the_kernel_and_refuses_wrong_bits(device):
    import pytest

    from dspark.sample import random as rnd

    rnd._check_kernel(uniform_triton, device)  # the kernel's bits: accepted
    assert device in rnd._CHECKED
    rnd._CHECKED.discard(device)

    def off_by_one_ulp(seeds, positions, stream, num):
        return uniform_triton(seeds, positions, stream, num) + 2.0**-24

    with pytest.raises(RuntimeError, match="its bits differ from PyTorch's"):
        rnd._check_kernel(off_by_one_ulp, device)
    assert device not in rnd._CHECKED
