"""The cost table measured at start-up (engine/startup_profile.py) on the CPU: the rule that
keeps an eager engine from measuring, and the CUDA path's logic with the rule lifted and the
ladder made small: the table lands in the user's cache, the policy uses it at once, the
profile's steps leave no counts behind, and the next start finds it without measuring."""

from __future__ import annotations

import json
import logging

import pytest

from dspark import LLM, SamplingParams
from dspark.engine import startup_profile
from dspark.policy.cost_table import parse_table, table_file_name
from tests.tiny_models import make_tiny_drafter

pytestmark = pytest.mark.start_up_profile

KW = dict(dtype="float32", device="cpu", num_kv_pages=256, max_num_seqs=2, max_model_len=256)


@pytest.fixture(scope="module")
def drafter(tiny_vocab_dir, tmp_path_factory):
    return make_tiny_drafter(tiny_vocab_dir, tmp_path_factory.mktemp("drafter_s"), taps=(0,))


def _spec(drafter, **extra):
    return {"model": str(drafter), "num_speculative_tokens": 3, **extra}


@pytest.fixture
def as_if_captured(monkeypatch):
    """The CUDA rule lifted (the engine measures as if its steps were captured), over G 1, 2;
    returns the list of ladders measured."""
    measured = []

    def batches(engine):
        measured.append([1, 2])
        return [1, 2]

    monkeypatch.setattr(startup_profile, "startup_profile_blocker", lambda engine: None)
    monkeypatch.setattr(startup_profile, "startup_batches", batches)
    # (fewer steps and rounds than a GPU's: the CPU's steps are slow)
    for name, value in (("STEPS", 5), ("WARMUP", 1), ("ROUNDS", 1)):
        monkeypatch.setattr(startup_profile, name, value)
    # (the tiny model's cells may lie within 5% of each other: a flat table is not saved)
    monkeypatch.setattr(startup_profile, "flatness_reason", lambda table: None)
    return measured


def test_an_eager_engine_keeps_fixed_k_and_says_why(tiny_vocab_dir, drafter, tmp_path, caplog,
                                                    set_envs):  # fmt: skip
    set_envs(cache_dir=tmp_path / "cache")
    with caplog.at_level(logging.WARNING, logger="dspark.engine.spec_setup"):
        llm = LLM(str(tiny_vocab_dir), speculative_config=_spec(drafter), **KW)
    assert llm.engine.policy is None
    assert "none measured at start-up: its steps run eagerly" in caplog.text
    assert not (tmp_path / "cache" / "cost_tables").exists()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dspark.engine.spec_setup"):
        LLM(str(tiny_vocab_dir), speculative_config=_spec(drafter, profile_at_startup=False),
            **KW)  # fmt: skip
    assert 'none measured at start-up: speculative_config "profile_at_startup" is false' in (
        caplog.text
    )


def test_the_start_up_table_is_saved_used_and_found_by_the_next_start(
    tiny_vocab_dir, drafter, tmp_path, caplog, set_envs, as_if_captured
):
    set_envs(cache_dir=tmp_path / "cache")
    with caplog.at_level(logging.INFO, logger="dspark.engine.startup_profile"):
        first = LLM(str(tiny_vocab_dir), speculative_config=_spec(drafter), **KW)
    assert as_if_captured == [[1, 2]]
    fingerprint = first.engine.cost_fingerprint()
    path = tmp_path / "cache" / "cost_tables" / table_file_name(fingerprint)
    table = parse_table(path.read_text())
    assert table.fingerprint == fingerprint and set(table.cells) == {1, 2}
    assert set(table.cells[2]) == {2, 8} and set(table.sampled_cells[2]) == {2, 8}
    assert table.measured["at_startup"] is True and table.measured["seconds"] >= 0
    lines = [r for r in caplog.records if r.name == "dspark.engine.startup_profile"]
    assert len(lines) == 1 and "measured at start-up" in lines[0].getMessage()
    assert str(path) in lines[0].getMessage()
    assert first.engine.policy is not None
    assert first.get_metrics()["scheduling"] == f"drafting policy, cost table {path}"
    # the profile's steps and requests are gone: metrics start with the user's requests
    metrics = first.get_metrics()
    assert metrics.get("num_drafts", 0) == 0 and not any(metrics["num_accepted_tokens_per_pos"])
    assert sum(metrics["steps"].values()) == 0, metrics["steps"]
    assert not first.engine.has_unfinished_requests()
    out = first.generate([[2, 3, 4]], SamplingParams(temperature=0, max_tokens=8),
                         use_tqdm=False)  # fmt: skip
    assert len(out[0].outputs[0].token_ids) == 8
    # the policy's host time, by call, for the bench's scheduling overhead: a decision before
    # every step (how many steps 8 tokens take depends on whether the table this CPU measured
    # makes the policy draft)
    host = first.get_metrics()["scheduling_host_time"]
    steps = sum(first.get_metrics()["steps"].values())
    assert 1 <= steps <= host["decisions"] and host["decide_s"] > 0
    assert ("observe_s" in host) == (first.get_metrics().get("num_drafts", 0) > 0)
    # the next start finds the table without measuring
    second = LLM(str(tiny_vocab_dir), speculative_config=_spec(drafter), **KW)
    assert as_if_captured == [[1, 2]]
    assert second.get_metrics()["scheduling"] == f"drafting policy, cost table {path}"


def test_a_flat_start_up_table_is_not_saved_and_counted(
    tiny_vocab_dir, drafter, tmp_path, monkeypatch, caplog, set_envs, as_if_captured
):
    set_envs(cache_dir=tmp_path / "cache")
    monkeypatch.setattr(startup_profile, "flatness_reason", lambda table: "flat: test")
    with caplog.at_level(logging.WARNING):
        llm = LLM(str(tiny_vocab_dir), speculative_config=_spec(drafter), **KW)
    assert llm.engine.policy is None
    assert "not saved (flat: test)" in caplog.text
    assert "none measured at start-up: the table measured was flat" in caplog.text
    assert llm.engine.runner.stats["startup_profile_not_written"] == 1
    assert list((tmp_path / "cache" / "cost_tables").glob("*.json")) == []
    assert json.dumps(llm.get_metrics())  # (metrics still serialise)


@pytest.mark.gpu
def test_a_captured_engine_measures_its_table_at_start_up(tiny_vocab_dir, drafter, tmp_path,
                                                          set_envs, monkeypatch):  # fmt: skip
    """The rule on CUDA: graphs captured, no table: measured over the graph ladder, saved."""
    set_envs(cache_dir=tmp_path / "cache")
    # (a tiny model's cells may lie within 5% of each other: a flat table is not saved)
    monkeypatch.setattr(startup_profile, "flatness_reason", lambda table: None)
    kw = dict(KW, device="cuda", max_num_seqs=4)
    llm = LLM(str(tiny_vocab_dir), speculative_config=_spec(drafter), **kw)
    fingerprint = llm.engine.cost_fingerprint()
    path = tmp_path / "cache" / "cost_tables" / table_file_name(fingerprint)
    table = parse_table(path.read_text())
    assert sorted(table.cells) == fingerprint["graph_sizes"]
    assert llm.get_metrics()["scheduling"] == f"drafting policy, cost table {path}"
