"""Programmatic dependent launch (PDL): a kernel starts while the one before it still runs.

A decode step at a small batch is a chain of ~260 dependent launches of a few microseconds
each, and much of each is the launch and the first memory round trip rather than the bytes
moved. Launched with PDL (Hopper and later), kernel n+1
is started as soon as every program of kernel n has passed `gdc_enter` below; it may do work
that does not depend on n (the GEMV prefetches its weight rows into L2) and then waits in its
own `gdc_enter` until n has finished and n's writes are visible. CUDA graphs keep the launches'
programmatic edges.

The rule every kernel launched this way keeps: nothing before `gdc_enter` reads what an earlier
kernel wrote, or writes anything at all. Waiting on n is enough for every kernel before n,
because n itself waited (or was launched without PDL, which waits for everything before it).

On by default on CUDA devices of compute capability 9 and later; off under
DSPARK_REFERENCE_OPS (every launch is then a plain one) and under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from dspark import envs


@triton.jit
def gdc_enter(PDL: tl.constexpr):
    """Wait for the kernel before this one, then let the kernel after this one start."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@functools.cache
def _device_supports(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_enabled(device: torch.device) -> bool:
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if envs.ENVS.reference_ops:
        return False
    return _device_supports(
        device.index if device.index is not None else torch.cuda.current_device()
    )


def pdl_options(device: torch.device) -> dict:
    """Keyword arguments for a launch of a kernel with a `PDL: tl.constexpr` parameter."""
    return {"PDL": True, "launch_pdl": True} if pdl_enabled(device) else {"PDL": False}
