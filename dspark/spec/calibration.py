"""A drafter's calibrated confidence: the STS temperatures of its calibration.json.

calibration.json lies beside the drafter's config.json (written by `dspark calibrate`, see
dspark/train/calibrate.py for the fit and the file's fields). The calibrated confidence of
drafted position k is c[k] = sigmoid(logit[k] / T_k); the scheduler multiplies them into
survivals (dspark/spec/lagged.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

CALIBRATION_FILE = "calibration.json"


def load_calibration(drafter_dir: str | Path, draft_len: int) -> list[float] | None:
    """The STS temperatures T_1..T_K of a drafter directory, or None if it has no calibration."""
    path = Path(drafter_dir) / CALIBRATION_FILE
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
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
