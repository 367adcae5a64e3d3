"""runner/shapes.py: which captured shape a plan fits, on hand-built plans (the docstring's
worked examples)."""

from __future__ import annotations

from dspark.request import PENDING_TOKEN, Request
from dspark.runner.shapes import (
    decode_size,
    leading_windows,
    mixed_decode_shape,
    padded_size,
    prompt_scored,
    shapes_logits,
    tail_size,
    window_width,
)
from dspark.sampling_params import SamplingParams
from dspark.step_plan import ScheduledRow, StepPlan

K = 3  # drafts verified per window: windows are laid out K + 1 = 4 wide


def _request(num_tokens: int) -> Request:
    req = Request("r", list(range(3, 3 + num_tokens)), SamplingParams(), 0, 2, 0.0)
    req.token_ids = list(req.prompt_token_ids)
    return req


def _window(num_draft: int = K) -> ScheduledRow:
    return ScheduledRow(_request(8), 7, 1 + num_draft, True, num_draft)


def _empty_window() -> ScheduledRow:
    return ScheduledRow(_request(8), 7, 1, True, 0, empty_window=True)


def _decode() -> ScheduledRow:
    return ScheduledRow(_request(8), 7, 1, True)


def _prefill(num_tokens: int) -> ScheduledRow:
    return ScheduledRow(_request(num_tokens), 0, num_tokens, True)


def test_a_step_pads_to_the_smallest_size_and_tail_that_hold_it():
    sizes = [1, 2, 4, 8]
    assert [padded_size(sizes, n) for n in (1, 3, 8, 9)] == [1, 4, 8, None]
    tails = (256, 512)
    assert tail_size(tails, 200, 3) == 256  # 200 tail tokens in 3 rows
    assert tail_size(tails, 300, 3) == 512
    assert tail_size(tails, 200, 6) == 512  # 6 rows: more than P 256's 4
    plan = StepPlan(tuple(_decode() for _ in range(9)), is_decode=True)
    assert decode_size(sizes, plan) == (None, "batch_too_large")
    assert decode_size(sizes, StepPlan(plan.rows[:3], is_decode=True)) == (4, None)


def test_uniform_windows_need_every_row_a_window_and_room_in_the_buffers():
    windows = StepPlan((_window(), _window(1), _empty_window()))
    assert window_width(windows, K, capacity=12) == 4
    assert window_width(windows, K, capacity=11) is None  # 3 rows x 4 tokens
    assert window_width(StepPlan((_window(), _prefill(5))), K, 64) is None
    assert window_width(StepPlan((_empty_window(), _empty_window())), K, 64) is None


def test_a_mixed_drafting_step_has_its_windows_first_and_a_tail_that_fits():
    def lead(*rows, max_tail_tokens=16):
        return leading_windows(StepPlan(rows), K, 64, max_tail_tokens)

    assert lead(_window(), _window(), _window(), _prefill(5), _prefill(3)) == (3, None)
    assert lead(_window(), _window()) == (None, None)  # all windows: not a mixed step
    assert lead(_prefill(5), _decode()) == (None, None)  # no window
    assert lead(_prefill(5), _window(), _window()) == (None, "windows_not_first")
    assert lead(_window(), _prefill(17)) == (None, "tail_tokens")
    assert lead(_window(), *[_prefill(2) for _ in range(5)]) == (None, "tail_rows")
    assert leading_windows(StepPlan((_window(), _prefill(9))), K, 12, 16) == (
        None, "token_buffers")  # fmt: skip


def test_a_mixed_decode_step_fits_the_tail_or_says_why_not():
    sizes, tail = [1, 2, 4], 16
    two_decodes_and_a_chunk = StepPlan((_decode(), _decode(), _prefill(6)))
    assert mixed_decode_shape(sizes, tail, two_decodes_and_a_chunk) == ((2, 2, 16), None)
    # a request admitted into an idle engine: no decode row, the smallest graph
    assert mixed_decode_shape(sizes, tail, StepPlan((_prefill(6),))) == ((0, 1, 16), None)
    assert mixed_decode_shape(sizes, tail, StepPlan((_decode(), _decode()))) == (None, None)
    assert mixed_decode_shape(sizes, tail, StepPlan((_decode(), _prefill(17)))) == (
        None, "tail_tokens")  # fmt: skip
    five = StepPlan((_decode(), *[_prefill(2) for _ in range(5)]))
    assert mixed_decode_shape(sizes, tail, five) == (None, "tail_rows")
    wide = StepPlan((*[_decode() for _ in range(5)], _prefill(3)))
    assert mixed_decode_shape(sizes, tail, wide) == (None, "batch_too_large")
    pending = _prefill(4)
    pending.request.token_ids[2] = PENDING_TOKEN
    assert mixed_decode_shape(sizes, tail, StepPlan((_decode(), pending))) == (
        None, "pending_in_tail")  # fmt: skip
    assert mixed_decode_shape(sizes, tail, StepPlan((_window(), _prefill(3)))) == (None, None)


def test_shaping_windows_fit_captured_shapes_and_prompt_scoring_fits_none():
    """A mixed drafting step with a request that shapes its logits keeps its captured shape
    (verified again with the shaping: runner/spec_graphs.py); prompt [7, 8, 9, 5] with
    prompt_logprobs in chunks [0, 2) and [2, 4) scores 8, 9 then 5."""
    shaped = _window()
    shaped.request.sampling_params = SamplingParams(presence_penalty=0.5)
    plan = StepPlan((_window(), shaped, _prefill(3)))
    assert shapes_logits(plan) and not shapes_logits(StepPlan((_window(), _prefill(3))))
    assert leading_windows(plan, K, 64, 16) == (2, None)
    req = Request("p", [7, 8, 9, 5], SamplingParams(prompt_logprobs=1), 0, 2, 0.0)
    first = StepPlan((_decode(), ScheduledRow(req, 0, 2, False)))
    second = StepPlan((ScheduledRow(req, 2, 2, True),))
    assert prompt_scored(first) == (((1, 0, 2),), (8, 9))
    assert prompt_scored(second) == (((0, 2, 1),), (5,))
    assert prompt_scored(StepPlan((_prefill(4),))) == ((), ())  # no prompt_logprobs
