"""The per-step drafting choice (plain decoding vs the full block) from the cost table, and
`dspark profile` that measures the table, on the CPU with a tiny target and drafter."""

from __future__ import annotations

import json
import logging
import math
import re
from types import SimpleNamespace

import pytest
import torch

from dspark import LLM, SamplingParams
from dspark.cli import main as cli_main
from dspark.config import EngineConfig
from dspark.engine.spec_setup import probe_steps
from dspark.policy.cost_table import CostTable, parse_table
from dspark.policy.policy import Decision, DraftingPolicy
from dspark.policy.realised_costs import RealisedCosts
from dspark.policy.survival import STALE
from dspark.spec.profile import profile_cost_table, reference_drift
from tests.tiny_models import make_tiny_drafter

K = 7
TABLE = CostTable({}, {1: {1: 1.0, 8: 1.5}, 64: {64: 1.0, 512: 2.4}})


ONES = {False: torch.ones(K), True: torch.ones(K)}  # uncalibrated, greedy or not


def _policy(table=TABLE, dwell=2, **kw):
    return DraftingPolicy(table, ONES, K, min_gain=0.02, min_dwell_steps=dwell, **kw)


def _ids(n):
    return [f"r{i}" for i in range(n)]


def test_unknown_requests_count_as_fully_confident():
    p = _policy(dwell=0)
    # 64 rows, a = 1: full block 64 * 8 / 2.4 = 213 tokens/s against plain 64 / 1.0
    assert p.decide(_ids(64)).drafting


def test_drafting_goes_off_under_load_at_once_and_back_on_after_the_dwell():
    p = _policy(dwell=2)
    p.observe(_ids(64), torch.zeros(64, K), [False] * 64)  # c = 0.5: sum 0.5 + 0.25 .. ~ 0.99
    d = p.decide(_ids(64))  # 64 * 1.99 / 2.4 = 53 < 64 / 1.0 / 1.02^2: off, no dwell first
    assert (d.drafting, d.reason) == (False, "no drafting")
    assert p.decide(_ids(1)) == Decision(False, "dwell")  # held off for min_dwell_steps
    assert p.decide(_ids(64)) == Decision(False, "no drafting")
    d = p.decide(_ids(1))  # G = 1: 1.99 / 1.5 = 1.33 beats 1.0 by more than 1.02^2
    assert (d.drafting, d.reason) == (True, "full block")
    assert p.decide(_ids(64)) == Decision(False, "no drafting")  # and off again at once
    assert p.counters["drafting_switches"] == 3
    assert p.counters["steps_not_drafting"] == 4


def test_stale_survivals_count_as_fully_confident():
    # G = 64: t_full / t_plain = 2.4, so with probe_budget 0.5 survivals go stale after
    # ceil(1.4 / 0.5) = 3 steps (with the 1% default: 140)
    p = _policy(dwell=0, probe_budget=0.5)
    assert (p.stale_after(64), _policy().stale_after(64), _policy().stale_after(1)) == (3, 140, 50)
    p.observe(_ids(64), torch.zeros(64, K), [False] * 64)
    assert [p.decide(_ids(64)).drafting for _ in range(4)] == [False] * 4
    # observed at step 0; at step 4 they are older than 3 steps: a = 1 again
    assert p.decide(_ids(64)) == Decision(True, "full block")
    assert p.survival_sum(_ids(2), 64) == 2 * K
    with pytest.raises(ValueError, match="probe_budget must be in"):
        _policy(probe_budget=0)


def test_a_probe_of_two_steps_makes_staleness_twice_as_long():
    """Drafting steps launched ahead: the second step of a probe is decided before the first's
    survivals are read, so a probe costs two drafting steps and survivals stay fresh twice
    as long for the same budget (G = 64: 2 x 1.4 / 0.5 -> 6 steps; 2 x 140 = 280 at 1%)."""
    p = _policy(dwell=0, probe_budget=0.5, probe_steps=2)
    assert (p.stale_after(64), _policy(probe_steps=2).stale_after(64)) == (6, 280)
    p.observe(_ids(64), torch.zeros(64, K), [False] * 64)
    steps = [p.decide(_ids(64)).drafting for _ in range(8)]
    assert steps == [False] * 7 + [True]  # observed at step 0, older than 6 at step 7
    with pytest.raises(ValueError, match="probe_steps must be >= 1, got 0"):
        _policy(probe_steps=0)


def test_probes_are_two_steps_where_drafting_steps_launch_ahead():
    runner = SimpleNamespace(uniform_windows=True)  # (the one attribute probe_steps reads)
    assert probe_steps(EngineConfig(model="m"), runner) == 2
    assert probe_steps(EngineConfig(model="m", async_scheduling=False), runner) == 1
    assert probe_steps(EngineConfig(model="m"), SimpleNamespace(uniform_windows=False)) == 1


def test_staleness_follows_the_realised_prices():
    """A probe costs what a drafting step realises: G = 64's full block priced 2.4 plain steps
    by the table (stale after 140 steps) but realised at 1.5x it, 3.6: stale after
    ceil(2.6 / 0.01) = 260."""
    p = _policy(realised_costs=RealisedCosts(min_steps=2))
    assert p.stale_after(64) == 140  # nothing measured yet: the table's prices
    plain, full = Decision(False, "no drafting", (64, 64)), Decision(True, "full block", (64, 512))
    for _ in range(2):
        p.record_step(plain, 1.0)
        p.record_step(full, 1.5 * 2.4)
    assert p.stale_after(64) == 260
    assert p.stale_after(1) == 50  # G = 1 measured nothing: its table's


def test_a_sampled_step_sets_staleness_by_the_sampled_cells():
    """G = 64 sampled: t_full / t_plain = 4.4 (greedy 2.4), so with probe_budget 0.5 a sampled
    batch's survivals go stale after ceil(3.4 / 0.5) = 7 steps, a greedy batch's after 3."""
    sampled = {1: {1: 1.0, 8: 2.0}, 64: {64: 1.0, 512: 4.4}}
    table = CostTable({}, TABLE.cells, sampled)
    p = _policy(table, dwell=0, probe_budget=0.5)
    assert (p.stale_after(64), p.stale_after(64, sampled=True)) == (3, 7)
    assert _policy(probe_budget=0.5).stale_after(64, sampled=True) == 3  # no sampled cells
    p.observe(_ids(64), torch.zeros(64, K), [False] * 64)
    # observed at step 0: older than 7 steps at step 8 (greedy: older than 3 at step 4)
    steps = [p.decide(_ids(64), sampled=True).drafting for _ in range(9)]
    assert steps == [False] * 8 + [True]


def test_realised_acceptance_recalibrates_the_survivals():
    """Confidences that predict ~1 accepted draft per block while blocks keep ~6: the policy
    scales its estimates by realised / predicted (a prior of 4 blocks damps the first ones)."""
    p = _policy(dwell=0)
    logits = torch.zeros(64, K)  # c = 0.5: 0.99 predicted accepted drafts per block
    predicted = torch.sigmoid(logits[0]).cumprod(0).sum().item()
    p.observe(_ids(64), logits, [False] * 64)
    assert p.correction == 1.0  # no accepted counts given: no evidence
    assert not p.decide(_ids(64)).drafting  # 64 * 1.99 / 2.4 < 64 / 1.0
    p.observe(_ids(1), logits[:1], [False], num_accepted=[6], verify_len=[K])
    d = 0.5 ** (1 / 256)  # one block of decay (half-life 256 blocks) on the prior
    assert p.correction == pytest.approx((4 * d + 6) / (4 * d + predicted))
    p.observe(_ids(64), logits, [False] * 64, num_accepted=[6] * 64, verify_len=[K] * 64)
    assert p.correction > 5
    assert p.survival_sum(["r0"], 64) == pytest.approx(min(K, p.correction * predicted))
    assert p.decide(_ids(64)) == Decision(True, "full block")
    # windows shortened near max_tokens are censored: they do not move the ratio
    before = p.correction
    p.observe(_ids(2), logits[:2], [False] * 2, num_accepted=[0, 0], verify_len=[2, 3])
    assert p.correction == pytest.approx(before)


def test_greedy_rows_use_the_greedy_temperatures():
    temps = {False: torch.ones(K), True: torch.full((K,), 1e-3)}  # greedy: c -> 1 for logit 1
    p = DraftingPolicy(TABLE, temps, K)
    p.observe(["s", "g"], torch.ones(2, K), [False, True])
    sampled = torch.sigmoid(torch.ones(K)).cumprod(0).sum().item()
    assert p.survival_sum(["s"], 1) == pytest.approx(sampled)
    assert p.survival_sum(["g"], 1) == pytest.approx(K)


def test_hysteresis_needs_the_squared_gain_to_switch():
    # plain 1.0, full 1.99 / 1.0 * x: a full block just 3% better than plain while drafting is
    # off does not turn it on (it needs 1.02^2 = 4.04%), 5% does
    for full, expect in ((1.99 / 1.03, False), (1.99 / 1.05, True)):
        p = DraftingPolicy(CostTable({}, {1: {1: 1.0, 8: full}}), ONES, K, 0.02, 0)
        p.drafting = False
        p.observe(["r0"], torch.zeros(1, K), [False])
        assert p.decide(["r0"]).drafting is expect


def test_no_table_always_drafts_and_trimmed_cells_are_not_runnable():
    p = _policy(table=None)
    assert p.decide(_ids(64)).reason == "no table" and p.decide(_ids(3)).drafting
    assert _policy(table=CostTable({}, {4: {4: 1.0, 12: 1.3}})).table is None  # V=12 is trimmed
    p = _policy(dwell=0)
    assert p.decide(_ids(65)).reason == "batch beyond the table"


def test_forgotten_requests_are_fully_confident_again_or_priced_by_the_population():
    for unobserved, drafts_again in (("confident", True), ("population", False)):
        p = _policy(dwell=0, unobserved=unobserved)
        p.observe(_ids(64), torch.full((64, K), -10.0), [True] * 64)
        assert not p.decide(_ids(64)).drafting
        for rid in _ids(64):
            p.forget(rid)
        assert p.decide(_ids(64)).drafting is drafts_again


def test_population_prior_prices_an_admission_wave_by_the_recent_requests():
    # 64 observed rows at c = 0.5 (sum ~0.99): drafting off at G = 64; then 64 new requests
    confident, population = _policy(dwell=0, unobserved="confident"), _policy(dwell=0)
    assert population.unobserved == "population"  # the default
    new = [f"new{i}" for i in range(64)]
    assert population.unobserved_sum() == K  # no evidence yet: fully confident
    for p in (confident, population):
        p.observe(_ids(64), torch.zeros(64, K), [False] * 64)
        assert not p.decide(_ids(64)).drafting
    assert confident.decide(new).drafting  # a = 1 each: 64 * 8 / 2.4 beats 64 / 1.0
    assert population.unobserved_sum() == pytest.approx(0.99, abs=0.01)
    assert not population.decide(new).drafting  # priced like the rows before them
    assert population.decide(new[:1]).drafting  # G = 1: 1.99 / 1.5 still pays
    with pytest.raises(ValueError, match="unobserved"):
        _policy(unobserved="sometimes")


def test_one_weak_block_neither_stops_drafting_nor_keeps_it_off():
    """G = 1 (plain 1.0, full 1.5): a request that keeps ~5.6 of 7 drafts, then one block of
    none. Smoothed over its blocks the weak block does not turn drafting off; after a run of
    weak blocks it does, and the estimate's pull to the population mean brings drafting back
    long before the row is stale (50 steps), where its last block alone would keep it off."""
    strong, weak = torch.full((1, K), 3.0), torch.full((1, K), -10.0)
    smoothed, last_only = _policy(dwell=2), _policy(dwell=2, block_half_life=0,
                                                    regression_half_life=1e9)  # fmt: skip
    for p in (smoothed, last_only):
        for _ in range(20):
            p.observe(["r0"], strong, [False])
            assert p.decide(["r0"]).drafting
        p.observe(["r0"], weak, [False])
    assert smoothed.decide(["r0"]).drafting
    assert not last_only.decide(["r0"]).drafting
    for _ in range(4):
        smoothed.observe(["r0"], weak, [False])
    assert not smoothed.decide(["r0"]).drafting
    back = next(n for n in range(1, 60) if smoothed.decide(["r0"]).drafting)
    assert back < smoothed.stale_after(1) == 50
    assert not any(last_only.decide(["r0"]).drafting for _ in range(40))
    with pytest.raises(ValueError, match="regression_half_life"):
        _policy(regression_half_life=0)


def test_before_a_population_forms_an_aged_estimate_is_pulled_toward_k():
    """A served engine at concurrency 1 starts with no population: its first request's first
    block is weak and turns drafting off. Its estimate then ages toward K (what a request with
    no evidence counts) and drafting resumes after the dwell, long before the row is stale; it
    was held at the weak block until stale (an H100 server drafted in none of ~1,100 steps)."""
    p = _policy(dwell=2)
    p.observe(["r0"], torch.full((1, K), -10.0), [False])  # keeps ~nothing
    assert p.population_mean() is None and p.estimate_totals(["r0"], 0)[0][0] < 0.01
    assert not p.decide(["r0"]).drafting
    back = next(n for n in range(1, 60) if p.decide(["r0"]).drafting)
    assert 2 <= back < p.stale_after(1) / 4  # (the dwell, then a step or two of age)
    for _ in range(16):  # once the population has its blocks, it is the target again
        p.observe(["r1"], torch.full((1, K), -10.0), [False])
    assert p.population_mean() == pytest.approx(0.0, abs=0.01)
    p.observe(["r0"], torch.full((1, K), -10.0), [False])
    assert not any(p.decide(["r0"]).drafting for _ in range(40))


def test_a_stale_population_prices_an_unseen_request_as_fully_confident():
    """The population is evidence that goes stale too. Its mean below break-even (16 weak
    blocks), new requests priced by it do not draft, and nothing refreshes it while nothing
    drafts: a served engine at concurrency 1 never drafted again. Once its newest block is
    older than the stale horizon, an unseen request counts K and probes; the probe's weak block
    turns drafting off again until the next horizon."""
    p = _policy(dwell=2)
    p.observe(_ids(16), torch.full((16, K), -10.0), [False] * 16)
    for rid in _ids(16):
        p.forget(rid)
    assert p.population_mean() == pytest.approx(0.0, abs=0.01)
    horizon = p.stale_after(1)
    decisions = [p.decide(["new"]).drafting for _ in range(horizon + 2)]
    probe = decisions.index(True)
    assert horizon - 1 <= probe <= horizon + 1 and not any(decisions[:probe])
    assert p.row_totals(["new"], 1) == ([float(K)], [STALE])
    p.observe(["new"], torch.full((1, K), -10.0), [False])  # the probe's block: weak again
    assert not any(p.decide(["new"]).drafting for _ in range(horizon // 2))
    confident = _policy(dwell=2, unobserved="confident")  # (counts K whatever the population)
    assert confident.decide(["new"]).drafting


def test_an_aged_estimate_pulled_toward_the_request_or_the_population():
    """G = 1 at plain 1.0, full 2.5: drafting pays above ~1.6 kept drafts a block. The
    population (64 rows) keeps most drafts. A request that kept nothing in 12 blocks is pulled
    back over the line within the dwell's reach by the population mean, not by its own
    (shrunk) mean; one whose 4 weak blocks follow 10 strong ones comes back either way."""
    table = CostTable({}, {1: {1: 1.0, 8: 2.5}, 64: {64: 1.0, 512: 2.4}})
    strong, weak = torch.full((1, K), 3.0), torch.full((1, K), -10.0)
    resumed = {}
    for target in ("population", "request"):
        p = _policy(table, dwell=2, regression_target=target)
        for _ in range(4):
            p.observe(_ids(64), strong.expand(64, K), [False] * 64)
        for _ in range(12):
            p.observe(["poor"], weak, [False])
        for _ in range(10):
            p.observe(["dip"], strong, [False])
        for _ in range(4):
            p.observe(["dip"], weak, [False])
        assert not p.decide(["poor"]).drafting and not p.decide(["dip"]).drafting
        resumed[target] = (any(p.decide(["poor"]).drafting for _ in range(40)),
                           any(p.decide(["dip"]).drafting for _ in range(40)))  # fmt: skip
        assert p.stale_after(1) == 150  # (within 40 steps nothing went stale)
    assert resumed == {"population": (True, True), "request": (False, True)}
    p.forget("poor")
    assert "poor" not in p._request_blocks
    with pytest.raises(ValueError, match="regression_target must be one of"):
        _policy(regression_target="elsewhere")


def _blocks(policy, qualities, rounds):
    """Full blocks from rows r0.. of the given qualities (a callable: row, round -> strong?),
    each keeping the drafts its confidences predict (6 of a strong block, 0 of a weak one)."""
    strong, weak = torch.full((K,), 3.0), torch.full((K,), -10.0)
    rows = _ids(len(qualities(None, None)))
    for t in range(rounds):
        picks = [qualities(i, t) for i in range(len(rows))]
        logits = torch.stack([strong if pick else weak for pick in picks])
        policy.observe(rows, logits, [False] * len(rows), [6 if pick else 0 for pick in picks],
                       [K] * len(rows))  # fmt: skip


def test_persistence_is_measured_before_a_weak_estimate_stops_drafting():
    """G = 1 (plain 1.0, full 1.5: drafting pays above 0.56 kept drafts a block). Rows whose
    blocks are strong or weak at random say nothing about their next block (rho ~ 0): after a
    run of weak blocks the row is priced by the population mean and keeps drafting, where the
    unfitted policy stops. Rows that keep their quality (rho ~ 1) stop as before."""
    rng = torch.Generator().manual_seed(0)
    coin = torch.rand(64, 40, generator=rng) < 0.5
    independent = lambda i, t: [None] * 64 if i is None else bool(coin[i, t])  # noqa: E731
    persistent = lambda i, t: [None] * 64 if i is None else i % 2 == 0  # noqa: E731
    fitted, unfitted = _policy(dwell=0), _policy(dwell=0, fit_persistence=False)
    for p in (fitted, unfitted):
        _blocks(p, independent, 40)
        weak_run = torch.full((4, 1, K), -10.0)
        for logits in weak_run:  # r0's last four blocks kept nothing
            p.observe(["r0"], logits, [False], [0], [K])
    assert fitted.persistence < 0.2 and unfitted.persistence == 1.0
    assert fitted.decide(["r0"]).drafting
    assert not unfitted.decide(["r0"]).drafting
    kept = _policy(dwell=0)
    _blocks(kept, persistent, 40)
    assert kept.persistence > 0.9
    assert kept.decide(["r0"]).drafting and not kept.decide(["r1"]).drafting


def test_persistence_pairs_a_block_with_the_estimate_its_decision_read():
    """Rows whose blocks alternate strong, weak, strong, ... With decisions one block behind
    (synchronous) the estimate before a block leans to the other kind (the newest block
    weighs half), so a row's past says the opposite of its next block: rho 0. Where drafting
    steps launch ahead, the decision about a block read the row's sum one block earlier,
    which leans to the same kind: rho 1, and a pairing with the newer sum would have priced
    that evidence by the wrong persistence."""
    alternating = lambda i, t: [None] * 64 if i is None else (i + t) % 2 == 0  # noqa: E731
    synchronous, ahead = _policy(dwell=0), _policy(dwell=0, decision_lag=2)
    for p in (synchronous, ahead):
        _blocks(p, alternating, 40)
    assert synchronous.persistence == 0.0 and ahead.persistence == 1.0
    ahead.forget("r0")  # (a finished request's earlier sum goes with it)
    assert "r0" not in ahead._earlier_sums and "r1" in ahead._earlier_sums
    with pytest.raises(ValueError, match="decision_lag must be 1 or 2, got 3"):
        _policy(decision_lag=3)


# ---- the engine -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def drafter(tiny_vocab_dir, tmp_path_factory):
    return make_tiny_drafter(tiny_vocab_dir, tmp_path_factory.mktemp("drafter_p"), taps=(0,))


KW = dict(dtype="float32", device="cpu", num_kv_pages=256, max_num_seqs=4, max_model_len=256)
PROMPTS = [[2, 3, 4], [5, 6, 7, 8, 9], [9], [4, 4, 4, 4]]


def _spec(drafter, **extra):
    # (realised step costs off: the choices these tests assert come from their tables alone)
    return {"model": str(drafter), "num_speculative_tokens": 3, "realised_costs": False,
            **extra}  # fmt: skip


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
    tiny_vocab_dir, drafter, tmp_path, monkeypatch, caplog
):
    """`dspark profile` without --out writes to the user's tables, where every engine with the
    table's fingerprint finds it; without one, the engine warns that it drafts every step."""
    import dspark.policy.cost_table as cost_table

    monkeypatch.setenv(cost_table.CACHE_ENV, str(tmp_path / "cache"))
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
    llm = LLM(str(tiny_vocab_dir), speculative_config=_spec(drafter, cost_table=str(costly)),
              **KW)  # fmt: skip
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
    llm = LLM(str(tiny_vocab_dir), speculative_config=_spec(drafter, cost_table=str(cheap)),
              **KW)  # fmt: skip
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


def test_engine_fits_persistence_unless_told_not_to(tiny_vocab_dir, drafter, tmp_path):
    probe = LLM(str(tiny_vocab_dir), speculative_config=_spec(drafter), **KW)
    cheap = _write_table(tmp_path / "cheap.json", probe, 1e-3, 1e-3)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    fitted, unfitted = (
        LLM(str(tiny_vocab_dir), speculative_config=_spec(drafter, cost_table=str(cheap),
                                                          persistence=flag), **KW)
        for flag in (True, False)
    )  # fmt: skip
    for llm in (fitted, unfitted):
        llm.generate(PROMPTS * 4, params, use_tqdm=False)
    assert fitted.engine.policy._pairs[0] > 32  # every drafting step after a row's first
    assert fitted.engine.policy.decision_lag == 1  # (no drafting step launched ahead here)
    assert 0.0 <= fitted.get_metrics()["survival_persistence"] <= 1.0
    assert unfitted.get_metrics()["survival_persistence"] == 1.0
    with pytest.raises(ValueError, match='"persistence" must be true or false'):
        LLM(str(tiny_vocab_dir), speculative_config=_spec(drafter, persistence="no"), **KW)


def test_engine_with_steps_ahead_fits_what_its_decisions_read(tiny_vocab_dir, drafter, tmp_path):
    """Drafting steps launched ahead (windows laid out K + 1 wide, as CUDA graphs do; on a GPU
    spec_setup gives the policy decision_lag 2 then): the fit takes pairs from the rows' earlier
    sums, and a finished request's is forgotten with it."""
    probe = LLM(str(tiny_vocab_dir), speculative_config=_spec(drafter), **KW)
    cheap = _write_table(tmp_path / "cheap.json", probe, 1e-3, 1e-3)
    llm = LLM(str(tiny_vocab_dir), speculative_config=_spec(drafter, cost_table=str(cheap)), **KW)
    llm.engine.runner.spec_runner.uniform_windows = True
    policy = llm.engine.policy
    policy.decision_lag = 2
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    llm.generate(PROMPTS * 4, params, use_tqdm=False)
    assert llm.engine.runner.stats["spec_steps_launched_ahead"] > 0
    assert policy._pairs[0] > 16  # pairs from blocks after a row's second
    assert not policy._earlier_sums  # every request finished and was forgotten


def test_the_dwell_is_a_key_of_speculative_config(tiny_vocab_dir, drafter, tmp_path):
    probe = LLM(str(tiny_vocab_dir), speculative_config=_spec(drafter), **KW)
    assert probe.engine.config.spec().dwell_steps == 8  # the default
    costly = _write_table(tmp_path / "costly.json", probe, 1e-3, 5e-3)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    counters = {}
    for dwell in (0, 8):
        spec = _spec(drafter, cost_table=str(costly), dwell_steps=dwell)
        llm = LLM(str(tiny_vocab_dir), speculative_config=spec, **KW)
        assert llm.engine.policy.min_dwell_steps == dwell
        llm.generate(PROMPTS, params, use_tqdm=False)
        counters[dwell] = llm.get_metrics()["drafting_policy"]
    assert counters[8]["decision_dwell"] >= 7 and "decision_dwell" not in counters[0]
    # without a dwell, near break-even, drafting turns off and on again within a request: the
    # drafter's context after each plain stretch must still give the target's greedy tokens
    plain = LLM(str(tiny_vocab_dir), **KW).generate(PROMPTS, params, use_tqdm=False)
    edge = _write_table(tmp_path / "edge.json", probe, 1e-3, 1.2e-3)
    spec = _spec(drafter, cost_table=str(edge), dwell_steps=0, min_gain=0.0)
    flapping = LLM(str(tiny_vocab_dir), speculative_config=spec, **KW)
    got = flapping.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    assert flapping.get_metrics()["drafting_policy"]["drafting_switches"] >= 4
    for bad in (-1, 1.5, True, 10_001):
        with pytest.raises(ValueError, match=r'"dwell_steps" must be an integer in \[0, 10000\]'):
            LLM(str(tiny_vocab_dir), speculative_config=_spec(drafter, dwell_steps=bad), **KW)


def test_price_switches_makes_a_switch_off_pay_for_its_round_trip():
    """G = 1 at TABLE's prices (plain 1.0, full block 1.5), dwell 8: switching off must also
    win 1.5 / (8 x 1.0) = 0.19 more. A row keeping 0.4 drafts a block (1.4 tokens in 1.5
    against 1 in 1.0: plain decoding 7% ahead) turns drafting off without the price, not with
    it; a row keeping none (plain 50% ahead) turns it off either way."""
    kept_04 = torch.full((1, K), -30.0)
    kept_04[0, 0] = math.log(0.4 / 0.6)  # a_1 = 0.4, the later positions ~0
    hopeless = torch.full((1, K), -30.0)
    for logits, off_without, off_with in ((kept_04, True, False), (hopeless, True, True)):
        for priced, expect_off in ((False, off_without), (True, off_with)):
            p = _policy(dwell=8, price_switches=priced)
            p.observe(["r0"], logits, [False])
            assert p.decide(["r0"]).drafting is not expect_off, (logits[0, 0], priced)
    # by the table's steady cells, not the realised prices (dwell 2: 1.5 / (2 x 1.0))
    costs = RealisedCosts(min_steps=1)
    priced = _policy(price_switches=True, realised_costs=costs)
    priced.record_step(Decision(True, "full block", (1, 8)), 6.0)  # 4x the table's 1.5
    assert priced.priced_cells(1, False)[1][8] > 1.5 and priced._round_trip_margin(1, False) == 0.75


def test_price_switches_is_a_key_of_speculative_config(tiny_vocab_dir, drafter, tmp_path):
    """ "price_switches": true reaches the policy (off by default); near break-even the tokens
    stay the target's greedy ones, and drafting switches less often than without it."""
    probe = LLM(str(tiny_vocab_dir), speculative_config=_spec(drafter), **KW)
    assert probe.engine.config.spec().price_switches is False  # the default
    edge = _write_table(tmp_path / "edge.json", probe, 1e-3, 1.2e-3)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = LLM(str(tiny_vocab_dir), **KW).generate(PROMPTS, params, use_tqdm=False)
    switches = {}
    for priced in (False, True):
        spec = _spec(drafter, cost_table=str(edge), dwell_steps=0, price_switches=priced)
        llm = LLM(str(tiny_vocab_dir), speculative_config=spec, **KW)
        assert llm.engine.policy.price_switches is priced
        got = llm.generate(PROMPTS, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
        switches[priced] = llm.get_metrics()["drafting_policy"].get("drafting_switches", 0)
    assert switches[True] < switches[False], switches  # (dwell 0: a margin of 1.2 t_full / t_plain)
    with pytest.raises(ValueError, match='"price_switches" must be true or false'):
        LLM(str(tiny_vocab_dir), speculative_config=_spec(drafter, price_switches=1), **KW)


def test_the_regression_target_is_a_key_of_speculative_config(tiny_vocab_dir, drafter, tmp_path):
    """ "regression_target": "request" reaches the policy, and near break-even, where estimates
    decide every few steps, the tokens stay the target's greedy ones."""
    probe = LLM(str(tiny_vocab_dir), speculative_config=_spec(drafter), **KW)
    assert probe.engine.config.spec().regression_target == "population"  # the default
    edge = _write_table(tmp_path / "edge.json", probe, 1e-3, 1.2e-3)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = LLM(str(tiny_vocab_dir), **KW).generate(PROMPTS, params, use_tqdm=False)
    spec = _spec(drafter, cost_table=str(edge), dwell_steps=0, regression_target="request")
    llm = LLM(str(tiny_vocab_dir), speculative_config=spec, **KW)
    assert llm.engine.policy.regression_target == "request"
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    assert llm.get_metrics()["drafting_policy"]["steps_drafting"] > 0
    with pytest.raises(ValueError, match='"regression_target" must be one of'):
        LLM(str(tiny_vocab_dir), speculative_config=_spec(drafter, regression_target="x"), **KW)


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
    with pytest.raises(ValueError, match='"unobserved" must be one of'):
        LLM(str(tiny_vocab_dir), speculative_config=_spec(own, unobserved="K"), **KW)
    pop = LLM(str(tiny_vocab_dir), speculative_config=_spec(own, unobserved="population"), **KW)
    assert pop.engine.policy.unobserved == "population"


def test_a_batch_that_samples_is_priced_by_the_sampled_cells():
    """Greedy full blocks cheap, sampled ones dear: the same survivals draft when every row is
    greedy and do not when one samples; without sampled cells the greedy ones price it too,
    counted. Sampled cells for other G than the greedy ones are refused."""
    sampled = {1: {1: 1.0, 8: 4.0}, 64: {64: 1.0, 512: 9.0}}
    table = CostTable({}, dict(TABLE.cells), sampled)
    p = _policy(table, dwell=0)
    assert p.sampled_table is not None
    p.observe(["r0"], torch.zeros(1, K), [False])  # survival sum ~0.99: 1.99 / 1.5 at G = 1
    assert p.decide(["r0"], sampled=False).drafting
    assert not p.decide(["r0"], sampled=True).drafting  # 1.99 / 4.0 < 1 / 1.0
    greedy_only = _policy(dwell=0)
    greedy_only.observe(["r0"], torch.zeros(1, K), [False])
    assert greedy_only.decide(["r0"], sampled=True).drafting
    assert greedy_only.counters["sampled_priced_by_greedy_cells"] == 1
    assert _policy(CostTable({}, dict(TABLE.cells), {1: sampled[1]})).sampled_table is None


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
