"""Every `DSPARK_*` environment variable, typed, read once when this module is first imported.

They are for debugging and diagnostics only: whatever a user chooses goes through `EngineConfig`
and `speculative_config` (docs/CONFIG.md). Modules read `envs.ENVS`, never `os.environ`.

  DSPARK_CACHE_DIR       directory   dspark's cache (cost tables, GGUF indexes); default
                                     $XDG_CACHE_HOME/dspark, else ~/.cache/dspark
  DSPARK_REFERENCE_OPS   0 or 1      1: every op runs its PyTorch reference (attention, norms,
                                     rotary, GEMV, sampling, drafting, verification; no PDL),
                                     to tell a kernel's fault from the engine's
  DSPARK_POLICY_TRACE    directory   one JSON line per drafting decision (policy trace)
  DSPARK_REQUEST_TRACE   file        per-request timestamps of the server (request_trace.py)
  DSPARK_ENGINE_PROFILE  file        the served engine process's loop under cProfile
  DSPARK_SERVER_PROFILE  file        the API server process under cProfile
  DSPARK_GIT_COMMIT      text        the commit a benchmark's result names (a tree without .git)

A process that changes its own environment before building what reads it (an API worker
naming its own profile file) calls `reread()`; tests replace `ENVS` with `dataclasses.replace`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Envs:
    cache_dir: Path | None = None
    reference_ops: bool = False
    policy_trace: Path | None = None
    request_trace: Path | None = None
    engine_profile: Path | None = None
    server_profile: Path | None = None
    git_commit: str | None = None


def _path(name: str) -> Path | None:
    value = os.environ.get(name)
    return Path(value) if value else None


def _flag(name: str) -> bool:
    value = os.environ.get(name, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{name}={value!r}: expected 0 or 1")
    return value == "1"


def read() -> Envs:
    """The variables as the environment holds them now."""
    return Envs(
        cache_dir=_path("DSPARK_CACHE_DIR"),
        reference_ops=_flag("DSPARK_REFERENCE_OPS"),
        policy_trace=_path("DSPARK_POLICY_TRACE"),
        request_trace=_path("DSPARK_REQUEST_TRACE"),
        engine_profile=_path("DSPARK_ENGINE_PROFILE"),
        server_profile=_path("DSPARK_SERVER_PROFILE"),
        git_commit=os.environ.get("DSPARK_GIT_COMMIT") or None,
    )


ENVS = read()


def reread() -> Envs:
    """Read the environment again (module docstring: who needs to)."""
    global ENVS
    ENVS = read()
    return ENVS


def cache_dir() -> Path:
    """DSPARK_CACHE_DIR, else $XDG_CACHE_HOME/dspark, else ~/.cache/dspark (a temporary
    directory where there is no home, as for a bare container's user)."""
    if ENVS.cache_dir is not None:
        return ENVS.cache_dir
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg) / "dspark"
    try:
        return Path.home() / ".cache" / "dspark"
    except RuntimeError:
        import tempfile

        return Path(tempfile.gettempdir()) / "dspark"
