"""The ECE a perfectly calibrated predictor would read on a calibration's own bins: how much of
a measured ECE is the estimate's sampling noise.

For each position, calibration.json's reliability bins ("after") hold [count, mean score, mean
label]. Were the scores calibrated, each bin's labels would be Binomial(count, mean score); the
ECE of such labels against the scores, averaged over draws, is the floor that a finite sample
puts under any ECE (with 20 bins of a few hundred blocks, about 1%).

    python bench/ece_floor.py dspark/drafters/smollm2_135m_instruct/calibration.json
"""

import json
import sys

import numpy as np

DRAWS = 2000


def floor(bins: list[list[float]], rng: np.random.Generator) -> tuple[float, float]:
    """(measured ECE, mean ECE of calibrated labels drawn for the same bins)."""
    b = np.asarray(bins, dtype=float)  # [num_bins, 3]: count, mean score, mean label
    n, score, label = b[:, 0], np.clip(b[:, 1], 0.0, 1.0), b[:, 2]
    total = n.sum()
    measured = float((n * np.abs(score - label)).sum() / total)
    draws = rng.binomial(n.astype(int), score, size=(DRAWS, len(n))) / np.maximum(n, 1)
    return measured, float((n * np.abs(score - draws)).sum(axis=1).mean() / total)


def main(path: str) -> None:
    report = json.load(open(path))
    rng = np.random.default_rng(0)
    sections = [("sampled", report)]
    if "greedy" in report:
        sections.append(("greedy", report["greedy"]))
    for name, section in sections:
        rows = [floor(bins, rng) for bins in section["reliability"]["after"]]
        print(f"{name} ({section['num_blocks']:,} blocks), ECE % after STS, per position:")
        print("  measured", " ".join(f"{m * 100:5.2f}" for m, _ in rows))
        print("  floor   ", " ".join(f"{f * 100:5.2f}" for _, f in rows))


if __name__ == "__main__":
    main(sys.argv[1])
