"""Print cost tables side by side: every G's plain step and full block, in ms, per table.

    python bench/compare_cost_tables.py new=new.json old=old.json [more...]

Each argument is NAME=PATH (or a bare path, named by its file stem). The first table is the
reference: the last columns are every other table's cells over its cells. Greedy cells, then the
sampled ones where the tables have them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def load(argument: str) -> tuple[str, dict]:
    name, _, path = argument.rpartition("=")
    return name or Path(path).stem, json.loads(Path(path).read_text())


def full_block(cells: dict) -> tuple[str, float]:
    """The cell of a batch with the most verified tokens (the whole block of every row)."""
    width = max(cells, key=int)
    return width, cells[width]


def print_cells(tables: list[tuple[str, dict]], key: str) -> None:
    if not all(key in table for _, table in tables):
        return
    names = [name for name, _ in tables]
    print(
        f"{key} (ms): G | "
        + " | ".join(f"{n} plain, full" for n in names)
        + "".join(f" | {n}/{names[0]} plain, full" for n in names[1:])
    )
    reference = tables[0][1][key]
    for g in sorted(reference, key=int):
        if not all(g in table[key] for _, table in tables):
            continue
        row = []
        for _, table in tables:
            cells = table[key][g]
            row.append((cells[g], full_block(cells)[1]))
        text = " | ".join(f"{p * 1e3:.3f}, {f * 1e3:.3f}" for p, f in row)
        ratios = "".join(f" | {p / row[0][0]:.3f}, {f / row[0][1]:.3f}" for p, f in row[1:])
        print(f"{g:>4} | {text}{ratios}")


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    tables = [load(argument) for argument in sys.argv[1:]]
    print_cells(tables, "cells")
    print_cells(tables, "sampled_cells")


if __name__ == "__main__":
    main()
