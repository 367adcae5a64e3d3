"""STS calibration: the ECE worked example, recovery on synthetic over-confident scores, files."""

from __future__ import annotations

import json

import pytest
import torch

from dspark.train.calibrate import (
    calibration_report,
    ece_per_position,
    expected_calibration_error,
    fit_sts,
    load_calibration,
    write_calibration,
)


def test_ece_worked_example():
    scores = torch.tensor([0.1, 0.15, 0.9])
    labels = torch.tensor([0.0, 1.0, 1.0])
    assert float(expected_calibration_error(scores, labels)) == pytest.approx(0.35)
    # two scores sharing a bin average before the gap is taken: |0.3 + 0.3 - 1| / 2
    same_bin = expected_calibration_error(torch.tensor([0.3, 0.3]), torch.tensor([1.0, 0.0]))
    assert float(same_bin) == pytest.approx(0.2)
    assert float(expected_calibration_error(torch.tensor([1.0]), torch.tensor([1.0]))) == 0.0


def _synthetic(n: int, K: int, over: float, seed: int = 0):
    """Sequential acceptance with true conditional probabilities c_k; raw logits = over x the
    true logits (over-confident for over > 1). Labels: y_k = 1[first k all accepted]."""
    g = torch.Generator().manual_seed(seed)
    true_logit = torch.randn(n, K, generator=g) * 1.2 + torch.linspace(1.5, 0.0, K)
    c = torch.sigmoid(true_logit)
    accepted = torch.rand(n, K, generator=g) < c
    labels = accepted.long().cumprod(dim=-1).float()
    return over * true_logit, labels


def test_sts_recovers_calibration_of_overconfident_scores():
    K = 7
    logits, labels = _synthetic(40_000, K, over=3.0)
    temps = fit_sts(logits, labels)
    # the true temperature is 3; past position 5 fewer than 10% of blocks survive and the ECE
    # barely depends on T there, so only the first five are pinned
    assert all(2.5 < t < 3.6 for t in temps[:5]), temps
    before = ece_per_position(logits, labels, [1.0] * K)
    after = ece_per_position(logits, labels, temps)
    assert min(before) > 0.04, before  # raw survivals are clearly miscalibrated
    assert max(after) < 0.015, after
    # fresh data from the same process: the fitted temperatures still calibrate
    fresh_logits, fresh_labels = _synthetic(40_000, K, over=3.0, seed=1)
    assert max(ece_per_position(fresh_logits, fresh_labels, temps)) < 0.02


def test_sts_leaves_calibrated_scores_alone():
    logits, labels = _synthetic(40_000, 4, over=1.0)
    temps = fit_sts(logits, labels)
    assert all(0.8 < t < 1.25 for t in temps), temps


def test_calibration_file_round_trip_and_refusals(tmp_path):
    logits, labels = _synthetic(2_000, 3, over=2.0)
    report = calibration_report(logits, labels, sampling_temperature=1.0)
    assert report["method"] == "sts" and len(report["ece_after"]) == 3
    assert sum(report["ece_after"]) < sum(report["ece_before"])
    write_calibration(tmp_path, report)
    assert load_calibration(tmp_path, 3) == report["temperatures"]
    assert load_calibration(tmp_path / "none", 3) is None
    with pytest.raises(ValueError, match="not an STS calibration for draft_len 7"):
        load_calibration(tmp_path, 7)
    bad = dict(report, temperatures=[1.0, -2.0, 1.0])
    (tmp_path / "calibration.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="finite and > 0"):
        load_calibration(tmp_path, 3)
    assert load_calibration(tmp_path / "none", 3, greedy=True) is None
    (tmp_path / "calibration.json").write_text(json.dumps(report))
    assert load_calibration(tmp_path, 3, greedy=True) is None  # no greedy section
    greedy = {k: v for k, v in report.items() if k != "method"} | {"temperatures": [2.0] * 3}
    (tmp_path / "calibration.json").write_text(json.dumps(report | {"greedy": greedy}))
    assert load_calibration(tmp_path, 3, greedy=True) == [2.0] * 3
    assert load_calibration(tmp_path, 3) == report["temperatures"]
    (tmp_path / "calibration.json").write_text(json.dumps(report | {"greedy": [1.0]}))
    with pytest.raises(ValueError, match='"greedy" must be an object'):
        load_calibration(tmp_path, 3, greedy=True)
    with pytest.raises(ValueError, match="no full-block verify steps"):
        calibration_report(torch.zeros(0, 3), torch.zeros(0, 3), 1.0)


def test_reliability_bins_worked_example_and_diagram(tmp_path):
    from dspark.train.reliability import plot_reliability, reliability_bins

    bins = reliability_bins(torch.tensor([0.1, 0.15, 0.9]), torch.tensor([0.0, 1.0, 1.0]), 20)
    assert bins[2] == [1, pytest.approx(0.1), 0.0] and bins[3] == [1, pytest.approx(0.15), 1.0]
    assert bins[18] == [1, pytest.approx(0.9), 1.0]
    assert sum(b[0] for b in bins) == 3 and all(b == [0, 0.0, 0.0] for b in bins[4:18])
    # the report's bins reproduce its ECE: sum_b n_b |mean score - mean label| / N
    logits, labels = _synthetic(3000, 3, over=3.0)
    report = calibration_report(logits, labels, 1.0)
    for name, ece in (("before", report["ece_before"]), ("after", report["ece_after"])):
        for k, per_bin in enumerate(report["reliability"][name]):
            n = sum(c for c, _, _ in per_bin)
            assert n == 3000
            assert sum(c * abs(s - y) for c, s, y in per_bin) / n == pytest.approx(ece[k], abs=1e-5)
    report["greedy"] = dict(report)
    path = plot_reliability(report, tmp_path / "reliability.png")
    assert path.stat().st_size > 10_000


def test_evaluation_scores_greedy_rollouts_with_the_greedy_fit(tmp_path):
    """The evaluate stage reports calibrated ECE with the temperatures the engine would apply:
    the greedy section at temperature 0 (when the file has one), the sampled fit otherwise."""
    from dspark.train.evaluate import _calibration_for

    logits, labels = _synthetic(500, 3, over=2.0)
    report = calibration_report(logits, labels, sampling_temperature=1.0)
    write_calibration(tmp_path, report)
    assert _calibration_for(str(tmp_path), 3, 0.0) == report["temperatures"]  # no greedy fit
    greedy = {k: v for k, v in report.items() if k != "method"} | {"temperatures": [2.0] * 3}
    (tmp_path / "calibration.json").write_text(json.dumps(report | {"greedy": greedy}))
    assert _calibration_for(str(tmp_path), 3, 0.0) == [2.0] * 3
    assert _calibration_for(str(tmp_path), 3, 1.0) == report["temperatures"]
    assert _calibration_for(None, 3, 0.0) is None
