"""`dspark profile`: measure the cost table of the engine it builds and show it (the measuring
is engine/cost_profile.py's, which the engine's start-up profile shares; the format is
policy/cost_table.py), and compare a new table with the one in use.
"""

from __future__ import annotations

import statistics

from dspark.engine import cost_profile
from dspark.llm import LLM
from dspark.policy.cost_table import CostTable, full_block_tokens


def profile_cost_table(
    llm: LLM, batches: list[int], steps: int = 8, warmup: int = 3, prompt_len: int = 64,
    rounds: int = 2, sampled: bool = True,
) -> CostTable:  # fmt: skip
    """Measure every cell of each G in batches on llm's engine (cost_profile.measure_cost_table)."""
    return cost_profile.measure_cost_table(llm.engine, batches, steps, warmup, prompt_len,
                                           rounds, sampled)  # fmt: skip


def drain(llm: LLM) -> None:
    """Abort every request of llm's engine and step until it has forgotten them."""
    cost_profile.drain(llm.engine)


def format_table(table: CostTable, draft_len: int) -> str:
    rows = [
        "    G   plain ms   full ms   full / plain"
        + ("   sampled: plain ms   full ms   full / plain" if table.sampled_cells else "")
    ]
    for g, row in sorted(table.cells.items()):
        line = _cells_text(row, g, draft_len)
        if table.sampled_cells:
            line += "           " + _cells_text(table.sampled_cells[g], g, draft_len)
        rows.append(f"{g:>5} " + line)
    trimmed = _trimmed_text(table, draft_len)
    return "\n".join(rows + ([trimmed] if trimmed else []))


def _trimmed_text(table: CostTable, draft_len: int) -> str:
    """The trimmed cells, as tokens per row w: step ms (over plain), greedy then sampled."""
    lines = []
    for name, cells in (("greedy", table.cells), ("sampled", table.sampled_cells or {})):
        for g, row in sorted(cells.items()):
            full = full_block_tokens(g, draft_len)
            trimmed = [(v, t) for v, t in sorted(row.items()) if g < v < full]
            if trimmed:
                text = "  ".join(f"w={v // g}: {t * 1e3:.3f} ({t / row[g]:.2f})"
                                 for v, t in trimmed)  # fmt: skip
                lines.append(f"{g:>5} {name} trimmed cells ms (/ plain): {text}")
    return "\n".join(lines)


def _cells_text(row: dict[int, float], g: int, draft_len: int) -> str:
    plain, full = row[g], row[full_block_tokens(g, draft_len)]
    return f"{plain * 1e3:>10.3f} {full * 1e3:>9.3f} {full / plain:>14.2f}"


# a new table whose cells read this much above (or below) a reference table's, in median, is
# worth profiling again: one of five profiles on the H200 read 8-53% high in most cells
DRIFT_WARNING = 0.05


def reference_drift(table: CostTable, reference: CostTable) -> tuple[float, int] | None:
    """The median of new / reference step time over the cells both tables measured (greedy and
    sampled), and how many there were; None when they share no cell.

      new {1: {1: 0.8, 8: 1.4}}, reference {1: {1: 0.7, 8: 1.2}}  ->  (1.155, 2)
    """
    ratios = []
    for new, ref in ((table.cells, reference.cells),
                     (table.sampled_cells or {}, reference.sampled_cells or {})):  # fmt: skip
        for g, row in new.items():
            ratios += [t / ref[g][v] for v, t in row.items() if v in ref.get(g, {})]
    return (statistics.median(ratios), len(ratios)) if ratios else None
