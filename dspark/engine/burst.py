"""The burst threshold: when the scheduler admits waiting requests beside a mixed step's head
uncapped, in one eager step, rather than capped at the tail the runner captured.

A burst is more requests waiting for a free seat than the threshold (Scheduler._is_burst,
engine/scheduler.py): `EngineConfig.burst_requests` (`dspark serve --burst-requests`, an arm's
engine option in `dspark bench --arms`), else `DSPARK_BURST_REQUESTS=N` in the environment
(for servers started by A/B scripts), else the captured tail's rows (4).

The default is measured for whole waves (256 prompts at once: one eager step admits them all,
where the tail would take ~90 steps). Closed loops and servers meet smaller bursts, of a few to
a few tens of requests: a served plain engine at 256 in flight met 15 eager steps in a level
(docs/PERFORMANCE.md, sixteenth look), fixed K = 7 offline at 256 about 43 a repeat. For those
the cap may cost less. An eager step holds every running row for its host time: ~10 ms for a
plain step of 256 rows on the H200 (~5 captured steps), and ~28 ms for a drafting step of 256
windows on the H100 (~7 steady drafting steps; the twenty-eighth look's trace: 306 drafting
steps with arrivals took 4.04 s a repeat, the 254 captured ones ~10 ms each, so the 52 eager
ones ~28 ms). Capped, B requests enter ~2.5 a step and lose about B^2 / 5 seat-steps, which
stays under 5 x 256 up to B ~ 80 for plain steps, and under the ~2 x 256 seat-steps an eager
drafting step costs beyond a captured one with arrivals up to B ~ 50.
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
