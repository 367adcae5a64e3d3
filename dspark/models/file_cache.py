"""Where dspark caches what it derives from a model file (under ~/.cache/dspark), keyed by the
file's resolved path, size and mtime: a file replaced or touched gets a new entry."""

from __future__ import annotations

import hashlib
from pathlib import Path

from dspark import envs

CACHE_ROOT = envs.cache_dir()


def cache_entry(kind: str, path: Path) -> Path:
    """The cache path for `path`'s derived `kind` ("tokenizers", "gguf"); not created here."""
    st = path.stat()
    key = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    return CACHE_ROOT / kind / hashlib.sha256(key.encode()).hexdigest()[:16]
