"""The chosen verify budget against concurrency, from a `dspark bench --arms` result.

    python bench/plot_budget.py RESULT.json OUT.png

For every arm whose engine decided drafting per step (a drafting policy): the share of steps
that drafted, and the mean window a drafting step verified per row (1 + verified drafts: 1 + K
for the full block, less in trimmed or planned cells), per concurrency level. Fixed-K arms draft
every step with full windows and are drawn for reference.
"""

from __future__ import annotations

import json
import sys


def budget_rows(result: dict) -> dict[str, list[tuple[int, float, float]]]:
    """arm -> [(concurrency, share of steps drafting, mean window of a drafting step)]."""
    rows = {}
    for name, arm in result["arms"].items():
        points = []
        for level in arm["levels"]:
            spec = level.get("speculation")
            if not spec or not spec.get("num_drafts"):
                continue
            policy = spec.get("drafting_policy") or {}
            steps = policy.get("steps_drafting", 0) + policy.get("steps_not_drafting", 0)
            share = policy["steps_drafting"] / steps if steps else 1.0
            window = 1 + spec["num_draft_tokens"] / spec["num_drafts"]
            points.append((level["concurrency"], share, window))
        if points:
            rows[name] = points
    return rows


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = json.load(open(sys.argv[1]))
    rows = budget_rows(result)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, points in rows.items():
        c = [p[0] for p in points]
        ax1.plot(c, [p[1] for p in points], marker="o", label=name)
        ax2.plot(c, [p[2] for p in points], marker="o", label=name)
    for ax, title in ((ax1, "share of steps that draft"),
                      (ax2, "mean window of a drafting step (1 + verified)")):  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    ax1.set_ylim(0, 1.05)
    ax2.set_ylim(1, max(p[2] for points in rows.values() for p in points) + 0.5)
    ax1.legend()
    fig.suptitle(f"chosen verify budget, temperature {result.get('temperature')}")
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=100)
    for name, points in rows.items():
        print(name, " ".join(f"C={c}: {s:.2f} x {w:.2f}" for c, s, w in points))


if __name__ == "__main__":
    main()
