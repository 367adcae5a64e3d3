"""The burst threshold: when the scheduler admits waiting requests beside a mixed step's head
uncapped, in one eager step, rather than capped at the tail the runner captured.

A burst is more requests waiting for a free seat than the threshold (Scheduler.is_burst,
engine/scheduler.py), burst_threshold(): 4 sqrt(R) for R rows running, and never fewer than the
captured tail's rows.

Why it grows with the running rows. An eager step holds every running row for its host time: ~10 ms
for a plain step of 256 rows on the H200 (~5 captured steps), and ~28 ms for a drafting step of 256
windows on the H100 (~7 steady drafting steps). So a burst run eagerly costs about k R seat-steps
beyond a captured step (k ~ 2 for drafting steps, ~5 for plain ones). Capped, B requests enter ~2.5
a step and lose about B^2 / 5 seat-steps. The two meet at B = sqrt(5 k R): 3.2 sqrt(R) for drafting
steps, 5 sqrt(R) for plain ones; 4 sqrt(R) sits between.

Measured at R ~ 256 (H100, the real model, a closed loop of 256 requests of spread lengths):
a threshold of 64 against the tail's 4 rows ran fixed
K = 7 1.22x faster (eager drafting steps 174 -> 6 in three repeats), plain decoding 1.02x and
the drafting policy 1.01x; at 64 requests, 1.00-1.01x. This default ran exactly the steps
of the constant 64 there (fixed K = 7, 256 requests). Whole waves still burst: 256 prompts
at once are admitted by one eager step, where the tail would take ~90 steps.
"""

from __future__ import annotations

import math


def burst_threshold(num_running: int, tail_rows: int) -> int:
    """Waiting requests above which an admission beside num_running head rows is a burst:
    4 sqrt(num_running), at least the tail's rows.

        burst_threshold(256, 4) = 64     burst_threshold(16, 4) = 16     burst_threshold(1, 4) = 4
    """
    return max(tail_rows, round(4 * math.sqrt(num_running)))
