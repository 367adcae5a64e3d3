"""The layout of a mixed speculative step: windows, then a tail of plain rows.

A request admitted while others draft brings a prefill chunk into a step of windows. Run as one
eager step, that costs several times a captured one (the drafter, its Markov loop, the target
and verification each launched from Python). Laid out windows first, that step is a captured
speculative step with a tail: the drafter and verification see only the windows, the target
runs over every token, the drafter's context takes every token's features, and the tail's last
tokens are scored after the window tokens, for plain sampling after the replay.

Rows (target layout, block-table rows alike) and tokens, for G windows of width w and a tail
of P tokens in R rows (a graph's (G, P); eagerly G and P are the live counts, no pads):

  [ live windows | live tail rows | pad windows | one pad row of the tail's leftover tokens,
    then empty rows up to R ]

  K = 3 (w = 4), live windows 2 of G = 4, a prefill chunk of 5 tokens, P = 8, R = 2:
  rows          [win0 win1 | pre | pad pad | left]        cu [0 4 8 13 17 21 24]
  tokens        0..7 windows, 8..12 prefill, 13..20 pad windows, 21..23 leftover (P - 5 = 3)
  logits order  [0..7, 13..20 | 12, 0]: the G windows' tokens (verification reads these G * w
                rows), then one row per tail row: the tail rows that sample, then index 0

R is one more than the most live tail rows, so that the leftover always has a row.
A pad window j >= live windows reads block-table row j (a tail row's or a pad row's pages)
for its drafter block's context: reads only, its writes go to the scratch page, and its
results are never used. Every pad token writes its KV to the scratch page.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from dspark.request import PENDING_TOKEN
from dspark.runner.input_buffers import NO_OWNER, InputBuffers, StepLayout
from dspark.step_plan import SCRATCH_PAGE, ScheduledRow

# the live plain rows a captured mixed step of P tail tokens carries after its windows: one per
# TAIL_TOKENS_PER_ROW tokens, at least MIN_TAIL_ROWS (4 at P = 256, 8 at 512). Chat prompts of
# the development sources average ~88 tokens, so a tail's admissions are bounded by its tokens
# (~5.8 prompts at 512), not by its rows; an empty row costs a graph nearly nothing (a query
# run of length 0)
MIN_TAIL_ROWS = 4
TAIL_TOKENS_PER_ROW = 64


def max_tail_rows(tail_tokens: int) -> int:
    """Live tail rows of a captured mixed step with a tail of tail_tokens (its P).

    max_tail_rows(16) = 4     max_tail_rows(256) = 4     max_tail_rows(512) = 8
    """
    return max(MIN_TAIL_ROWS, tail_tokens // TAIL_TOKENS_PER_ROW)


def graph_tail_rows(tail_tokens: int) -> int:
    """R of a captured mixed step of P = tail_tokens: its live tail rows and one more, so that
    the leftover (P minus the live tail's tokens) always has a pad row."""
    return max_tail_rows(tail_tokens) + 1


class Tail(NamedTuple):
    """The tail rows as staged: their token count, and which of them sample: index into the
    tail and the token index each samples from."""

    num_tokens: int
    sampled: list[int]
    sampled_ends: list[int]  # the request index of the sampled token (its position)
    last_tokens: list[int]  # logits index of each sampled row: its chunk's last token


def stage_tail(
    b: InputBuffers,
    rows: tuple[ScheduledRow, ...],
    first_row: int,
    first_token: int,
    page_size: int,
) -> Tail:
    """Write the tail's rows from first_row and its tokens from first_token on (after the
    windows): each row's tokens [start, end) at their positions, KV slots from the request's
    pages, its cu end and seq_len.

      page_size 4, first_row 2, first_token 8, one chunk [start 0, 5 tokens) on pages [6, 2]
      tokens 8..12, positions [0 1 2 3 4], slots [24 25 26 27 8], cu[3] = 13, seq_lens[2] = 5
    """
    ids, positions, slots, cu_ends, seq_lens = [], [], [], [], []
    sampled, sampled_ends, last_tokens = [], [], []
    t = first_token
    for k, row in enumerate(rows):
        req, start, end = row.request, row.start, row.end
        tokens = req.token_ids[start:end]
        assert PENDING_TOKEN not in tokens, (
            f"request {req.request_id}: a mixed step's tail reads its tokens on the host"
        )
        pages = req.page_ids
        ids += tokens
        positions += range(start, end)
        slots += [pages[p // page_size] * page_size + p % page_size for p in range(start, end)]
        t += end - start
        cu_ends.append(t)
        seq_lens.append(end)
        if row.do_sample:
            sampled.append(k)
            sampled_ends.append(end)
            last_tokens.append(t - 1)
    t0, r0, r1 = first_token, first_row, first_row + len(rows)
    b.np("input_ids")[t0:t] = ids
    b.np("positions")[t0:t] = positions
    b.np("slot_mapping")[t0:t] = slots
    b.np("cu_num_tokens")[r0 + 1 : r1 + 1] = cu_ends
    b.np("seq_lens")[r0:r1] = seq_lens
    return Tail(t - t0, sampled, sampled_ends, last_tokens)


def write_tail_pads(
    b: InputBuffers, start_row: int, start_token: int, num_rows: int, num_tokens: int
) -> None:
    """Rows start_row..+num_rows pad the tail: the first holds num_tokens leftover tokens on
    the scratch page (none if 0), the others no token at all (a query run of length 0 does no
    work)."""
    if num_tokens:
        b.write_pad_rows(start_row, start_token, 1, num_tokens)
    first_empty = start_row + (1 if num_tokens else 0)
    r1 = start_row + num_rows
    b.np("cu_num_tokens")[first_empty + 1 : r1 + 1] = start_token + num_tokens
    b.np("seq_lens")[first_empty:r1] = 0
    b.np("block_table")[first_empty:r1] = SCRATCH_PAGE
    b.block_row_owner[first_empty:r1] = NO_OWNER


def capture_layout(num_windows: int, width: int, tail_tokens: int, tail_rows: int) -> StepLayout:
    """The layout a mixed graph (G, P) is captured with: G pad windows, then one pad row of P
    tokens and tail_rows - 1 empty rows. The host mirrors are upper bounds (the attention grid
    is sized by the longest query run, P)."""
    t_windows = num_windows * width
    cu = (*range(0, t_windows + 1, width), *([t_windows + tail_tokens] * tail_rows))
    return StepLayout(
        num_tokens=t_windows + tail_tokens,
        num_rows=num_windows + tail_rows,
        num_logits=t_windows + tail_rows,
        cu_num_tokens_cpu=cu,
        seq_lens_cpu=(width,) * num_windows + (tail_tokens,) + (0,) * (tail_rows - 1),
        window_width=width,
        tail_rows=tail_rows,
    )


def prepare_capture(b: InputBuffers, num_windows: int, width: int, tail_tokens: int,
                    tail_rows: int) -> StepLayout:  # fmt: skip
    """Fill the buffers with a mixed graph's capture inputs (the scratch page only). Each tail
    row's logits index is a token of the step: a tail of fewer tokens than rows (P = 4, R = 5)
    would otherwise index past its last token (a device-side assert in the capture's gather)."""
    t_windows = num_windows * width
    b.write_pad_rows(0, 0, num_windows, width)
    write_tail_pads(b, num_windows, t_windows, tail_rows, tail_tokens)
    last_token = t_windows + tail_tokens - 1
    b.np("logits_indices")[: t_windows + tail_rows] = np.minimum(
        np.arange(t_windows + tail_rows), last_token
    )
    return capture_layout(num_windows, width, tail_tokens, tail_rows)
