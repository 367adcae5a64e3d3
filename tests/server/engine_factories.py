"""Engine factories for tests: module functions, so they pickle into the engine process."""

from __future__ import annotations

import functools
import time
from pathlib import Path

from dspark.server.engine_process import build_engine


def _gated(gate: Path, config):
    """The engine, built once the file `gate` exists (a load that takes as long as a test
    wants)."""
    deadline = time.monotonic() + 60
    while not gate.exists():
        assert time.monotonic() < deadline, f"{gate} never appeared"
        time.sleep(0.01)
    return build_engine(config)


def gated_engine(gate: Path, config) -> functools.partial:
    return functools.partial(_gated, gate, config)
