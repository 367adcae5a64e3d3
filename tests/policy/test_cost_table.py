"""The cost table authenticates against the live fingerprint and fails closed with a reason."""

from __future__ import annotations

import math
import re

import pytest
import torch

from dspark.policy.cost_table import (
    CostTable,
    check_table,
    flatness_reason,
    full_block_tokens,
    load_cost_table,
    make_fingerprint,
    parse_table,
    table_file_name,
    user_tables_dir,
)

K = 7


@pytest.fixture
def live():
    return make_fingerprint(torch.device("cpu"), "t" * 8, "d" * 8, K, "bfloat16", [1, 16], 16)


def _table(live, cells=None) -> CostTable:
    cells = cells or {1: {1: 1.0e-3, 8: 1.5e-3}, 16: {16: 1.0e-3, 64: 1.4e-3, 128: 1.8e-3}}
    return CostTable(dict(live), cells)


def test_round_trip_and_lookup(tmp_path, live):
    path = tmp_path / "cost.json"
    path.write_text(_table(live).to_json())
    table, reason = load_cost_table(path, live)
    assert reason is None and table.step_seconds(16, 64) == 1.4e-3
    assert table.step_seconds(16, 80) is None  # unmeasured: never interpolated
    assert full_block_tokens(16, K) == 128


def test_the_fingerprint_names_what_changes_the_costs_and_nothing_more(tmp_path, live):
    assert set(live) == {"gpu", "torch", "triton", "target_hash", "drafter_hash", "draft_len",
                         "dtype", "graph_sizes", "page_size", "engine_version",
                         "trimmed_widths", "tensor_parallel_size"}  # fmt: skip
    # a table measured on a host with another number of GPUs (a key tables used to carry)
    # prices the same one-GPU engine
    table = _table(dict(live, device_count=8))
    assert check_table(table, live) is None
    for key, other in (("torch", "2.0"), ("page_size", 32), ("graph_sizes", [1, 8])):
        assert f"mismatch on {key}" in check_table(_table(dict(live, **{key: other})), live)


@pytest.mark.parametrize(
    "edit, expected",
    [
        (lambda fp, c: fp.update(gpu="NVIDIA H100"), "fingerprint mismatch on gpu"),
        (lambda fp, c: fp.update(drafter_hash="other"), "fingerprint mismatch on drafter_hash"),
        (lambda fp, c: fp.pop("torch"), "fingerprint lacks ['torch']"),
        (lambda fp, c: c[16].pop(128), "G=16 has no full-block cell V=128"),
        (lambda fp, c: c[16].update({64: math.nan}), "cell G=16 V=64 has a malformed time nan"),
        (lambda fp, c: c[16].update({64: -1.0}), "cell G=16 V=64 has a malformed time -1.0"),
        (lambda fp, c: c[1].update({9: 2e-3}), "cell G=1 V=9 is outside [1, 8]"),
    ],
)
def test_every_defect_fails_closed_with_its_reason(tmp_path, live, edit, expected):
    table = _table(live)
    edit(table.fingerprint, table.cells)
    path = tmp_path / "cost.json"
    path.write_text(table.to_json())
    got, reason = load_cost_table(path, live)
    assert got is None and expected in reason


def test_sampled_cells_round_trip_and_are_checked_like_the_greedy_ones(tmp_path, live):
    sampled = {1: {1: 1.1e-3, 8: 1.9e-3}, 16: {16: 1.1e-3, 128: 2.2e-3}}
    path = tmp_path / "cost.json"
    path.write_text(CostTable(dict(live), _table(live).cells, sampled).to_json())
    table, reason = load_cost_table(path, live)
    assert reason is None and table.sampled_cells == sampled
    assert table.for_sampling().cells == sampled and _table(live).for_sampling() is None
    for bad, expected in (({1: sampled[1]}, "sampled cells are for G [1]"),
                          ({1: sampled[1], 16: {16: 1e-3}}, "G=16 has no sampled full-block"),
                          ({1: {1: 0.0, 8: 1e-3}, 16: sampled[16]},
                           "sampled cell G=1 V=1 has a malformed time 0.0")):  # fmt: skip
        path.write_text(CostTable(dict(live), _table(live).cells, bad).to_json())
        got, reason = load_cost_table(path, live)
        assert got is None and expected in reason, reason


def test_unreadable_and_malformed_files(tmp_path, live):
    assert "cannot read" in load_cost_table(tmp_path / "missing.json", live)[1]
    (tmp_path / "bad.json").write_text('{"cells": {}}')
    assert "malformed cost table" in load_cost_table(tmp_path / "bad.json", live)[1]
    with pytest.raises(ValueError, match="malformed cost table"):
        parse_table('{"fingerprint": {}, "cells": {"x": {"1": 1.0}}}')


def test_flat_tables_are_refused(live):
    assert flatness_reason(_table(live)) is None
    flat = _table(live, {1: {1: 1.0e-3, 8: 1.02e-3}, 16: {16: 1.0e-3, 128: 1.03e-3}})
    assert "flat: step time varies by at most 3.0%" in flatness_reason(flat)
    single = _table(live, {1: {8: 1e-3}})
    assert "single cell" in flatness_reason(single)


def test_the_users_tables_live_in_the_cache_directory(monkeypatch, set_envs, tmp_path, live):
    set_envs(cache_dir=tmp_path / "mine")  # (DSPARK_CACHE_DIR)
    assert user_tables_dir() == tmp_path / "mine" / "cost_tables"
    set_envs(cache_dir=None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert user_tables_dir() == tmp_path / "xdg" / "dspark" / "cost_tables"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert user_tables_dir() == tmp_path / "home" / ".cache" / "dspark" / "cost_tables"
    # a name per GPU, drafter, K and torch, then a digest of the whole fingerprint (the
    # fingerprint inside authenticates it)
    h100 = dict(live, gpu="NVIDIA H100 80GB HBM3", torch="2.11.0+cu130")
    name = table_file_name(h100)
    assert re.fullmatch(r"nvidia_h100_80gb_hbm3_dddddddd_k7_torch2\.11\.0_cu130_[0-9a-f]{8}\.json",
                        name), name  # fmt: skip
    assert table_file_name(live) != name
    # engines the readable part does not tell apart get files of their own, not one that each
    # start overwrites: trimmed widths, another graph ladder or target
    for other in (dict(h100, trimmed_widths=[3, 4]), dict(h100, graph_sizes=[1, 2, 4]),
                  dict(h100, target_hash="another")):  # fmt: skip
        assert table_file_name(other) != name
    assert table_file_name(dict(h100)) == name  # (the same fingerprint, the same name)


def _fingerprint(**extra) -> dict:
    base = dict(gpu="cpu", torch="t", triton=None, target_hash="a",
                drafter_hash="b", draft_len=3, dtype="float32", graph_sizes=[1, 2],
                page_size=16, engine_version="0")  # fmt: skip
    return {**base, **extra}


def test_cost_table_authenticates_trimmed_cells():
    live = _fingerprint(trimmed_widths=[2])
    cells = {g: {g: 1.0, 2 * g: 1.2, 4 * g: 1.5} for g in (1, 2)}
    assert check_table(CostTable(live, cells), live) is None
    # a table from before trimmed cells (no key) is an engine without them
    old = _fingerprint()
    assert check_table(CostTable(old, cells), {**old, "trimmed_widths": []}) is None
    assert "mismatch on trimmed_widths" in check_table(CostTable(old, cells), live)
    unmeasured = {1: {1: 1.0, 2: 1.2, 4: 1.5}, 2: {2: 1.0, 8: 1.5}}
    assert check_table(CostTable(live, unmeasured), live) == (
        "G=2 has no trimmed cell V=4 (unmeasured)"
    )
