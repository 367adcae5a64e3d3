"""Steps of full-width windows whose verify lengths are chosen after drafting.

The trimmed cell (G, V) the drafting policy chose (StepPlan.trimmed_cell, spec/ragged.py) is
staged exactly like the full block; the captured trimmed cell (or, without graphs, the eager
step) chooses each row's verify length on the device under the budget D = V - G and runs the
target over the compacted windows. A step that cannot run it (some row is not a window, wants
logprobs or follows a grammar, its G is not the cell's) verifies the full block instead, the
reason counted (`trimmed_fallback_*`). Rows whose caps hold fewer than D drafts run the cell
all the same: it verifies every candidate within the cell's reach, in fewer tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dspark.policy.cells import cell_reach
from dspark.runner.input_buffers import InputBuffers, StepLayout
from dspark.runner.spec_graphs import trimmed_layout
from dspark.spec.ragged import FullWidthWindows, TrimmedCell
from dspark.spec.spec_buffers import WindowRow
from dspark.spec.spec_decoder import SpecDecoder, TargetStep
from dspark.step_plan import StepPlan


def trimmed_tokens(
    plan: StepPlan,
    layout: StepLayout,
    rows: list[WindowRow],
    graph_size: int | None,
    widths: tuple[int, ...],  # the engine's trimmed cells, w of (G, w G)
    captured: dict[int, tuple[int, ...]],  # G -> V of the captured trimmed cells
    candidates: int,  # the drafts the rows' caps hold: sum of their verify_len
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
    if plan.grammar_rows:  # (the host fills masks along the K drafts it staged)
        return "structured_output", None
    if graph_size is not None and (graph_size != g or v not in captured.get(g, ())):
        return "cell_not_captured", None
    # A captured cell runs V tokens; an eager step its R live rows and the same D, or all the
    # candidates where the rows' caps hold fewer (windows shortened near max_tokens, a G
    # padded past its live rows): every candidate is then verified, as the full block would,
    # in fewer tokens; a captured cell's leftover tokens write the scratch page (ragged.py).
    #   G 64 (R 40 live), K 7, V 6 G = 384: D 320 > 280 candidates; eager V = 40 + 280
    if graph_size is not None:
        return None, v
    return None, len(rows) + min(num_drafts, candidates)


def trimmed_target(
    buffers: InputBuffers,
    spec: SpecDecoder,
    run_model: Callable,  # (layout, hidden_layers) -> ModelOutput
    num_rows: int,
    num_tokens: int,
    cell: tuple[int, int],  # (G, V) the policy chose: its reach (policy/cells.py cell_reach)
    logits_out: torch.Tensor | None = None,  # the graph set's logits (captured steps)
) -> tuple[TargetStep, TrimmedCell]:
    """The target of num_rows full-width windows cut to num_tokens tokens (the cell's V, or an
    eager step's fewer): drafts go into the full-width ids, the target reads the compacted
    ones."""
    b, width = buffers, 1 + spec.num_verify
    t = num_rows * width
    windows = FullWidthWindows(
        b.input_ids[:t], b.positions[:t], b.slot_mapping[:t],
        b.cu_num_tokens[: num_rows + 1], b.seq_lens[:num_rows], width,
    )  # fmt: skip
    layout = trimmed_layout(num_rows, num_tokens, width)
    target = TargetStep(
        run=lambda: run_model(layout, spec.taps, logits_out),
        input_ids=b.input_ids[:t],
        positions=b.positions[:num_tokens],
        slot_mapping=b.slot_mapping[:num_tokens],
        block_table=b.block_table,
    )
    return target, TrimmedCell(num_tokens, windows, cell_reach(*cell, spec.num_verify))
