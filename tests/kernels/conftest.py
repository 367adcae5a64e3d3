"""Kernel tests: on a machine without CUDA the Triton kernels run in Triton's interpreter.

Triton reads TRITON_INTERPRET when a function is decorated with @triton.jit, that is when a
dspark.kernels.*_triton module is first imported. This conftest is imported before the test
modules of this directory, so setting the variable here is early enough, provided nothing
imported earlier in the session (a higher conftest, a test module collected before this
directory) has already imported a Triton kernel module. On a CUDA machine the variable is left
alone: the tests run compiled kernels on cuda tensors (export TRITON_INTERPRET=1 to force the
interpreter there).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    """cuda on a GPU machine (compiled kernels, real shapes), else cpu (interpreter, tiny)."""
    return torch.device(request.param)
