"""Sequential temperature scaling (STS, docs/SPECULATION.md 3.3) of the confidence head, and
calibration.json.

Calibrated c[k] = sigmoid(logit[k] / T_k), one temperature per drafted position. The scheduler
adds survivals a[k] = prod_{i<=k} c[i] up as expected tokens, so they must be right in absolute
terms. Fit on full-block rollouts of held-out prompts (rollouts.py): for k = 1..K in order, T_k
is the grid value (256 log-spaced in [0.05, 20]) minimising the expected calibration error of
a[k] against y_k = 1[drafts 1..k accepted], with T_1..T_{k-1} already fixed.

ECE with 20 equal-width bins over [0, 1] (bin b holds scores in [b/20, (b+1)/20), 1.0 in the last):
  ECE = sum_b (n_b / N) |mean score in b - mean label in b| = sum_b |sum_{i in b} (s_i - y_i)| / N
  scores [0.1, 0.15, 0.9], labels [0, 1, 1] -> bins 2, 3, 18 -> (0.1 + 0.85 + 0.1) / 3 = 0.35

calibration.json, beside the drafter's config.json (read with load_calibration):
  {"method": "sts", "draft_len": K, "temperatures": [T_1 .. T_K],
   "ece_before": [K values], "ece_after": [K values], "num_blocks": N,
   "sampling_temperature": the temperature the rollouts sampled at,
   "num_bins": 20, "grid": {"min": 0.05, "max": 20.0, "size": 256},
   "reliability": {"before": ..., "after": ...} (the diagram's bins, reliability.py),
   "greedy": {the same fields, fitted on greedy rollouts of the same prompts}}

The greedy section is what the engine uses for requests with temperature 0 (a greedy request
keeps more drafts than a sampled one for the same raw confidence: dspark/spec/calibration.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from dspark.llm import LLM
from dspark.spec.calibration import CALIBRATION_FILE, load_calibration  # noqa: F401 (re-export)
from dspark.train.reliability import reliability_bins
from dspark.train.rollouts import record_confidences, rollout

NUM_BINS = 20
GRID_MIN, GRID_MAX, GRID_SIZE = 0.05, 20.0, 256


def temperature_grid() -> torch.Tensor:  # [G] log-spaced
    return torch.logspace(math.log10(GRID_MIN), math.log10(GRID_MAX), GRID_SIZE)


def expected_calibration_error(
    scores: torch.Tensor,  # [..., N] in [0, 1]
    labels: torch.Tensor,  # [N] 0/1
    num_bins: int = NUM_BINS,
) -> torch.Tensor:  # [...]
    """ECE with equal-width bins (worked example in the module docstring)."""
    n = scores.shape[-1]
    if n == 0:
        return torch.zeros(scores.shape[:-1])
    bins = (scores * num_bins).long().clamp(0, num_bins - 1)  # [..., N]
    gap = scores - labels.to(scores.dtype)  # [..., N]
    per_bin = torch.zeros(*scores.shape[:-1], num_bins, dtype=scores.dtype)
    per_bin.scatter_add_(-1, bins, gap)
    return per_bin.abs().sum(dim=-1) / n


def survival(logits: torch.Tensor, temperatures: list[float] | torch.Tensor) -> torch.Tensor:
    """a[k] = prod_{i<=k} sigmoid(logit[i] / T_i): [N, K] -> [N, K]."""
    t = torch.as_tensor(temperatures, dtype=torch.float32)
    return torch.sigmoid(logits.float() / t).cumprod(dim=-1)


def ece_per_position(
    logits: torch.Tensor, labels: torch.Tensor, temperatures: list[float] | torch.Tensor
) -> list[float]:
    a = survival(logits, temperatures)  # [N, K]
    return [float(expected_calibration_error(a[:, k], labels[:, k])) for k in range(a.shape[1])]


def fit_sts(logits: torch.Tensor, labels: torch.Tensor) -> list[float]:
    """Per-position temperatures, fitted left to right (module docstring). [N, K] each."""
    grid = temperature_grid()  # [G]
    N, K = logits.shape
    prefix = torch.ones(N)  # a[k-1] under the temperatures fixed so far
    temperatures: list[float] = []
    for k in range(K):
        candidates = prefix[None, :] * torch.sigmoid(logits[None, :, k].float() / grid[:, None])
        ece = expected_calibration_error(candidates, labels[:, k])  # [G]
        best = int(ece.argmin())  # ties: the smallest temperature (first on the grid)
        temperatures.append(float(grid[best]))
        prefix = candidates[best]
    return temperatures


def calibration_report(
    logits: torch.Tensor, labels: torch.Tensor, sampling_temperature: float
) -> dict:
    """Fit STS and describe it in calibration.json's format."""
    K = logits.shape[1]
    if logits.shape[0] == 0:
        raise ValueError("no full-block verify steps were recorded: nothing to calibrate on")
    temperatures = fit_sts(logits, labels)
    return {
        "method": "sts",
        "draft_len": K,
        "temperatures": temperatures,
        "ece_before": ece_per_position(logits, labels, [1.0] * K),
        "ece_after": ece_per_position(logits, labels, temperatures),
        "num_blocks": int(logits.shape[0]),
        "sampling_temperature": sampling_temperature,
        "num_bins": NUM_BINS,
        "grid": {"min": GRID_MIN, "max": GRID_MAX, "size": GRID_SIZE},
        "reliability": {
            name: [reliability_bins(a[:, k], labels[:, k], NUM_BINS) for k in range(K)]
            for name, a in (
                ("before", survival(logits, [1.0] * K)),
                ("after", survival(logits, temperatures)),
            )
        },  # fmt: skip
    }


def write_calibration(drafter_dir: Path, report: dict) -> Path:
    path = drafter_dir / CALIBRATION_FILE
    path.write_text(json.dumps(report, indent=1))
    return path


def format_ece_table(report: dict) -> str:
    sections = [("", report)] + ([("greedy ", report["greedy"])] if "greedy" in report else [])
    rows = []
    for name, r in sections:
        rows.append(f"{name}(rollouts at temperature {r['sampling_temperature']:g})")
        rows.append("position  T_k     ECE before  ECE after")
        for k, (t, b, a) in enumerate(
            zip(r["temperatures"], r["ece_before"], r["ece_after"], strict=True)
        ):
            rows.append(f"{k + 1:>8}  {t:6.3f}  {100 * b:9.2f}%  {100 * a:8.2f}%")
    return "\n".join(rows)


def calibrate_drafter(
    llm: LLM, drafter_dir: Path, texts: list[str], sampling_temperature: float = 1.0,
    max_tokens: int = 256, seed: int = 0, progress: bool = True, greedy: bool = True,
) -> dict:  # fmt: skip
    """The calibrate stage: full-block rollouts on `texts`, STS, calibration.json written; with
    `greedy` (and a sampling temperature above 0) also greedy rollouts for the greedy section."""

    def fit(temperature: float) -> dict:
        with record_confidences(llm) as recorder:
            rollout(llm, texts, temperature, max_tokens, seed, progress)
        logits, labels = recorder.blocks()
        report = calibration_report(logits, labels, temperature)
        report["num_prompts"] = len(texts)
        report["num_censored_rows"] = recorder.num_censored
        return report

    report = fit(sampling_temperature)
    if greedy and sampling_temperature > 0:
        section = fit(0.0)
        report["greedy"] = {k: v for k, v in section.items() if k != "method"}
    write_calibration(drafter_dir, report)
    return report
