"""bench/results.py merge-sweeps: an issue-6 sweep run in parts (one device call each) merged
into one result, on two real CPU bench runs of a tiny model with two arms."""

from __future__ import annotations

import json

import pytest

from tests.helpers import bench_module
from tests.test_bench import _cpu_bench
from tests.tiny_models import make_tiny_drafter


@pytest.fixture(scope="module")
def parts(tiny_llama_dir, tmp_path_factory):
    """Level 2 then level 1 of the same sweep, each its own run (the order a script may use)."""
    tmp = tmp_path_factory.mktemp("parts")
    drafter = make_tiny_drafter(tiny_llama_dir, tmp / "drafter", taps=(0, 1))
    arms = {"plain": None, "k2": {"model": str(drafter), "num_speculative_tokens": 2}}
    results = []
    for level in ("2", "1"):
        out = tmp / f"part{level}.json"
        args = _cpu_bench(tiny_llama_dir, out, "--concurrency", level, "--output-len", "4",
                          "--max-prompt-len", "48", "--no-plot",
                          "--arms", json.dumps(arms))  # fmt: skip
        assert args.func(args) == 0
        results.append(json.loads(out.read_text()))
    return results


def test_parts_merge_into_one_sweep_with_each_levels_own_ratios(parts, tmp_path):
    merge = bench_module("results")
    merged = merge.merge(parts)
    assert merged["concurrency"] == [1, 2]
    for name in ("plain", "k2"):
        levels = merged["arms"][name]["levels"]
        assert [lv["concurrency"] for lv in levels] == [1, 2]
        assert levels[0] == parts[1]["arms"][name]["levels"][0]  # as measured, unchanged
        assert levels[1] == parts[0]["arms"][name]["levels"][0]
    # each level's ratios are its own run's: no ratio mixes two parts
    assert merged["arm_ratios"] == parts[1]["arm_ratios"] + parts[0]["arm_ratios"]
    assert [p["concurrency"] for p in merged["parts"]] == [[2], [1]]
    out = tmp_path / "merged.json"
    out.write_text(json.dumps(merged))
    png = merge.plot_results(out, out.with_suffix(".png"))
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_parts_that_do_not_belong_together_are_refused(parts):
    merge = bench_module("results")
    with pytest.raises(ValueError, match=r"a level was measured in two parts: \[2, 2\]"):
        merge.merge([parts[0], parts[0]])
    hotter = {**parts[1], "temperature": 1.0}
    with pytest.raises(ValueError, match="parts differ in temperature: 0.0 vs 1.0"):
        merge.merge([parts[0], hotter])
    fewer = {**parts[1], "arms": {"plain": parts[1]["arms"]["plain"]}}
    with pytest.raises(ValueError, match=r"parts differ in their arms: \['plain'\]"):
        merge.merge([parts[0], fewer])
