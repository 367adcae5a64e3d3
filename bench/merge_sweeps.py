"""One sweep from its parts: `dspark bench --arms` results of disjoint levels, merged.

    python bench/merge_sweeps.py OUT.json PART.json [PART.json ...]

A whole sweep (C = 1 to 512 over six arms, three repeats) may not fit one session on a remote
GPU, so it runs in parts (`dspark bench --concurrency 1,2`, then `4,8,...,256`, ...).
Each part is one run with its arms side by side; this concatenates every arm's levels in
concurrency order and recomputes the ratios between arms (level by level, so no ratio mixes
two runs), then draws the throughput plot (dspark.benchmarks.plot) beside OUT.json. The parts
must agree on what makes a level comparable: arms and their configs, temperature, output
lengths, waves, repeats, prompts; a level measured in two parts is refused.

    part A: arms plain, k7, scheduled; levels 1, 64      part B: the same arms; level 256
    merged: arms plain, k7, scheduled; levels 1, 64, 256; "parts": [A's command, B's command]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dspark.benchmarks.plot import plot_results
from dspark.benchmarks.report import arm_ratios

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


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    out = Path(sys.argv[1])
    merged = merge([json.loads(Path(p).read_text()) for p in sys.argv[2:]])
    out.write_text(json.dumps(merged, indent=1))
    plot_results(out, out.with_suffix(".png"))
    for row in merged["arm_ratios"]:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
