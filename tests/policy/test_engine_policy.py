"""The engine's drafting policy on the CPU with a tiny target and drafter: the table it finds or
refuses, its choices end to end, its metrics, and `dspark profile` that measures the table."""

from __future__ import annotations

import json
import logging
import re
from types import SimpleNamespace

import pytest

from dspark import LLM, SamplingParams
from dspark.benchmarks.profile import profile_cost_table, reference_drift
from dspark.cli import main as cli_main
from dspark.config import EngineConfig
from dspark.engine.spec_setup import probe_steps
from dspark.policy.cost_table import CostTable, parse_table
from dspark.policy.tuning import TUNING
from tests.policy.helpers import by_table
from tests.tiny_models import make_tiny_drafter


def test_probes_are_two_steps_where_drafting_steps_launch_ahead():
    runner = SimpleNamespace(uniform_windows=True)  # (the one attribute probe_steps reads)
    assert probe_steps(EngineConfig(model="m"), runner) == 2
    assert probe_steps(EngineConfig(model="m", async_scheduling=False), runner) == 1
    assert probe_steps(EngineConfig(model="m"), SimpleNamespace(uniform_windows=False)) == 1


@pytest.fixture(scope="module")
def drafter(tiny_vocab_dir, tmp_path_factory):
    return make_tiny_drafter(tiny_vocab_dir, tmp_path_factory.mktemp("drafter_p"), taps=(0,))


KW = dict(dtype="float32", device="cpu", num_kv_pages=256, max_num_seqs=4, max_model_len=256)

PROMPTS = [[2, 3, 4], [5, 6, 7, 8, 9], [9], [4, 4, 4, 4]]


def _spec(drafter, **extra):
    return {"model": str(drafter), "num_speculative_tokens": 3, **extra}


def test_profile_measures_both_cells_with_the_live_fingerprint(tiny_vocab_dir, drafter):
    llm = LLM(str(tiny_vocab_dir), speculative_config=_spec(drafter), **KW)
    table = profile_cost_table(llm, [1, 4], steps=5, warmup=1, prompt_len=8)
    assert table.fingerprint == llm.engine.cost_fingerprint()
    assert set(table.cells) == {1, 4}
    assert set(table.cells[4]) == {4, 16} and all(t > 0 for t in table.cells[4].values())
    # the same cells at temperature 1
    assert set(table.sampled_cells) == {1, 4} and set(table.sampled_cells[4]) == {4, 16}
    assert all(t > 0 for t in table.sampled_cells[4].values())
    e = llm.engine
    assert not e.has_unfinished_requests() and e.allocator.num_free == e.allocator.num_usable
    with pytest.raises(ValueError, match="steps must be >= 5"):
        profile_cost_table(llm, [1], steps=3)
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        profile_cost_table(llm, [1], rounds=0)
    one = profile_cost_table(llm, [1], steps=5, warmup=1, prompt_len=8, rounds=1,
                             sampled=False)  # fmt: skip
    assert set(one.cells[1]) == {1, 4} and one.sampled_cells is None


def test_reference_drift_is_the_median_ratio_of_shared_cells():
    new = CostTable({}, {1: {1: 0.8, 8: 1.4}, 4: {4: 1.0}}, sampled_cells={1: {1: 2.0}})
    ref = CostTable({}, {1: {1: 0.7, 8: 1.2}, 2: {2: 9.0}}, sampled_cells={1: {1: 1.0}})
    median, cells = reference_drift(new, ref)  # 0.8/0.7, 1.4/1.2, sampled 2.0/1.0
    assert cells == 3 and median == pytest.approx(1.4 / 1.2)
    assert reference_drift(CostTable({}, {4: {4: 1.0}}), ref) is None


def _write_table(path, llm, plain, full):
    cells = {g: {g: plain, g * 4: full} for g in (1, 2, 4)}
    path.write_text(CostTable(llm.engine.cost_fingerprint(), cells).to_json())
    return path


def test_a_table_profiled_here_is_found_in_the_users_tables(
    tiny_vocab_dir, drafter, tmp_path, monkeypatch, caplog, set_envs
):
    """`dspark profile` without --out writes to the user's tables, where every engine with the
    table's fingerprint finds it; without one, the engine warns that it drafts every step."""
    import dspark.policy.cost_table as cost_table

    set_envs(cache_dir=tmp_path / "cache")
    with caplog.at_level(logging.WARNING, logger="dspark.engine.spec_setup"):
        probe = LLM(str(tiny_vocab_dir), speculative_config=_spec(drafter), **KW)
    assert probe.engine.policy is None and "no cost table for this engine (0 in" in caplog.text
    assert str(tmp_path / "cache" / "cost_tables") in caplog.text
    # (the tiny model's steps are alike: a flat table, which the profiler would not write)
    monkeypatch.setattr(cost_table, "flatness_reason", lambda table: None)
    rc = cli_main(["profile", "--model", str(tiny_vocab_dir), "--device", "cpu", "--dtype",
                   "float32", "--max-model-len", "256", "--max-num-seqs", "4", "--batch", "1,2,4",
                   "--steps", "5", "--warmup", "1", "--rounds", "1", "--greedy-only",
                   "--speculative-config", json.dumps(_spec(drafter))])  # fmt: skip
    assert rc == 0
    fingerprint = probe.engine.cost_fingerprint()
    written = tmp_path / "cache" / "cost_tables" / cost_table.table_file_name(fingerprint)
    assert parse_table(written.read_text()).fingerprint == fingerprint
    llm = LLM(str(tiny_vocab_dir), speculative_config=_spec(drafter), **KW)
    assert llm.get_metrics()["scheduling"] == f"drafting policy, cost table {written}"
    # another engine (here K = 2) does not take it
    other = LLM(str(tiny_vocab_dir), speculative_config=_spec(drafter, num_speculative_tokens=2),
                **KW)  # fmt: skip
    assert other.engine.policy is None


def test_engine_stops_drafting_when_the_table_says_so(tiny_vocab_dir, drafter, tmp_path):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = LLM(str(tiny_vocab_dir), **KW).generate(PROMPTS, params, use_tqdm=False)
    probe = LLM(str(tiny_vocab_dir), speculative_config=_spec(drafter), **KW)
    # a full block dearer than K + 1 plain steps: never worth drafting once the dwell is over
    costly = _write_table(tmp_path / "costly.json", probe, 1e-3, 5e-3)
    spec = _spec(drafter, cost_table=str(costly))
    llm = by_table(LLM(str(tiny_vocab_dir), speculative_config=spec, **KW))
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    counters = llm.get_metrics()["drafting_policy"]
    assert counters["steps_not_drafting"] > counters["steps_drafting"] > 0, counters
    # every decision with a running batch is also counted at its graph size
    by_g = {k: v for k, v in counters.items() if re.fullmatch(r"g\d+_(not_)?drafting", k)}
    assert {k.split("_")[0] for k in by_g} <= {"g1", "g2", "g4"}, by_g
    decided = counters["steps_drafting"] + counters["steps_not_drafting"]
    assert sum(by_g.values()) == decided - counters.get("decision_idle", 0), counters
    assert sum(v for k, v in by_g.items() if "not" in k) > 0
    # a full block as cheap as a plain step: always drafting
    cheap = _write_table(tmp_path / "cheap.json", probe, 1e-3, 1e-3)
    spec = _spec(drafter, cost_table=str(cheap))
    llm = by_table(LLM(str(tiny_vocab_dir), speculative_config=spec, **KW))
    llm.generate(PROMPTS, params, use_tqdm=False)
    assert llm.get_metrics()["drafting_policy"].get("steps_not_drafting", 0) == 0


def test_a_table_of_another_engine_fails_closed(tiny_vocab_dir, drafter, tmp_path, caplog):
    probe = LLM(str(tiny_vocab_dir), speculative_config=_spec(drafter), **KW)
    path = _write_table(tmp_path / "t.json", probe, 1e-3, 5e-3)
    raw = json.loads(path.read_text())
    raw["fingerprint"]["gpu"] = "NVIDIA H200"
    path.write_text(json.dumps(raw))
    with caplog.at_level(logging.WARNING, logger="dspark.engine.spec_setup"):
        llm = LLM(str(tiny_vocab_dir), speculative_config=_spec(drafter, cost_table=str(path)),
                  **KW)  # fmt: skip
    assert "fingerprint mismatch on gpu" in caplog.text and "fixed K" in caplog.text
    llm.generate(PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)
    counters = llm.get_metrics()["drafting_policy"]
    assert counters.get("steps_not_drafting", 0) == 0
    assert any(k.startswith("cost_table_refused: fingerprint mismatch on gpu") for k in counters)
    assert counters["decision_no_table"] > 0
    status = llm.get_metrics()["scheduling"]
    assert status.startswith(f"fixed K: cost table {path} refused (fingerprint mismatch on gpu")


def test_profile_cli_writes_a_table_the_engine_accepts(tiny_vocab_dir, drafter, tmp_path,
                                                       capsys):  # fmt: skip
    out = tmp_path / "cost.json"
    spec = json.dumps(_spec(drafter))
    # a reference a thousand times faster than any CPU step: the new table reads far above it
    reference = tmp_path / "reference.json"
    reference.write_text(CostTable({}, {g: {g: 1e-6, 4 * g: 2e-6} for g in (1, 2, 8)}).to_json())
    rc = cli_main(["profile", "--model", str(tiny_vocab_dir), "--device", "cpu", "--dtype",
                   "float32", "--max-model-len", "256", "--batch", "1,2", "--steps", "5",
                   "--warmup", "1", "--speculative-config", spec, "--out", str(out),
                   "--compare-to", str(reference)])  # fmt: skip
    printed = capsys.readouterr()
    assert f"against {reference}: new / reference" in printed.out
    assert "(median over 4 cells)" in printed.out  # G 1 and 2 greedy (no sampled reference)
    assert f"above {reference} (median over 4 cells): a whole run can read high" in printed.err
    if rc == 1:  # refused: the tiny model's steps were too alike to choose between
        assert not out.exists()
        return
    assert rc == 0
    table = parse_table(out.read_text())
    llm = LLM(str(tiny_vocab_dir), speculative_config=_spec(drafter, cost_table=str(out)), **KW)
    assert llm.engine.policy.table is not None and sorted(table.cells) == [1, 2]


def test_engine_fits_persistence(tiny_vocab_dir, drafter, tmp_path):
    probe = LLM(str(tiny_vocab_dir), speculative_config=_spec(drafter), **KW)
    cheap = _write_table(tmp_path / "cheap.json", probe, 1e-3, 1e-3)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    llm = by_table(
        LLM(str(tiny_vocab_dir), speculative_config=_spec(drafter, cost_table=str(cheap)), **KW)
    )
    llm.generate(PROMPTS * 4, params, use_tqdm=False)
    estimates = llm.engine.policy.estimates
    assert estimates._pairs[0] > 32  # every drafting step after a row's first
    assert estimates.decision_lag == 1  # (no drafting step launched ahead here)
    assert 0.0 <= llm.get_metrics()["survival_persistence"] <= 1.0


def test_engine_with_steps_ahead_fits_what_its_decisions_read(tiny_vocab_dir, drafter, tmp_path):
    """Drafting steps launched ahead (windows laid out K + 1 wide, as CUDA graphs do; on a GPU
    spec_setup gives the policy decision_lag 2 then): the fit takes pairs from the rows' earlier
    sums, and a finished request's is forgotten with it."""
    probe = LLM(str(tiny_vocab_dir), speculative_config=_spec(drafter), **KW)
    cheap = _write_table(tmp_path / "cheap.json", probe, 1e-3, 1e-3)
    llm = by_table(
        LLM(str(tiny_vocab_dir), speculative_config=_spec(drafter, cost_table=str(cheap)), **KW)
    )
    llm.engine.runner.spec_runner.uniform_windows = True
    estimates = llm.engine.policy.estimates
    estimates.decision_lag = 2
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    llm.generate(PROMPTS * 4, params, use_tqdm=False)
    assert llm.engine.runner.stats["spec_steps_launched_ahead"] > 0
    assert estimates._pairs[0] > 16  # pairs from blocks after a row's second
    assert not estimates._earlier_sums  # every request finished and was forgotten


def test_engine_dwells_and_keeps_the_greedy_tokens_while_drafting_flaps(
    tiny_vocab_dir, drafter, tmp_path
):
    probe = LLM(str(tiny_vocab_dir), speculative_config=_spec(drafter), **KW)
    costly = _write_table(tmp_path / "costly.json", probe, 1e-3, 5e-3)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    llm = LLM(str(tiny_vocab_dir), speculative_config=_spec(drafter, cost_table=str(costly)),
              **KW)  # fmt: skip
    assert llm.engine.policy.tuning.dwell_steps == TUNING.dwell_steps == 8
    by_table(llm)
    llm.generate(PROMPTS, params, use_tqdm=False)
    assert llm.get_metrics()["drafting_policy"]["decision_dwell"] >= 7
    # without a dwell or a margin, near break-even, drafting turns off and on again within a
    # request: the drafter's context after each plain stretch must still give the target's
    # greedy tokens
    plain = LLM(str(tiny_vocab_dir), **KW).generate(PROMPTS, params, use_tqdm=False)
    edge = _write_table(tmp_path / "edge.json", probe, 1e-3, 1.2e-3)
    flapping = LLM(str(tiny_vocab_dir), speculative_config=_spec(drafter, cost_table=str(edge)),
                   **KW)  # fmt: skip
    by_table(flapping, dwell_steps=0, min_gain=0.0)
    got = flapping.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    assert flapping.get_metrics()["drafting_policy"]["drafting_switches"] >= 4


def test_the_running_sum_follows_the_scheduler_through_preemption(tiny_vocab_dir, drafter,
                                                                 tmp_path):  # fmt: skip
    """The policy's survival sum, kept by the scheduler's reports of requests joining and
    leaving (RunningSums), equals the pass over the running requests at every decision of a
    run near break-even (drafting flaps) with more requests than seats and too few KV pages
    for them all (preemptions and re-admissions)."""
    probe = LLM(str(tiny_vocab_dir), speculative_config=_spec(drafter), **KW)
    edge = _write_table(tmp_path / "edge.json", probe, 1e-3, 1.2e-3)
    kw = {**KW, "num_kv_pages": 12, "max_model_len": 96}
    llm = by_table(LLM(str(tiny_vocab_dir), speculative_config=_spec(drafter, cost_table=str(edge)),
                       **kw), dwell_steps=0, min_gain=0.0)  # fmt: skip
    estimates, by_groups = llm.engine.policy.estimates, []
    running_sum = estimates.running_sum

    def compared(request_ids, fresh_since):
        got = running_sum(request_ids, fresh_since)
        assert len(estimates._running) == len(request_ids), "a report went missing"
        assert got == pytest.approx(sum(estimates.estimate_totals(request_ids, fresh_since)[0]))
        by_groups.append(estimates._sums is not None)
        return got

    estimates.running_sum = compared
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    llm.generate([*PROMPTS, *PROMPTS, [3, 3, 3]], params, use_tqdm=False)
    assert sum(by_groups) > 20 and not all(by_groups), by_groups  # (plain stretches: groups)
    assert llm.engine.scheduler.num_preemptions > 0
    assert not estimates._running  # (every request reported leaving)


def test_settled_switches_are_not_keys_of_speculative_config(tiny_vocab_dir, drafter):
    for key, value in (("dwell_steps", 0), ("price_switches", True), ("scheduler", "sync")):
        with pytest.raises(ValueError, match=rf"unknown speculative_config keys \['{key}'\]; "
                           r"allowed: \['method', 'model', 'num_speculative_tokens', "
                           r"'cost_table', 'scheduling', 'profile_at_startup', 'trimmed_widths', "
                           r"'mixed_prefill_tokens'\]"):  # fmt: skip
            LLM(str(tiny_vocab_dir), speculative_config=_spec(drafter, **{key: value}), **KW)


def test_speculation_metrics_add_up(tiny_vocab_dir, drafter):
    llm = LLM(str(tiny_vocab_dir), speculative_config=_spec(drafter), **KW)
    llm.generate(PROMPTS, SamplingParams(max_tokens=30, ignore_eos=True), use_tqdm=False)
    m = llm.get_metrics()
    assert sum(m["verify_len_counts"]) == m["num_drafts"] > 0
    assert sum(i * n for i, n in enumerate(m["verify_len_counts"])) == m["num_draft_tokens"]
    assert m["num_verified_tokens"] == m["num_drafts"] + m["num_draft_tokens"]
    windows = m["num_survival_windows"]
    assert 0 < windows <= m["num_drafts"] and m["drafting"] == 1
    pred, real = m["predicted_survival_per_pos"], m["realised_survival_per_pos"]
    assert all(0 <= p <= windows for p in pred) and pred == sorted(pred, reverse=True)
    assert all(r <= a for r, a in zip(real, m["num_accepted_tokens_per_pos"], strict=False))
    assert real == sorted(real, reverse=True) and m["fallbacks"] == {}


def test_periodic_stats_line(tiny_vocab_dir, drafter, caplog):
    llm = LLM(str(tiny_vocab_dir), speculative_config=_spec(drafter), log_stats_interval_s=1e-9,
              **KW)  # fmt: skip
    with caplog.at_level(logging.INFO, logger="dspark.engine.stats"):
        llm.generate(PROMPTS, SamplingParams(max_tokens=10, ignore_eos=True), use_tqdm=False)
    lines = [r.getMessage() for r in caplog.records if r.name == "dspark.engine.stats"]
    assert lines and all(line.startswith("dspark stats: running ") for line in lines)
    assert any("acceptance length" in line and "drafting on" in line for line in lines)
    assert any("prompt " in line and "generation " in line and "KV " in line for line in lines)
    # on the CPU every step runs eagerly (no graphs); each line counts its interval's steps
    steps = [re.search(r"([\d,]+) steps \((\d+)% eager\)", line) for line in lines]
    assert all(m and m[2] == "100" for m in steps), lines
    assert (
        sum(int(m[1].replace(",", "")) for m in steps)
        == llm.engine.runner.stats["eager_steps"] + llm.engine.runner.stats["eager_spec_steps"]
    )


def test_a_table_beside_the_drafter_is_used_when_its_fingerprint_matches(
    tiny_vocab_dir, drafter, tmp_path, caplog
):
    import shutil

    own = tmp_path / "drafter"
    shutil.copytree(drafter, own)
    probe = LLM(str(tiny_vocab_dir), speculative_config=_spec(own), **KW)
    assert probe.engine.policy is None  # no cost_tables/ yet: fixed K
    assert probe.get_metrics()["scheduling"] == (
        "fixed K: no cost table for this engine's fingerprint"
    )  # fmt: skip
    (own / "cost_tables").mkdir()
    other = json.loads(_write_table(tmp_path / "other.json", probe, 1e-3, 5e-3).read_text())
    other["fingerprint"]["gpu"] = "NVIDIA H200"
    (own / "cost_tables" / "a_h200.json").write_text(json.dumps(other))
    with caplog.at_level(logging.INFO, logger="dspark.engine.spec_setup"):
        llm = LLM(str(tiny_vocab_dir), speculative_config=_spec(own), **KW)
    assert llm.engine.policy is None and "no cost table for this engine (1 in" in caplog.text
    _write_table(own / "cost_tables" / "b_this_engine.json", probe, 1e-3, 5e-3)
    llm = LLM(str(tiny_vocab_dir), speculative_config=_spec(own), **KW)
    assert llm.engine.policy is not None and llm.engine.policy.table is not None
    assert llm.engine.policy.probe_steps == 1  # (no graphs on the CPU: no steps ahead)
    assert llm.get_metrics()["scheduling"] == (
        f"drafting policy, cost table {own / 'cost_tables' / 'b_this_engine.json'}"
    )  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    llm.generate(PROMPTS, params, use_tqdm=False)
    assert llm.get_metrics()["drafting_policy"]["steps_not_drafting"] > 0
    off = LLM(str(tiny_vocab_dir), speculative_config=_spec(own, scheduling=False), **KW)
    assert off.engine.policy is None  # scheduling off: fixed K even with a table
    assert off.get_metrics()["scheduling"] == "fixed K: scheduling off"
    # the profiler pins its cells itself: a matching table beside the drafter does not stop it
    rc = cli_main(["profile", "--model", str(tiny_vocab_dir), "--device", "cpu", "--dtype",
                   "float32", "--max-model-len", "256", "--batch", "1,2", "--steps", "5",
                   "--warmup", "1", "--speculative-config", json.dumps(_spec(own)),
                   "--out", str(tmp_path / "new.json")])  # fmt: skip
    assert rc in (0, 1)  # written, or refused as flat (the tiny model's steps are alike)
    with pytest.raises(ValueError, match='"scheduling" must be true or false, got 1'):
        LLM(str(tiny_vocab_dir), speculative_config=_spec(own, scheduling=1), **KW)


def test_calibration_and_evaluation_verify_full_blocks_beside_a_shipped_table(
    tiny_vocab_dir, drafter, tmp_path
):
    """A drafter shipped with a cost table for this engine schedules drafting by default; the
    train package's rollouts must not, or plain steps would drop out of tau and the labels."""
    import shutil

    from dspark.train.evaluate import EvalConfig, evaluate_drafter
    from dspark.train.rollouts import full_block_spec, record_confidences

    own = tmp_path / "drafter"
    shutil.copytree(drafter, own)
    probe = LLM(str(tiny_vocab_dir), speculative_config=full_block_spec(own), **KW)
    (own / "cost_tables").mkdir()
    window = probe.engine.spec.draft_len + 1
    cells = {g: {g: 1e-3, g * window: 5e-3} for g in (1, 2, 4)}
    table = CostTable(probe.engine.cost_fingerprint(), cells).to_json()
    (own / "cost_tables" / "this_engine.json").write_text(table)
    scheduled = LLM(str(tiny_vocab_dir), speculative_config={"model": str(own)}, **KW)
    assert scheduled.engine.policy is not None
    with pytest.raises(ValueError, match=r"calibration needs full-block verification.*drafting "
                       r"policy, cost table .*this_engine.json"):  # fmt: skip
        with record_confidences(scheduled):
            pass
    with pytest.raises(ValueError, match="evaluate needs full-block verification"):
        evaluate_drafter(scheduled, {"a": ["hi"]}, EvalConfig(max_tokens=4), str(own), False)
    full = LLM(str(tiny_vocab_dir), speculative_config=full_block_spec(own), **KW)
    assert full.engine.policy is None
    with record_confidences(full) as recorder:
        full.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                      use_tqdm=False)  # fmt: skip
    steps = full.get_metrics()["num_drafts"]
    assert steps > 0 and recorder.blocks()[0].shape[0] + recorder.num_censored == steps
