"""Print cost tables side by side: every G's plain step and full block, in ms, per table.

    python bench/compare_cost_tables.py new=new.json old=old.json [more...]

Each argument is NAME=PATH (or a bare path, named by its file stem). The first table is the
reference: the last columns are every other table's cells over its cells. Greedy cells, then the
sampled ones where the tables have them.
"""

from __future__ import annotations

import sys
from pathlib import Path

from dspark.policy.cost_table import CostTable, full_block_tokens, parse_table


def load(argument: str) -> tuple[str, CostTable]:
    name, _, path = argument.rpartition("=")
    return name or Path(path).stem, parse_table(Path(path).read_text())


def print_cells(tables: list[tuple[str, CostTable]], sampled: bool) -> None:
    cells = [table.sampled_cells if sampled else table.cells for _, table in tables]
    if any(c is None for c in cells):
        return
    names = [name for name, _ in tables]
    print(
        f"{'sampled_cells' if sampled else 'cells'} (ms): G | "
        + " | ".join(f"{n} plain, full" for n in names)
        + "".join(f" | {n}/{names[0]} plain, full" for n in names[1:])
    )
    k = tables[0][1].fingerprint["draft_len"]
    for g in sorted(cells[0]):
        if not all(g in c for c in cells):
            continue
        row = [(c[g][g], c[g][full_block_tokens(g, k)]) for c in cells]
        text = " | ".join(f"{p * 1e3:.3f}, {f * 1e3:.3f}" for p, f in row)
        ratios = "".join(f" | {p / row[0][0]:.3f}, {f / row[0][1]:.3f}" for p, f in row[1:])
        print(f"{g:>4} | {text}{ratios}")


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    tables = [load(argument) for argument in sys.argv[1:]]
    print_cells(tables, sampled=False)
    print_cells(tables, sampled=True)


if __name__ == "__main__":
    main()
