"""Which captured shape a step fits: the one place the runner decides it.

A step replays a CUDA graph only when its plan fits a shape captured at start-up; otherwise it
runs eagerly and the reason is counted in the runner's stats (the callers count what these pure
functions return). The shapes, each captured for every size G of the ladder:

    decode G             G one-token rows that sample                  (runner/cuda_graph.py)
    mixed decode (G, P)  G decode rows, then a tail of at most P prompt tokens in at most
                         max_tail_rows(P) rows                          (runner/mixed_layout.py)
    windows G            G windows laid out K + 1 wide (empty windows among them)
                                                                        (runner/spec_graphs.py)
    mixed windows (G, P) G windows laid out K + 1 wide, then a tail as above

A step of windows whose requests shape their logits (`shapes_logits`) or carry a grammar
(`plan.grammar_rows`) fits them too: it replays its graph and verifies again, eagerly, with the
shaping and masks (runner/spec_graphs.py). A step that scores prompt tokens for prompt_logprobs
(`prompt_scored`) fits none. A step pads to
the smallest captured G that holds its rows (and P that holds its tail):

    sizes [1, 2, 4, 8]: 3 rows -> G 4;  8 rows -> G 8;  9 rows -> None ("batch_too_large")
    tails (256, 512): 200 tail tokens in 3 rows -> P 256; 300 in 3 -> 512; 200 in 6 -> 512
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from dspark.request import PENDING_TOKEN
from dspark.runner.mixed_layout import max_tail_rows
from dspark.step_plan import StepPlan


def padded_size(sizes: Sequence[int], num_rows: int) -> int | None:
    """The smallest of the sorted captured sizes that holds num_rows, or None."""
    i = bisect.bisect_left(sizes, num_rows)
    return sizes[i] if i < len(sizes) else None


def tail_size(tails: Sequence[int], num_tokens: int, num_rows: int) -> int:
    """The smallest captured tail P that holds a tail of num_tokens in num_rows rows (the
    caller checked that the largest does)."""
    return next(p for p in tails if p >= num_tokens and max_tail_rows(p) >= num_rows)


def decode_size(sizes: Sequence[int], plan: StepPlan) -> tuple[int | None, str | None]:
    """A pure-decode step's captured G, or (None, the reason it runs eagerly)."""
    size = padded_size(sizes, len(plan.rows))
    return (size, None) if size is not None else (None, "batch_too_large")


def window_width(plan: StepPlan, num_verify: int, capacity: int) -> int | None:
    """K + 1 when every row of the step is a window that can be laid out K + 1 wide (empty
    windows among them, at least one real window) within the token buffers' capacity."""
    width = 1 + num_verify
    rows = plan.rows
    if not all(r.num_draft or r.empty_window for r in rows):
        return None
    if not any(r.num_draft for r in rows):  # (only last tokens: a plain decode step)
        return None
    return width if len(rows) * width <= capacity else None


def leading_windows(
    plan: StepPlan, num_verify: int, capacity: int, max_tail_tokens: int
) -> tuple[int | None, str | None]:
    """A mixed drafting step: how many of its leading rows are windows (the rest its tail),
    or (None, None) when it is not one, or (None, the reason it cannot keep a captured
    layout) when it has windows that do not fit one.

      rows [w w w p p] (w: window, p: prefill chunk)  -> (3, None)
      rows [w w w]                                     -> (None, None): all windows
      rows [p w w]                                     -> (None, "windows_not_first")
    """
    rows = plan.rows
    n = 0
    while n < len(rows) and (rows[n].num_draft or rows[n].empty_window):
        n += 1
    if n == len(rows) or not any(r.num_draft for r in rows):
        return None, None  # (all windows, or no window: not a mixed step)
    tail = rows[n:]
    tail_tokens = sum(r.num_tokens for r in tail)
    if n == 0 or any(r.num_draft or r.empty_window for r in tail):
        return None, "windows_not_first"
    if len(tail) > max_tail_rows(max_tail_tokens):
        return None, "tail_rows"
    if tail_tokens > max_tail_tokens:
        return None, "tail_tokens"
    if n * (1 + num_verify) + tail_tokens > capacity:
        return None, "token_buffers"
    return n, None


def shapes_logits(plan: StepPlan) -> bool:
    """Does a request of the step shape its logits (penalties, min_p, logit_bias, bad words:
    sample/logits_shaping.py)? A captured speculative step holds no shaping tensors: such a
    step replays its graph, drafting unshaped, and verifies again, eagerly, with the shaping
    (runner/spec_graphs.py). (A plain row samples after the forward, outside any graph.)"""
    return any(r.request.sampling_params.shapes_logits for r in plan.rows)


def mixed_decode_shape(
    sizes: Sequence[int], tail_tokens: int, plan: StepPlan
) -> tuple[tuple[int, int, int] | None, str | None]:
    """A plain step of decode rows, then a tail of prefill chunks: ((its decode rows n, the
    captured G, P), None), or (None, the reason it runs eagerly), or (None, None) when it is no
    such step. A step of prefill chunks alone (n = 0: a request admitted into an idle engine)
    that fits the tail replays the smallest mixed graph, its one decode row a pad row."""
    rows = plan.rows
    n = 0
    while n < len(rows) and rows[n].num_tokens == 1 and rows[n].do_sample:
        n += 1
    if n == len(rows) or any(r.num_draft or r.empty_window for r in rows):
        return None, None  # (nothing but decode rows, or windows)
    tail = rows[n:]  # (a one-token row may be in the tail: staged as a chunk of 1)
    if len(tail) > max_tail_rows(tail_tokens):
        return None, "tail_rows"
    if sum(r.num_tokens for r in tail) > tail_tokens:
        return None, "tail_tokens"
    size = padded_size(sizes, n)
    if size is None:
        return None, "batch_too_large"
    if any(PENDING_TOKEN in r.request.token_ids[r.start : r.end] for r in tail):
        return None, "pending_in_tail"
    return (n, size, tail_tokens), None


def prompt_scored(plan: StepPlan) -> tuple[tuple[tuple[int, int, int], ...], tuple[int, ...]]:
    """prompt_logprobs: the chunks' tokens whose logits score the next prompt token, as
    (plan row, first position, count), and those next tokens. The last prompt token's logits
    sample the first output instead (its logprobs are the output's).

      prompt [7, 8, 9, 5] in chunks [0, 2) and [2, 4): (row, 0, 2) scores 8, 9 in the first
      step, (row, 2, 1) scores 5 in the second (position 3's logits sample the first output)

    A step with any runs eagerly (its extra logits rows fit no captured shape).
    """
    scored, next_ids = [], []
    for i, row in enumerate(plan.rows):
        req = row.request
        last = min(row.end, req.num_prompt_tokens - 1)  # scored positions p < last
        if req.prompt_logprobs is None or row.num_draft or row.start >= last:
            continue
        scored.append((i, row.start, last - row.start))
        next_ids += req.token_ids[row.start + 1 : last + 1]
    return tuple(scored), tuple(next_ids)
