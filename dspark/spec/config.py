"""`speculative_config`: one object, as in vLLM.

    {"method": "dspark", "model": PATH, "num_speculative_tokens": K}

K may be smaller than the checkpoint's draft_len (the block is still drafted in full; only K
positions are verified) but never larger. `model` is required until the project ships its own
drafter for the default target.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

METHODS = ("dspark",)
KEYS = ("method", "model", "num_speculative_tokens")


@dataclass(frozen=True)
class SpecConfig:
    model: str
    num_speculative_tokens: int | None = None  # None: the checkpoint's draft_len
    method: str = "dspark"

    @classmethod
    def from_dict(cls, d: dict[str, Any] | SpecConfig | None) -> SpecConfig | None:
        if d is None or isinstance(d, SpecConfig):
            return d
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(d).__name__}")
        unknown = sorted(set(d) - set(KEYS))
        if unknown:
            raise ValueError(f"unknown speculative_config keys {unknown}; allowed: {list(KEYS)}")
        method = d.get("method", "dspark")
        if method not in METHODS:
            raise ValueError(f"unknown speculative method {method!r}; supported: {list(METHODS)}")
        if "model" not in d:
            raise ValueError('speculative_config needs "model": the path of a DSpark drafter')
        k = d.get("num_speculative_tokens")
        if k is not None and (not isinstance(k, int) or k < 1):
            raise ValueError(f"num_speculative_tokens must be a positive integer, got {k!r}")
        return cls(model=str(d["model"]), num_speculative_tokens=k, method=method)
