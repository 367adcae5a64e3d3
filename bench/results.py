"""Result files read together: cost tables side by side, a sweep's parts merged into one.

    python bench/results.py cost-tables new=new.json old=old.json [more...]
    python bench/results.py merge-sweeps OUT.json PART.json [PART.json ...]

cost-tables   prints `dspark profile` tables side by side: every G's plain step and full
              block, in ms, per table. Each argument is NAME=PATH (or a bare path, named by its
              file stem). The first table is the reference: the last columns are every other
              table's cells over its cells. Greedy cells, then the sampled ones where the
              tables have them.
merge-sweeps  one sweep from its parts: `dspark bench --arms` results of disjoint levels,
              merged. A whole sweep (C = 1 to 512 over six arms, three repeats) may not fit one
              session on a remote GPU, so it runs in parts (`dspark bench --concurrency 1,2`,
              then `4,8,...,256`, ...). Each part is one run with its arms side by side; this
              concatenates every arm's levels in concurrency order and recomputes the ratios
              between arms (level by level, so no ratio mixes two runs), then draws the
              throughput plot (dspark.benchmarks.plot) beside OUT.json. The parts must agree on
              what makes a level comparable: arms and their configs, temperature, output
              lengths, waves, repeats, prompts; a level measured in two parts is refused.

    part A: arms plain, k7, scheduled; levels 1, 64      part B: the same arms; level 256
    merged: arms plain, k7, scheduled; levels 1, 64, 256; "parts": [A's command, B's command]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dspark.benchmarks.plot import plot_results
from dspark.benchmarks.report import arm_ratios
from dspark.policy.cost_table import CostTable, full_block_tokens, parse_table

# ---- cost tables ---------------------------------------------------------------------------


def load_table(argument: str) -> tuple[str, CostTable]:
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


def cost_tables(args: argparse.Namespace) -> None:
    tables = [load_table(argument) for argument in args.tables]
    print_cells(tables, sampled=False)
    print_cells(tables, sampled=True)


# ---- merge sweeps --------------------------------------------------------------------------

# what every part must share for its levels to sit in one table
SAME = ("device", "model", "dtype", "output_len", "output_len_spread", "temperature",
        "max_prompt_len", "repeats", "waves", "min_requests", "sources", "seed",
        "prompt_split")  # fmt: skip


def merge(parts: list[dict]) -> dict:
    first = parts[0]
    for part in parts[1:]:
        for key in SAME:
            if part.get(key) != first.get(key):
                raise ValueError(f"parts differ in {key}: {first.get(key)!r} vs {part.get(key)!r}")
        configs = {n: a["speculative_config"] for n, a in part["arms"].items()}
        if configs != {n: a["speculative_config"] for n, a in first["arms"].items()}:
            raise ValueError(f"parts differ in their arms: {sorted(configs)} vs "
                             f"{sorted(first['arms'])} (or their speculative_config)")  # fmt: skip
    merged = {k: v for k, v in first.items()
              if k not in ("arms", "arm_ratios", "dspark", "ratios", "plot", "hf")}  # fmt: skip
    levels = sorted(c for part in parts for c in part["concurrency"])
    if len(set(levels)) != len(levels):
        raise ValueError(f"a level was measured in two parts: {levels}")
    merged["concurrency"] = levels
    merged["parts"] = [{"command": p.get("command"), "concurrency": p["concurrency"],
                        "git_commit": p.get("git_commit"), "date": p.get("date")}
                       for p in parts]  # fmt: skip
    commits = dict.fromkeys(str(p.get("git_commit")) for p in parts)  # (in order, once each)
    merged["git_commit"] = ", ".join(commits)
    merged["hf"] = None
    merged["arms"] = {}
    for name, arm in first["arms"].items():
        arm_levels = [lv for p in parts for lv in p["arms"][name]["levels"]]
        merged["arms"][name] = {
            "speculative_config": arm["speculative_config"],
            "warmup": [p["arms"][name].get("warmup") for p in parts],
            "levels": sorted(arm_levels, key=lambda lv: lv["concurrency"]),
        }
    merged["dspark"] = next(iter(merged["arms"].values()))
    merged["arm_ratios"] = arm_ratios(tuple(levels), merged["arms"])
    return merged


def merge_sweeps(args: argparse.Namespace) -> None:
    out = Path(args.out)
    merged = merge([json.loads(Path(p).read_text()) for p in args.parts])
    out.write_text(json.dumps(merged, indent=1))
    plot_results(out, out.with_suffix(".png"))
    for row in merged["arm_ratios"]:
        print(json.dumps(row))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("cost-tables", help="cost tables side by side, and their ratios")
    c.add_argument("tables", nargs="+", help="NAME=PATH or PATH; the first is the reference")
    c.set_defaults(func=cost_tables)
    m = sub.add_parser("merge-sweeps", help="a sweep's parts (disjoint levels) merged into one")
    m.add_argument("out", help="the merged result (its plot beside it, .png)")
    m.add_argument("parts", nargs="+", help="dspark bench --arms results")
    m.set_defaults(func=merge_sweeps)
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
