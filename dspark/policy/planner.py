"""Algorithm 1 with early stop: the synchronous planner, a pure reference function for tests
(docs/SPECULATION.md, the scheduler). The engine schedules by lagged capacity (cells.py,
policy.py); this is what that choice is checked against.

Request r's survival a[r, j] is the probability that drafts 1..j all survive (the cumulative
product of calibrated confidences; non-increasing in j). Verifying l_r drafts of each request
sends B = sum_r (1 + l_r) tokens and is expected to emit tau = sum_r (1 + sum_{j <= l_r} a[r, j]).
The objective is throughput, Theta = tau / step_time(B).

Algorithm 1 admits candidates (r, j) in one fixed order (survival descending, then position j
ascending, then row r ascending) and STOPS at the first one that does not raise Theta. Stopping,
rather than scanning on and taking the best prefix, is what keeps it lossless: a[r, j + 1]
depends on the value of draft j (the confidence head reads the previous token), so a decision
taken after looking at later candidates would depend on the very token it admits (the test
reproduces the paper's counterexample, where the retrospective argmax emits A with probability
0.85 instead of the target's 0.7).

  survival [[0.9, 0.6], [0.8, 0.1]], step_time(B) = 1 + 0.1 (B - 2):
    order (0,1) 0.9, (1,1) 0.8, (0,2) 0.6, (1,2) 0.1
    B=2: tau 2.0, Theta 2.00 | +(0,1): 2.9 / 1.1 = 2.64 | +(1,1): 3.7 / 1.2 = 3.08
    +(0,2): 4.3 / 1.3 = 3.31 | +(1,2): 4.4 / 1.4 = 3.14 < 3.31: stop -> l = [2, 1]
"""

from __future__ import annotations

import bisect
from collections.abc import Callable


def candidate_order(survival: list[list[float]]) -> list[tuple[int, int]]:
    """All (row, position) candidates, 1-based positions, in the planner's fixed order."""
    cands = [(r, j + 1) for r, row in enumerate(survival) for j in range(len(row))]
    return sorted(cands, key=lambda c: (-survival[c[0]][c[1] - 1], c[1], c[0]))


def plan_sync(
    survival: list[list[float]],  # [R][K] non-increasing along each row
    step_time: Callable[[int], float | None],  # seconds of a step of B tokens; None: not allowed
) -> list[int]:
    """Algorithm 1 with early stop: the verify length l_r of every request."""
    num_rows = len(survival)
    lengths = [0] * num_rows
    tokens, expected = num_rows, float(num_rows)
    t0 = step_time(tokens)
    if t0 is None:
        raise ValueError(f"no step time for the plain step of {num_rows} tokens")
    best = expected / t0
    for r, j in candidate_order(survival):
        if j != lengths[r] + 1:  # not the next of its request (a tie out of prefix order)
            continue
        t = step_time(tokens + 1)
        if t is None:
            break
        theta = (expected + survival[r][j - 1]) / t
        if theta <= best:
            break  # the first candidate that does not raise Theta ends the plan
        lengths[r], tokens, expected, best = j, tokens + 1, expected + survival[r][j - 1], theta
    return lengths


def staircase(cells: dict[int, float], num_pad_rows: int) -> Callable[[int], float | None]:
    """plan_sync's step_time from one G's measured cells (V -> seconds): a step of B live
    tokens costs the smallest cell that holds them with the G - R pad rows (one token each),
    never interpolated; None past the full block.

      cells {4: 1.0, 8: 1.2, 16: 2.0} (G 4), R 3: B 3 -> V 4: 1.0, B 5 -> V 8: 1.2,
      B 14 -> V 16: 2.0, B 16 -> None
    """
    sizes = sorted(cells)

    def step_time(num_tokens: int) -> float | None:
        i = bisect.bisect_left(sizes, num_tokens + num_pad_rows)
        return cells[sizes[i]] if i < len(sizes) else None

    return step_time
