"""`speculative_config`: one object, as in vLLM.

    {"method": "dspark", "model": PATH, "num_speculative_tokens": K,
     "cost_table": PATH, "min_gain": 0.02, "scheduling": true, "unobserved": "population",
     "mixed_prefill_tokens": [256, 512], "trimmed_widths": [], "realised_costs": true,
     "persistence": true, "scheduler": "lagged", "dwell_steps": 8, "stale_price_half_life": 16,
     "mixed_steps_ahead": true, "regression_target": "population", "price_switches": false,
     "arrival_costs": true}

K may be smaller than the checkpoint's draft_len (the block is still drafted in full; only K
positions are verified) but never larger. Without "model" the engine takes the drafter this
package ships for the loaded target (dspark.drafters), and says so when there is none.

Scheduling (the per-step choice to draft, policy/policy.py) needs a cost table measured
on this engine by `dspark profile`: "cost_table" names one; without it the engine uses a table
in the drafter's cost_tables/ directory whose fingerprint matches the live engine, if any.
With no table, or "scheduling": false, every step drafts and verifies the full block (fixed K).
"unobserved" is how the drafting choice counts a request that has never drafted: "population"
(the default: the recent requests' recalibrated mean, once there is enough evidence and while it
is fresh; otherwise a = 1) or "confident" (a = 1 always). Either way its window, when the step
drafts, is verified in full, and a stale request still counts a = 1, so falling load brings
drafting back (drafting_policy.py says why the default is not DSPARK.md 6.4's letter).
"trimmed_widths" lists the trimmed cells the engine can run besides the full block: for each w
(2 <= w <= K) and each graph size G, the cell (G, w G), a step of G windows verifying w G target
tokens in all, each row's share chosen on the device from its fresh survivals (spec/ragged.py).
The cost table must have measured them (`dspark profile` does, for the engine it profiles), and
the drafting policy then picks among plain decoding, these cells and the full block. Empty (the
default) until a measurement shows they pay on the deployment GPU.
"realised_costs" (default true) prices each cell by the table scaled by the step times the
engine realises in it (policy/realised_costs.py): a serving loop's drafting steps carry prefill
and cost more than the profiler's steady ones. On the H200 it took the policy from 0.98x to
1.09x plain decoding at 256 requests (docs/PERFORMANCE.md, twelfth look); false prices by the
table alone, deterministically (tests).
"stale_price_half_life" (default 16; 0: off) lets a realised price that is not measured again
revert toward the cell's long-run level, halfway per that many steps counted in other cells
(policy/realised_costs.py): while drafting is off the full block's price is otherwise frozen at
whatever turned drafting off. On the H200 (docs/PERFORMANCE.md, twenty-third look) 16 served
1.09x and 1.24x the frozen prices' throughput at 64 and 256 requests; offline, six side-by-side
runs at 1 to 256 read 0.92-1.07x, median 1.02x.
"arrival_costs" (default true) keeps each cell's realised price apart for steps that admit or
prefill requests and steps that do not, and prices a cell by their mix at the share of recent
steps at its G with arrivals, which plain steps measure too (policy/realised_costs.py). A served
first wave has arrivals in nearly every step; with one price per cell it held the full block's
price at 4.6 plain steps after the wave, and drafting off with it through the timed run that
followed; priced apart, drafting resumed ten steps later (an H100, 64 streams,
docs/PERFORMANCE.md thirty-sixth look: served 1.06x median of three pairs, offline 1.04-1.07x).
False keeps one price per cell, as before 2026-12-06.
"persistence" (default true) lets a request's own lagged survivals count only as far as they
have been seen to predict its next block (a slope fitted online, drafting_policy.py); false
trusts them in full, as before 2026-12-04.
"scheduler" says who chooses each row's verify length when a step drafts: "lagged" (default:
the full block, or the policy's trimmed cell filled on the device, DSPARK.md 6.3 item 2) or
"sync" (Algorithm 1 with early stop on the host, from the step's own survivals, each length
priced by the cost table's cells: policy/planner.py; a second host sync per drafting step, so it
runs eagerly, without CUDA graphs: a reference and a fallback).
"dwell_steps" (default 8) is how many plain steps the policy keeps drafting off once it turned
it off, one of its two guards against flapping (drafting_policy.py); a key so that a
benchmark's arms can compare values side by side (docs/PERFORMANCE.md, seventeenth look).
"mixed_prefill_tokens" is the most prompt tokens a drafting step carries beside its windows
with CUDA graphs (a captured mixed step, runner/mixed_layout.py; the rest of a prompt follows
in later steps); 0 turns mixed graphs off (such steps then run eagerly, their prefill uncapped).
A list captures a mixed step for each size P beside every G, and a step pads its tail to the
smallest P that holds its tokens and its rows, so a larger cap (more prompts admitted a step)
need not pad every mixed step to it. A size's tail holds one row per 64 tokens, at least 4
(runner/mixed_layout.py max_tail_rows: 8 at 512). The default, [256, 512], admits up to 512
tokens (~5.8 chat prompts) a step. On an H100 (docs/PERFORMANCE.md, thirty-fifth look) it
served the drafting policy 1.05-1.06x faster than 256 alone at 256 streams (0.92 of offline
against 0.87-0.89), fixed K = 7 1.01x (0.90 against 0.89), and kept C = 64 within the runs'
noise. (One size of 512, of 4 rows then, lost 2-4% at 64, where it padded every tail to 512:
thirty-fourth look.) Each size past the first adds three mixed graphs a G: 2.3 GiB more of the
memory plan's reserve at 256 seats (engine/memory.py).
"regression_target" is what an aged survival estimate is pulled toward: "population" (the
default: the recent requests' mean) or "request" (the request's own mean, shrunk toward the
population's), policy/survival.py. On an H100 at C = 1 "request" drafted 35% of the
steps where "population" drafted 63-97%, and ran 1,409 against 1,586 tok/s (docs/PERFORMANCE.md,
twenty-fifth look): a request that dipped below the line once stays off.
"price_switches" (default false) makes a switch of drafting off pay for its round trip: plain
decoding must then win by the resuming drafting step's time over the dwell more
(drafting_policy.py). On an H100 it kept 1.00x the policy without it at 1, 4 and 64 requests
and lost 6% at 256, where it kept drafting too long (docs/PERFORMANCE.md, thirty-fourth look).
"mixed_steps_ahead" lets those mixed steps into the async pipeline: a step of windows launched
ahead admits waiting requests into its tail, and a step may launch behind a mixed one
(engine/scheduler.py). On by default. False makes every admission finish the step in flight,
and the mixed step itself, before the next is scheduled: on an H100 a drafting step with
arrivals then took 4.4 ms where a steady one took 2.2 (64 requests; docs/PERFORMANCE.md,
thirty-seventh look). With the drafting policy, arrivals priced apart and the burst threshold,
it served 0.98x / 1.06x / 1.27x / 1.11x false's output at 1 / 16 / 64 / 256 streams on an
H100, offline 1.03x / 1.06x / 1.25x / 1.15x (thirty-seventh look). On the H200, before those,
it lost under the policy at 256 (0.81-0.90x offline: twenty-fourth look).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

METHODS = ("dspark",)
# the tail sizes of captured mixed drafting steps ("mixed_prefill_tokens"; the docstring)
DEFAULT_TAIL_SIZES = (256, 512)
KEYS = ("method", "model", "num_speculative_tokens", "cost_table", "min_gain", "scheduling",
        "unobserved", "mixed_prefill_tokens", "trimmed_widths", "realised_costs",
        "persistence", "scheduler", "dwell_steps", "stale_price_half_life",
        "mixed_steps_ahead", "regression_target", "price_switches", "arrival_costs")  # fmt: skip
SCHEDULERS = ("lagged", "sync")
UNOBSERVED = ("confident", "population")
REGRESSION_TARGETS = ("population", "request")


@dataclass(frozen=True)
class SpecConfig:
    model: str | None = None  # None: the shipped drafter of the target (dspark.drafters)
    num_speculative_tokens: int | None = None  # None: the checkpoint's draft_len
    method: str = "dspark"
    # `dspark profile`'s table: with it, each step drafts only when the measured whole-step
    # times say it pays (policy/policy.py); None: every step drafts (fixed K)
    cost_table: str | None = None  # None: a matching table in the drafter's cost_tables/
    min_gain: float = 0.02  # what another mode must beat the current one by (squared)
    scheduling: bool = True  # False: fixed K even with a cost table
    unobserved: str = "population"  # how a request that never drafted counts (UNOBSERVED)
    # prefill beside windows in a captured step (0: none); a tuple: one capture per size
    mixed_prefill_tokens: int | tuple[int, ...] = DEFAULT_TAIL_SIZES
    trimmed_widths: tuple[int, ...] = ()  # w of the trimmed cells (G, w G) the engine can run
    realised_costs: bool = True  # scale the table by realised step times (realised_costs.py)
    persistence: bool = True  # fit how far a row's own survivals predict its next block
    scheduler: str = "lagged"  # who chooses verify lengths (SCHEDULERS; module docstring)
    dwell_steps: int = 8  # plain steps drafting stays off once the policy turned it off
    stale_price_half_life: float = 16.0  # steps (0: an unmeasured price never reverts)
    mixed_steps_ahead: bool = True  # mixed steps in the async pipeline (module docstring)
    regression_target: str = "population"  # an aged estimate's pull (REGRESSION_TARGETS)
    price_switches: bool = False  # a switch off pays for its round trip (drafting_policy.py)
    arrival_costs: bool = True  # steps with arrivals priced apart (realised_costs.py)

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
        gain = d.get("min_gain", 0.02)
        if isinstance(gain, bool) or not isinstance(gain, (int, float)) or not 0 <= gain < 1:
            raise ValueError(
                f'speculative_config "min_gain" must be a number in [0, 1), got {gain!r}'
            )
        scheduling = _flag(d, "scheduling", True)
        unobserved = _choice(d, "unobserved", UNOBSERVED, "population")
        mixed = _parse_tail_sizes(d.get("mixed_prefill_tokens", DEFAULT_TAIL_SIZES))
        widths = d.get("trimmed_widths", [])
        if not isinstance(widths, (list, tuple)) or not all(
            isinstance(w, int) and not isinstance(w, bool) and w >= 2 for w in widths
        ):  # fmt: skip
            raise ValueError(
                f'speculative_config "trimmed_widths" must be a list of integers >= 2 (tokens '
                f"per row of a trimmed cell, at most num_speculative_tokens), got {widths!r}"
            )
        realised = _flag(d, "realised_costs", True)
        persistence = _flag(d, "persistence", True)
        mixed_ahead = _flag(d, "mixed_steps_ahead", True)
        price_switches = _flag(d, "price_switches", False)
        arrival_costs = _flag(d, "arrival_costs", True)
        scheduler = _choice(d, "scheduler", SCHEDULERS, "lagged")
        target = _choice(d, "regression_target", REGRESSION_TARGETS, "population")
        dwell = d.get("dwell_steps", 8)
        if isinstance(dwell, bool) or not isinstance(dwell, int) or not 0 <= dwell <= 10_000:
            raise ValueError(
                f'speculative_config "dwell_steps" must be an integer in [0, 10000], got {dwell!r}'
            )
        stale = d.get("stale_price_half_life", 16)
        if isinstance(stale, bool) or not isinstance(stale, (int, float)) or not 0 <= stale <= 1e6:
            raise ValueError(f'speculative_config "stale_price_half_life" must be a number of '
                             f"steps in [0, 1e6] (0: off), got {stale!r}")  # fmt: skip
        table = None if table is None else os.fspath(table)
        return cls(model=model, num_speculative_tokens=k, method=method, cost_table=table,
                   min_gain=float(gain), scheduling=scheduling, unobserved=unobserved,
                   mixed_prefill_tokens=mixed,
                   trimmed_widths=tuple(sorted(set(widths))),
                   realised_costs=realised, persistence=persistence,
                   scheduler=scheduler, dwell_steps=dwell,
                   stale_price_half_life=float(stale),
                   mixed_steps_ahead=mixed_ahead, regression_target=target,
                   price_switches=price_switches, arrival_costs=arrival_costs)  # fmt: skip


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


def _choice(d: dict[str, Any], key: str, allowed: tuple[str, ...], default: str) -> str:
    value = d.get(key, default)
    if value not in allowed:
        raise ValueError(
            f'speculative_config "{key}" must be one of {list(allowed)}, got {value!r}'
        )
    return value
