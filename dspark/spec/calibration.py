"""A drafter's calibrated confidence: the STS temperatures of its calibration.json.

calibration.json lies beside the drafter's config.json (written by `dspark calibrate`, see
dspark/train/calibrate.py for the fit and the file's fields). The calibrated confidence of
drafted position k is c[k] = sigmoid(logit[k] / T_k); the scheduler multiplies them into
survivals (dspark/policy/survival.py).

Acceptance depends on how a request samples: a greedy request keeps a draft when it is the
target's argmax, a sampled one with probability min(1, p/q), so the same raw confidence means a
higher survival at temperature 0. The file's top-level temperatures are fitted on sampled
rollouts (its "sampling_temperature", 1.0 by default); an optional "greedy" section holds
temperatures fitted on greedy rollouts, for requests with temperature 0:

  {"method": "sts", "temperatures": [...], "sampling_temperature": 1.0, ...,
   "greedy": {"temperatures": [...], "sampling_temperature": 0.0, ...}}
"""

from __future__ import annotations

import json
import math
from pathlib import Path

CALIBRATION_FILE = "calibration.json"


def load_calibration(
    drafter_dir: str | Path, draft_len: int, greedy: bool = False
) -> list[float] | None:
    """The STS temperatures T_1..T_K of a drafter directory (with greedy=True those fitted on
    greedy rollouts), or None if it has no such calibration."""
    path = Path(drafter_dir) / CALIBRATION_FILE
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    if greedy:
        if "greedy" not in data:
            return None
        section = data["greedy"]
        if not isinstance(section, dict):
            raise ValueError(f'{path}: "greedy" must be an object, got {section!r}')
        data = {"method": data.get("method"), **section}
    temps = data.get("temperatures")
    if data.get("method") != "sts" or not isinstance(temps, list) or len(temps) != draft_len:
        raise ValueError(
            f"{path} is not an STS calibration for draft_len {draft_len} "
            f"(method {data.get('method')!r}, {len(temps) if isinstance(temps, list) else 0} "
            "temperatures)"
        )
    if not all(isinstance(t, (int, float)) and math.isfinite(t) and t > 0 for t in temps):
        raise ValueError(f"{path}: temperatures must be finite and > 0, got {temps}")
    return [float(t) for t in temps]
