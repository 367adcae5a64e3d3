"""Counter-based random numbers: a pure function of (seed, position, stream, index).

A request's randomness must not depend on its batch mates, the batch size, or how many tokens a
step verifies, so nothing here has state: every uniform is a hash of who asks for it. The hash is
a 32-bit integer mixer (xor-shift / multiply rounds, "lowbias32"), evaluated in int64 with the
intermediate values masked to 32 bits, so the same bits come out on the CPU and on the GPU.

Streams keep different uses apart: the token sampled at a position, a draft sampled at that
position, an acceptance coin, a recovered token.

On CUDA the same bits come from one Triton launch (kernels/uniform_triton.py) instead of the
forty-odd elementwise launches below; DSPARK_REFERENCE_OPS keeps the PyTorch path. On
a device's first call the kernel's bits are checked against this file's on a few fixed inputs
(seeds of both signs, positions past 2^32); if they differ, or the kernel fails to build or
launch, the PyTorch path takes over for the process, with a warning saying why (the first call
comes from a warm-up step, before any graph capture).
"""

from __future__ import annotations

import logging

import torch

from dspark import envs

logger = logging.getLogger(__name__)

_TRITON = not envs.ENVS.reference_ops
_CHECKED: set[torch.device] = set()  # devices where the kernel's bits were checked

MASK32 = 0xFFFFFFFF

STREAM_SAMPLE = 0  # the target's token at this position (plain decoding, bonus, recovered)
STREAM_DRAFT = 1  # the drafter's token at this position
STREAM_ACCEPT = 2  # the acceptance coin of the draft at this position
STREAM_SYNTHETIC = 3  # a benchmark's synthetic acceptance coin (spec/synthetic.py)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    # x: int64 values in [0, 2^32); products fit in int64 before masking back to 32 bits
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def _row_keys(seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    # seeds, positions: [N] int64 -> [N] int64 32-bit keys
    lo = seeds & MASK32
    hi = (seeds >> 32) & MASK32
    key = _mix32(lo ^ _mix32(hi ^ 0x9E3779B9))
    key = _mix32(key ^ (positions & MASK32))
    return _mix32(key ^ stream)


def uniform(
    seeds: torch.Tensor, positions: torch.Tensor, stream: int, num: int = 1
) -> torch.Tensor:
    """Uniforms in the open interval (0, 1): [N, num] float32, one row per (seed, position)."""
    global _TRITON
    if _TRITON and seeds.is_cuda and seeds.dim() == 1 and seeds.shape == positions.shape and (
        seeds.dtype == positions.dtype == torch.int64
    ):  # fmt: skip
        try:
            from dspark.kernels.uniform_triton import uniform_triton

            if seeds.device not in _CHECKED:
                _check_kernel(uniform_triton, seeds.device)
            return uniform_triton(seeds, positions, stream, num)
        except Exception as e:  # noqa: BLE001 - any failure or mismatch: the same bits below
            _TRITON = False
            logger.warning("the Triton uniforms are not used (%s: %s): PyTorch's hash from now "
                           "on", type(e).__name__, e)  # fmt: skip
    return _uniform_torch(seeds, positions, stream, num)


def _check_kernel(kernel, device: torch.device) -> None:
    """Raise unless the kernel's bits equal _uniform_torch's on a few fixed inputs."""
    seeds = torch.tensor([0, 1, -1, 2**40 + 3, -(2**62)], device=device)
    positions = torch.tensor([0, 7, 2**33 + 1, 5, 123456789], device=device)
    for stream in (STREAM_SAMPLE, STREAM_DRAFT, STREAM_ACCEPT, STREAM_SYNTHETIC):
        if not torch.equal(kernel(seeds, positions, stream, 3),
                           _uniform_torch(seeds, positions, stream, 3)):  # fmt: skip
            raise RuntimeError(f"its bits differ from PyTorch's on {device} (stream {stream})")
    _CHECKED.add(device)


def _uniform_torch(
    seeds: torch.Tensor, positions: torch.Tensor, stream: int, num: int
) -> torch.Tensor:
    keys = _row_keys(seeds, positions, stream)  # [N]
    index = torch.arange(num, device=seeds.device, dtype=torch.int64)  # [num]
    bits = _mix32(_mix32(keys[:, None] ^ index[None, :]) ^ 0x5BD1E995)  # [N, num]
    # 24 high bits -> (k + 0.5) / 2^24, never exactly 0 or 1
    return ((bits >> 8).float() + 0.5) * (1.0 / (1 << 24))
