"""Pinned host twins of device buffers and the fence that keeps the host from rewriting a twin
under a queued copy: how a step's inputs reach the device (the runner's input buffers, the
speculative step's buffers, the per-row sampling parameters all stage through them).
"""

from __future__ import annotations

import torch


def staging_pair(shape, dtype: torch.dtype, device: torch.device):
    """(pinned host buffer, device buffer); on the CPU they are one buffer: nothing to copy."""
    host = torch.zeros(shape, dtype=dtype, pin_memory=device.type == "cuda")
    return host, host if device.type == "cpu" else host.to(device)


class UploadFence:
    """Marks when the async copies out of a set of staging buffers have run, so the host does
    not rewrite them under a queued copy. One event, re-recorded after each upload."""

    def __init__(self, device: torch.device) -> None:
        self._event = torch.cuda.Event() if device.type == "cuda" else None
        self._pending = False

    def record(self) -> None:
        if self._event is not None:
            self._event.record()
            self._pending = True

    def wait(self) -> None:
        if self._pending:
            self._event.synchronize()
            self._pending = False
