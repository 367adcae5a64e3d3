"""The calibration reliability diagram: per position, mean predicted survival against the
realised rate in each of the ECE's equal-width bins, before and after STS.

calibration.json's "reliability" (one per section) holds, for "before" and "after", one list per
position of [count, mean score, mean label] per bin (the same bins as the ECE, calibrate.py):

  scores [0.1, 0.15, 0.9], labels [0, 1, 1], 20 bins -> bin 2 [1, 0.1, 0.0],
  bin 3 [1, 0.15, 1.0], bin 18 [1, 0.9, 1.0], every other bin [0, 0.0, 0.0]

`plot_reliability` draws it from calibration.json alone (`dspark calibrate --plot`), with
matplotlib's Figure and no pyplot, so no GUI backend is chosen.
"""

from __future__ import annotations

from pathlib import Path

import torch


def reliability_bins(
    scores: torch.Tensor,  # [N] in [0, 1]
    labels: torch.Tensor,  # [N] 0/1
    num_bins: int,
) -> list[list[float]]:  # [num_bins] of [count, mean score, mean label]
    bins = (scores * num_bins).long().clamp(0, num_bins - 1)
    count = torch.zeros(num_bins).scatter_add_(0, bins, torch.ones_like(scores, dtype=torch.float))
    score_sum = torch.zeros(num_bins).scatter_add_(0, bins, scores.float())
    label_sum = torch.zeros(num_bins).scatter_add_(0, bins, labels.float())
    safe = count.clamp(min=1)
    return [[int(c), float(s), float(y)]
            for c, s, y in zip(count, score_sum / safe, label_sum / safe, strict=True)]  # fmt: skip


def plot_reliability(report: dict, path: Path) -> Path:
    """One panel per section (sampled, greedy), one line per position; needs "reliability"."""
    from matplotlib.figure import Figure

    from dspark.benchmarks.plot import save_png

    sections = [("sampled", report)] + (
        [("greedy", report["greedy"])] if "greedy" in report else []
    )
    fig = Figure(figsize=(6 * len(sections), 5.5))
    for i, (name, section) in enumerate(sections):
        if "reliability" not in section:
            raise ValueError(f"{name} section has no reliability bins: rerun dspark calibrate")
        ax = fig.add_subplot(1, len(sections), i + 1)
        ax.plot([0, 1], [0, 1], color="grey", linestyle=":", label="perfect")
        for k, bins in enumerate(section["reliability"]["after"]):
            used = [(s, y) for c, s, y in bins if c > 0]
            ece = 100 * section["ece_after"][k]
            ax.plot(*zip(*used, strict=True), marker="o", markersize=3,
                    label=f"position {k + 1} (ECE {ece:.1f}%)")  # fmt: skip
        ax.set_xlabel("predicted survival a[k] (after STS)")
        ax.set_ylabel("realised: drafts 1..k accepted")
        ax.set_title(f"{name} rollouts (T = {section['sampling_temperature']:g}), "
                     f"{section['num_blocks']:,} blocks")  # fmt: skip
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return save_png(fig, Path(path), dpi=110)
