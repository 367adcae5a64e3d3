"""Steps of full-width windows whose verify lengths are chosen after drafting.

The trimmed cell (G, V) the drafting policy chose (StepPlan.trimmed_cell, spec/ragged.py) is
staged exactly like the full block; the captured trimmed cell (or, without graphs, the eager
step) chooses each row's verify length on the device under the budget D = V - G and runs the
target over the compacted windows. A step that cannot run it (some row is not a window or
wants logprobs, its G is not the cell's, fewer drafts than D) verifies the full block instead,
the reason counted (`trimmed_fallback_*`).

With the synchronous scheduler (speculative_config "scheduler": "sync", no graphs), a step of
such windows drafts, reads its survivals on the host, and Algorithm 1 (spec/planner.py) picks
each row's verify length from them, pricing a step of B tokens by the smallest cell of the cost
table that holds it; the windows are compacted to those lengths and the target runs over
exactly their tokens.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable

import torch

from dspark.engine.step_plan import StepPlan
from dspark.runner.input_buffers import InputBuffers, StepLayout
from dspark.runner.spec_graphs import trimmed_layout
from dspark.spec.planner import plan_sync
from dspark.spec.ragged import FullWidthWindows, TrimmedCell, compact_windows
from dspark.spec.spec_buffers import SamplingMode, WindowRow
from dspark.spec.spec_decoder import SpecDecoder, SpecStepOutput, TargetStep


def trimmed_tokens(
    plan: StepPlan,
    layout: StepLayout,
    rows: list[WindowRow],
    graph_size: int | None,
    widths: tuple[int, ...],  # the engine's trimmed cells, w of (G, w G)
    captured: dict[int, tuple[int, ...]],  # G -> V of the captured trimmed cells
) -> tuple[str | None, int | None]:  # (why not, V this step runs its trimmed cell with)
    """Whether the plan's trimmed cell can run: (None, V), or (the reason, None) for the full
    block; (None, None) when the policy gave the step no trimmed cell."""
    if plan.trimmed_cell is None:
        return None, None
    g, v = plan.trimmed_cell
    num_drafts = v - g  # D, the cell's budget of drafts (lagged.cell_geometry)
    if not widths:
        return "not_enabled", None
    if layout.window_width is None or layout.tail_rows:
        return "not_all_windows", None
    if any(plan.rows[r.table_row].request.sampling_params.logprobs is not None for r in rows):
        return "logprobs", None  # (the host packs logprobs by window lengths it knows)
    if sum(r.verify_len for r in rows) < num_drafts:
        return "fewer_drafts_than_budget", None
    if graph_size is not None and (graph_size != g or v not in captured.get(g, ())):
        return "cell_not_captured", None
    # a captured cell runs V tokens; an eager step, its R live rows and the same D
    return None, (v if graph_size is not None else len(rows) + num_drafts)


def trimmed_target(
    buffers: InputBuffers,
    spec: SpecDecoder,
    run_model: Callable,  # (layout, hidden_layers) -> ModelOutput
    num_rows: int,
    num_tokens: int,
) -> tuple[TargetStep, TrimmedCell]:
    """The target of num_rows full-width windows cut to num_tokens tokens: drafts go into the
    full-width ids, the target reads the compacted ones."""
    b, width = buffers, 1 + spec.num_verify
    t = num_rows * width
    windows = FullWidthWindows(
        b.input_ids[:t], b.positions[:t], b.slot_mapping[:t],
        b.cu_num_tokens[: num_rows + 1], b.seq_lens[:num_rows], width,
    )  # fmt: skip
    layout = trimmed_layout(num_rows, num_tokens, width)
    target = TargetStep(
        run=lambda: run_model(layout, spec.taps),
        input_ids=b.input_ids[:t],
        positions=b.positions[:num_tokens],
        slot_mapping=b.slot_mapping[:num_tokens],
        block_table=b.block_table,
    )
    return target, TrimmedCell(num_tokens, windows)


def planned_step(
    spec: SpecDecoder,
    buffers: InputBuffers,
    run_model: Callable,  # (layout, hidden_layers) -> ModelOutput
    rows: list[WindowRow],
    mode: SamplingMode,
    prices: tuple[int, dict[int, float], bool] | None,  # (G, V -> seconds, sampled) or None
    stats: Counter[str],
) -> SpecStepOutput:
    """The synchronous scheduler's step of full-width windows: draft, plan the verify lengths
    on the host from this block's survivals (Algorithm 1), compact, verify."""
    n = len(rows)
    st = spec.buffers.sampling(n, mode)
    block = spec.draft(n, st, buffers.input_ids, buffers.block_table[:n])
    # the staged lengths as the device holds them: a continuation's window may have been
    # shortened there near max_tokens (runner/continuations.py). (A host read; this eager
    # reference path reads the block's survivals at the same point anyway.)
    caps = spec.buffers.verify_cap[:n].tolist()
    if prices is None:  # no cost table for this batch: the full windows, counted
        stats["sync_plans_unpriced"] += 1
        lengths = caps
    else:
        g, cells, _ = prices
        # sync: the plan reads this step's survivals (the synchronous scheduler's second host
        # synchronisation of a drafting step; the lagged one has none)
        a = spec.calibrated_survival(st, block).tolist()
        lengths = plan_sync([s[:cap] for s, cap in zip(a, caps, strict=True)],
                            staircase(cells, g - n))  # fmt: skip
        stats["sync_plans"] += 1
        stats["sync_drafts_trimmed"] += sum(caps) - sum(lengths)  # (of those allowed)
    verify_len = torch.tensor(lengths, dtype=torch.int64, device=spec.device)
    num_tokens = n + sum(lengths)
    target, cell = trimmed_target(buffers, spec, run_model, n, num_tokens)
    cu = compact_windows(cell.windows, verify_len, num_tokens)
    return spec.finish(n, st, block, target, None, verify_len, cu)


def staircase(cells: dict[int, float], num_pad_rows: int) -> Callable[[int], float | None]:
    """Step time of B live tokens: the smallest measured cell that holds them with the G - R
    pad rows (one token each), never interpolated; None past the full block.

      cells {4: 1.0, 8: 1.2, 16: 2.0} (G 4), R 3: B 3 -> V 4: 1.0, B 5 -> V 8: 1.2,
      B 14 -> V 16: 2.0, B 16 -> None
    """
    sizes = sorted(cells)

    def step_time(num_tokens: int) -> float | None:
        i = bisect.bisect_left(sizes, num_tokens + num_pad_rows)
        return cells[sizes[i]] if i < len(sizes) else None

    return step_time
