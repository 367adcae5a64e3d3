"""`speculative_config`: one object, as in vLLM.

    {"method": "dspark", "model": PATH, "num_speculative_tokens": K}

K may be smaller than the checkpoint's draft_len (the block is still drafted in full; only K
positions are verified) but never larger. Without "model" the engine takes the drafter this
package ships for the loaded target (dspark.drafters), and says so when there is none.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

METHODS = ("dspark",)
KEYS = ("method", "model", "num_speculative_tokens")


@dataclass(frozen=True)
class SpecConfig:
    model: str | None = None  # None: the shipped drafter of the target (dspark.drafters)
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
        model = d.get("model")
        if model is not None:
            if not isinstance(model, (str, os.PathLike)) or not os.fspath(model):
                raise ValueError(
                    f'speculative_config "model" must be a drafter directory, got {model!r}'
                )
            model = os.fspath(model)
        k = d.get("num_speculative_tokens")
        if k is not None and (not isinstance(k, int) or k < 1):
            raise ValueError(f"num_speculative_tokens must be a positive integer, got {k!r}")
        return cls(model=model, num_speculative_tokens=k, method=method)
