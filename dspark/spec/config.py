"""`speculative_config`: one object, as in vLLM.

    {"method": "dspark", "model": PATH, "num_speculative_tokens": K, "cost_table": PATH,
     "scheduling": true, "profile_at_startup": true, "trimmed_widths": [],
     "mixed_prefill_tokens": [256, 512]}

K may be smaller than the checkpoint's draft_len (the drafter's backbone still runs over its
whole block, whose slots attend to each other; the LM head, the Markov head and the confidence
head only over the K slots a window verifies) but never larger. Without "model" the engine
takes the drafter this package ships for the loaded target (dspark.drafters), and says so when
there is none.

Scheduling (the per-step choice to draft, dspark/policy/) needs a cost table measured on this
engine: "cost_table" names one; without it the engine uses a table whose fingerprint matches
the live engine, in the drafter's cost_tables/ directory, then in the user's cache (where
`dspark profile` writes); with none, an engine whose steps run in CUDA graphs measures one at
start-up and saves it there ("profile_at_startup": false skips that; engine/startup_profile.py).
With no table, or "scheduling": false, every step drafts and verifies the full block (fixed K).
How the policy prices and chooses (survival estimates, realised step costs, hysteresis and
dwell) has no user settings: its constants are dspark/policy/tuning.py's (docs/SPECULATION.md,
the policy).
"trimmed_widths" lists the trimmed cells the engine can run besides the full block: for each w
(2 <= w <= K) and each graph size G, the cell (G, w G), a step of G windows verifying w G target
tokens in all, each row's share chosen on the device from its fresh survivals (spec/ragged.py).
The cost table must have measured them (`dspark profile` does, for the engine it profiles), and
the drafting policy then picks among plain decoding, these cells and the full block. Empty (the
default) until a measurement shows they pay on the deployment GPU.
"mixed_prefill_tokens" is the most prompt tokens a drafting step carries beside its windows
with CUDA graphs (a captured mixed step, runner/mixed_layout.py; the rest of a prompt follows
in later steps); 0 turns mixed graphs off (such steps then run eagerly, their prefill uncapped).
A list captures a mixed step for each size P beside every G, and a step pads its tail to the
smallest P that holds its tokens and its rows, so a larger cap (more prompts admitted a step)
need not pad every mixed step to it. A size's tail holds one row per 64 tokens, at least 4
(runner/mixed_layout.py max_tail_rows: 8 at 512). The default, [256, 512], admits up to 512
tokens (~5.8 chat prompts) a step; a single size of 512 pads every tail to 512, which costs
at 64 requests. Each size past the first adds three mixed graphs a G: 2.3 GiB more of the
memory plan's reserve at 256 seats (engine/memory.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

METHODS = ("dspark",)
# the tail sizes of captured mixed drafting steps ("mixed_prefill_tokens"; the docstring)
DEFAULT_TAIL_SIZES = (256, 512)
KEYS = ("method", "model", "num_speculative_tokens", "cost_table", "scheduling",
        "profile_at_startup", "trimmed_widths", "mixed_prefill_tokens")  # fmt: skip


@dataclass(frozen=True)
class SpecConfig:
    model: str | None = None  # None: the shipped drafter of the target (dspark.drafters)
    num_speculative_tokens: int | None = None  # None: the checkpoint's draft_len
    method: str = "dspark"
    # `dspark profile`'s table: with it, each step drafts only when the measured whole-step
    # times say it pays (dspark/policy/); None: every step drafts (fixed K)
    cost_table: str | None = None  # None: a matching table in the drafter's cost_tables/
    scheduling: bool = True  # False: fixed K even with a cost table
    # with scheduling and no table for this engine, measure one at start-up (CUDA graphs
    # only: engine/startup_profile.py) and save it where the next start finds it
    profile_at_startup: bool = True
    # prefill beside windows in a captured step (0: none); a tuple: one capture per size
    mixed_prefill_tokens: int | tuple[int, ...] = DEFAULT_TAIL_SIZES
    trimmed_widths: tuple[int, ...] = ()  # w of the trimmed cells (G, w G) the engine can run

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
        table = d.get("cost_table")
        if table is not None and not (isinstance(table, (str, os.PathLike)) and os.fspath(table)):
            raise ValueError(f'speculative_config "cost_table" must be a file path, got {table!r}')
        scheduling = _flag(d, "scheduling", True)
        profile_at_startup = _flag(d, "profile_at_startup", True)
        mixed = _parse_tail_sizes(d.get("mixed_prefill_tokens", DEFAULT_TAIL_SIZES))
        widths = d.get("trimmed_widths", [])
        if not isinstance(widths, (list, tuple)) or not all(
            isinstance(w, int) and not isinstance(w, bool) and w >= 2 for w in widths
        ):  # fmt: skip
            raise ValueError(
                f'speculative_config "trimmed_widths" must be a list of integers >= 2 (tokens '
                f"per row of a trimmed cell, at most num_speculative_tokens), got {widths!r}"
            )
        table = None if table is None else os.fspath(table)
        return cls(model=model, num_speculative_tokens=k, method=method, cost_table=table,
                   scheduling=scheduling, profile_at_startup=profile_at_startup,
                   mixed_prefill_tokens=mixed,
                   trimmed_widths=tuple(sorted(set(widths))))  # fmt: skip


def _parse_tail_sizes(value: Any) -> int | tuple[int, ...]:
    """ "mixed_prefill_tokens": an integer in [0, 8192], or a non-empty list of integers in
    [1, 8192] (sorted, duplicates dropped; one entry is the integer)."""

    def is_size(v: Any, low: int) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and low <= v <= 8192

    if is_size(value, 0):
        return value
    if isinstance(value, (list, tuple)) and value and all(is_size(v, 1) for v in value):
        sizes = tuple(sorted(set(value)))
        return sizes[0] if len(sizes) == 1 else sizes
    raise ValueError(
        'speculative_config "mixed_prefill_tokens" must be an integer in [0, 8192] or a '
        f"non-empty list of integers in [1, 8192], got {value!r}"
    )


def tail_sizes(spec: SpecConfig) -> tuple[int, ...]:
    """The P of the mixed steps to capture beside each G: () for none."""
    mixed = spec.mixed_prefill_tokens
    return tuple(mixed) if isinstance(mixed, tuple) else ((mixed,) if mixed else ())


def _flag(d: dict[str, Any], key: str, default: bool) -> bool:
    value = d.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f'speculative_config "{key}" must be true or false, got {value!r}')
    return value
