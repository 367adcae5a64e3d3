"""The drafting policy's step trace (DSPARK_POLICY_TRACE) against the policy's own counters,
and its summary (bench/policy.py trace), on the CPU with a tiny target and drafter."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from dspark import LLM, SamplingParams
from dspark.policy.cost_table import CostTable
from dspark.policy.policy import DraftingPolicy
from dspark.policy.survival import FRESH, UNSEEN
from dspark.policy.trace import PolicyTrace
from dspark.policy.tuning import TUNING
from tests.helpers import bench_module
from tests.policy.helpers import by_table
from tests.tiny_models import make_tiny_drafter

KW = dict(dtype="float32", device="cpu", num_kv_pages=256, max_num_seqs=4, max_model_len=256)
PROMPTS = [[2, 3, 4], [5, 6, 7, 8, 9], [9], [4, 4, 4, 4], [7, 7], [3, 1, 4, 1, 5]]


@pytest.fixture(scope="module")
def drafter(tiny_vocab_dir, tmp_path_factory):
    return make_tiny_drafter(tiny_vocab_dir, tmp_path_factory.mktemp("drafter_pt"), taps=(0,))


def _edge_table(path, llm):
    """A full block at 1.2 plain steps: near break-even, so drafting turns off and on."""
    cells = {g: {g: 1e-3, g * 4: 1.2e-3} for g in (1, 2, 4)}
    path.write_text(CostTable(llm.engine.cost_fingerprint(), cells).to_json())
    return path


def test_trace_has_a_line_per_decision_that_adds_up_to_the_counters(
    tiny_vocab_dir, drafter, tmp_path, set_envs
):
    spec = {"model": str(drafter), "num_speculative_tokens": 3}
    probe = LLM(str(tiny_vocab_dir), speculative_config=spec, **KW)
    assert probe.engine.policy_trace is None  # off unless asked for
    table = _edge_table(tmp_path / "edge.json", probe)
    set_envs(policy_trace=tmp_path / "traces")
    spec |= {"cost_table": str(table)}
    llm = LLM(str(tiny_vocab_dir), speculative_config=spec, **KW)
    by_table(llm, dwell_steps=0, min_gain=0.0)  # (no dwell, no margin: near break-even it flaps)
    trace = llm.engine.policy_trace
    trace.mark(arm="edge", repeat=0)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    llm.generate(PROMPTS, params, use_tqdm=False)
    trace.close()
    assert trace.path.parent == tmp_path / "traces" and trace.path.name.endswith(".jsonl")

    records = [json.loads(text) for text in trace.path.read_text().splitlines()]
    assert records[0]["mark"] == {"arm": "edge", "repeat": 0}
    lines = records[1:]
    counters = llm.get_metrics()["drafting_policy"]
    assert len(lines) == counters["steps_drafting"] + counters["steps_not_drafting"]
    assert sum(line["drafting"] for line in lines) == counters["steps_drafting"]
    reasons = Counter(f"decision_{line['reason'].replace(' ', '_')}" for line in lines)
    assert reasons == Counter({k: v for k, v in counters.items() if k.startswith("decision_")})
    assert counters["drafting_switches"] >= 4, counters
    times = [line["t"] for line in lines]
    assert times == sorted(times)
    # the engine thread's CPU and its sync wait since the trace began: cumulative, and within
    # the wall clock (on the CPU the runner never waits on a device)
    cpu = [line["cpu_s"] for line in lines]
    assert cpu == sorted(cpu) and 0 < cpu[-1] - cpu[0] <= 1.05 * (times[-1] - times[0]) + 0.01
    assert all(line["wait_s"] == 0 for line in lines)

    priced = [line for line in lines if line["cell"] is not None]
    for line in priced:
        g, v = line["cell"]
        assert 1 <= line["R"] <= g and v in (g, 4 * g)
        # no realised cost counts: priced as the table has it; survivals from the rows' kinds
        assert line["priced"] == {k: round(s, 7) for k, s in line["table"].items()}
        assert line["fresh"] + line["stale"] + line["unseen"] == line["R"]
        assert 0 <= line["survival_sum"] <= 3 * line["R"]
    # a period counts only when the two decisions before it chose the same cell (StepPeriods)
    counted = 0
    for before, prior, line in zip(lines, lines[1:], lines[2:], strict=False):
        if line["period"] is not None:
            counted += 1
            assert line["period"]["cell"] == prior["cell"] == before["cell"]
            assert line["period"]["seconds"] > 0
    assert counted > 0
    moved = Counter()
    for line in lines:
        moved.update(line["stats"])
    assert moved["graph_steps"] + moved["eager_steps"] > 0  # (the pipeline's steps, by path)

    # the summary: one stretch without drafting per switch off (the policy starts drafting)
    summary = bench_module("policy")
    (mark, segment), = summary.load(trace.path)  # fmt: skip
    assert mark == {"arm": "edge", "repeat": 0} and len(segment) == len(lines)
    stretches = summary.stretches(segment)
    assert len(stretches) == (counters["drafting_switches"] + 1) // 2
    assert sum(s["steps"] for s in stretches) == counters["steps_not_drafting"]
    periods = summary.step_periods(segment)  # every step but the last, idle ones left out
    assert sum(map(len, periods.values())) == sum(1 for line in lines[:-1] if line["R"])
    assert {g for g, _, _ in periods} <= {1, 2, 4}
    split = summary.host_split(segment)  # each step's wait, host work, off CPU, by the same keys
    assert split.keys() == periods.keys()
    for key, parts in split.items():
        assert len(parts) == len(periods[key])
        for (wait, work, off), period in zip(parts, periods[key], strict=True):
            assert wait == 0 and work > 0 and work + off == pytest.approx(period, abs=1e-5)
    causes = {summary.end_cause(s) for s in stretches}
    assert causes <= {"stale rows", "smaller G", "new requests", "prices", "none"}, causes
    text = summary.report(str(trace.path))
    assert "== arm=edge repeat=0" in text and f"{len(stretches)} stretches without drafting" in text
    assert "price full/plain 1.20 (table 1.20)" in text and "(sync wait 0.000, host work" in text
    assert "decisions:" not in text
    listed = summary.report(str(trace.path), max_decisions=3).splitlines()  # (--decisions 3)
    first = listed.index(next(t for t in listed if "first 3 decisions" in t))
    for i, (t, line) in enumerate(zip(listed[first + 1 : first + 4], lines[:3], strict=True)):
        assert t.split()[:2] == [str(i), f"{(line['t'] - lines[0]['t']) * 1e3:.1f}"], t
        assert ("draft" if line["drafting"] else "plain") in t.split()
    assert "cell=" not in listed[first + 4]  # three, then the rest of the summary


def test_steps_beyond_the_table_are_traced_without_a_cell(
    tiny_vocab_dir, drafter, tmp_path, set_envs
):
    """A table of G = 1 only: four rows run beyond it (drafting, no cell), and their periods,
    counted by StepPeriods, are traced and summarised without one (the trace raised on them)."""
    spec = {"model": str(drafter), "num_speculative_tokens": 3}
    probe = LLM(str(tiny_vocab_dir), speculative_config=spec, **KW)
    table = tmp_path / "g1.json"
    cells = {1: {1: 1e-3, 4: 1.2e-3}}
    table.write_text(CostTable(probe.engine.cost_fingerprint(), cells).to_json())
    set_envs(policy_trace=tmp_path / "traces")
    llm = LLM(str(tiny_vocab_dir), speculative_config=spec | {"cost_table": str(table)}, **KW)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    llm.engine.policy_trace.close()
    assert all(len(o.outputs[0].token_ids) == 24 for o in outputs)
    lines = [json.loads(t) for t in llm.engine.policy_trace.path.read_text().splitlines()]
    beyond = [line for line in lines if line.get("reason") == "batch beyond the table"]
    assert beyond and all(line["cell"] is None for line in beyond)
    assert any(line["period"] and line["period"]["cell"] is None for line in lines)
    summary = bench_module("policy")
    (_, segment), = summary.load(llm.engine.policy_trace.path)  # fmt: skip
    assert all(g == 1 for g, _, _ in summary.periods(segment))


@pytest.mark.parametrize("speculative", [False, True])
def test_engines_without_a_policy_trace_each_step(
    tiny_vocab_dir, drafter, tmp_path, set_envs, monkeypatch, speculative
):
    """Plain decoding and fixed K (no cost table): a line per step, for comparing arms."""
    set_envs(policy_trace=None)
    assert PolicyTrace.from_env(None) is None  # off unless asked for
    set_envs(policy_trace=tmp_path)
    spec = {"model": str(drafter), "num_speculative_tokens": 3} if speculative else None
    llm = LLM(str(tiny_vocab_dir), speculative_config=spec, **KW)
    engine, steps = llm.engine, []
    assert engine.policy is None and engine.policy_trace is not None
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda: steps.append(1) or step())
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm.generate(PROMPTS, params, use_tqdm=False)
    engine.policy_trace.close()

    lines = [json.loads(text) for text in engine.policy_trace.path.read_text().splitlines()]
    assert len(lines) == len(steps) > 0
    keys = {"t", "cpu_s", "wait_s", "R", "waiting", "seats", "prefilling", "drafting", "stats"}
    assert all(line.keys() == keys and line["drafting"] == speculative for line in lines)
    assert lines[0]["R"] == 0 and lines[0]["waiting"] == len(PROMPTS)  # (before admission)
    assert max(line["R"] for line in lines) == KW["max_num_seqs"]
    kind = "fixed K" if speculative else "plain decoding"
    text = bench_module("policy").report(str(engine.policy_trace.path))
    assert f"no policy: {kind}" in text and "G=4" in text and "stretches" not in text


def test_a_stretch_without_drafting_ends_by_one_cause():
    end_cause = bench_module("policy").end_cause
    start = {"cell": [64, 64], "unseen": 2, "stale": 0}

    def ended(**end):
        return end_cause({"start": start, "end": {"cell": [64, 512], "unseen": 2, "stale": 0}
                          | end})  # fmt: skip

    assert ended(stale=3) == "stale rows" and ended(cell=[32, 256]) == "smaller G"
    assert ended(unseen=5) == "new requests" and ended() == "prices"
    assert end_cause({"start": start, "end": None}) == "none"


def test_a_dwell_line_carries_its_own_evidence(tmp_path):
    """A dwell decides without survival estimates: its line computes them, and never shows a
    previous decision's (DraftingPolicy.last_row_totals is reset by every decide())."""
    k, g = 7, 4
    ones = {False: torch.ones(k), True: torch.ones(k)}
    tuning = replace(TUNING, dwell_steps=3, regression_half_life=1e9)  # (no ageing: exact sums)
    policy = DraftingPolicy(CostTable({}, {g: {g: 1.0, 8 * g: 9.0}}), ones, k, tuning=tuning)
    trace = PolicyTrace(policy, tmp_path / "trace.jsonl")
    scheduler = SimpleNamespace(running=[], waiting=[], max_num_seqs=g)
    ids = ["a", "b", "c"]
    policy.observe(ids[:2], torch.zeros(2, k), [True, True])  # "c" never drafted
    reasons = []
    for _ in range(3):
        decision = policy.decide(ids)
        if decision.reason == "dwell":  # (reset: no earlier decision's evidence is left)
            assert policy.last_row_totals is None
        trace.decided(decision, ids, scheduler, {}, None, 0.0)
        reasons.append(decision.reason)
    trace.close()
    assert reasons == ["no drafting", "dwell", "dwell"]
    totals, kinds = policy.row_totals(ids, g)
    for text in trace.path.read_text().splitlines():
        line = json.loads(text)
        assert line["fresh"] == kinds.count(FRESH) == 2 and line["unseen"] == kinds.count(UNSEEN)
        assert line["survival_sum"] == round(sum(totals), 4)
