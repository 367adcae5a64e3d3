"""The burst threshold: when the scheduler admits waiting requests beside a mixed step's head
uncapped, in one eager step, rather than capped at the tail the runner captured.

A burst is more requests waiting for a free seat than the tail has rows (Scheduler._is_burst,
engine/scheduler.py). That threshold is measured for whole waves. A served engine at 256 in
flight met 15 such eager steps in a level (docs/PERFORMANCE.md, sixteenth look), from bursts of
a few to a few tens of requests. For those the cap may cost less. An eager step holds every
running row for its host time, about 10 ms, or ~5 steps of 256 rows on the H200. Capped, B
requests enter ~2.5 a step and lose about B^2 / 5 seat-steps, which stays under 5 x 256 up to
B ~ 80.
`DSPARK_BURST_REQUESTS=N` (N >= 1) makes a burst more than N waiting requests, for A/B runs;
unset, the tail's rows.
"""

from __future__ import annotations

import os

BURST_ENV = "DSPARK_BURST_REQUESTS"


def burst_requests_from_env() -> int | None:
    """DSPARK_BURST_REQUESTS as an int >= 1, or None when unset."""
    text = os.environ.get(BURST_ENV)
    if text is None:
        return None
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{BURST_ENV}={text!r}: expected an integer >= 1 (waiting requests)")
    return int(text)
