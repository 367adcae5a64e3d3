"""The survival estimates the choice rests on (policy/survival.py): recalibration, the
population of recent requests, smoothing and ageing, the persistence fit; through the policy's
choices at TABLE's prices."""

from __future__ import annotations

import pytest
import torch

from dspark.policy.cost_table import CostTable
from dspark.policy.policy import Decision, DraftingPolicy
from dspark.policy.survival import STALE
from tests.policy.test_policy import TABLE, K, _ids, _policy


def test_realised_acceptance_recalibrates_the_survivals():
    """Confidences that predict ~1 accepted draft per block while blocks keep ~6: the policy
    scales its estimates by realised / predicted (a prior of 4 blocks damps the first ones)."""
    p = _policy(dwell=0)
    logits = torch.zeros(64, K)  # c = 0.5: 0.99 predicted accepted drafts per block
    predicted = torch.sigmoid(logits[0]).cumprod(0).sum().item()
    p.observe(_ids(64), logits, [False] * 64)
    assert p.estimates.correction == 1.0  # no accepted counts given: no evidence
    assert not p.decide(_ids(64)).drafting  # 64 * 1.99 / 2.4 < 64 / 1.0
    p.observe(_ids(1), logits[:1], [False], num_accepted=[6], verify_len=[K])
    d = 0.5 ** (1 / 256)  # one block of decay (half-life 256 blocks) on the prior
    assert p.estimates.correction == pytest.approx((4 * d + 6) / (4 * d + predicted))
    p.observe(_ids(64), logits, [False] * 64, num_accepted=[6] * 64, verify_len=[K] * 64)
    assert p.estimates.correction > 5
    assert p.survival_sum(["r0"], 64) == pytest.approx(min(K, p.estimates.correction * predicted))
    assert p.decide(_ids(64)) == Decision(True, "full block")
    # windows shortened near max_tokens are censored: they do not move the ratio
    before = p.estimates.correction
    p.observe(_ids(2), logits[:2], [False] * 2, num_accepted=[0, 0], verify_len=[2, 3])
    assert p.estimates.correction == pytest.approx(before)


def test_greedy_rows_use_the_greedy_temperatures():
    temps = {False: torch.ones(K), True: torch.full((K,), 1e-3)}  # greedy: c -> 1 for logit 1
    p = DraftingPolicy(TABLE, temps, K)
    p.observe(["s", "g"], torch.ones(2, K), [False, True])
    sampled = torch.sigmoid(torch.ones(K)).cumprod(0).sum().item()
    assert p.survival_sum(["s"], 1) == pytest.approx(sampled)
    assert p.survival_sum(["g"], 1) == pytest.approx(K)


def test_forgotten_requests_are_priced_by_the_population():
    p = _policy(dwell=0)
    p.observe(_ids(64), torch.full((64, K), -10.0), [True] * 64)
    assert not p.decide(_ids(64)).drafting
    for rid in _ids(64):
        p.forget(rid)
    assert not p.decide(_ids(64)).drafting  # unseen again, priced like the rows before them


def test_population_prior_prices_an_admission_wave_by_the_recent_requests():
    # 64 observed rows at c = 0.5 (sum ~0.99): drafting off at G = 64; then 64 new requests,
    # which at a = 1 each would draft (64 * 8 / 2.4 beats 64 / 1.0)
    p = _policy(dwell=0)
    new = [f"new{i}" for i in range(64)]
    assert p.estimates.unobserved_sum() == K  # no evidence yet: fully confident
    p.observe(_ids(64), torch.zeros(64, K), [False] * 64)
    assert not p.decide(_ids(64)).drafting
    assert p.estimates.unobserved_sum() == pytest.approx(0.99, abs=0.01)
    assert not p.decide(new).drafting  # priced like the rows before them
    assert p.decide(new[:1]).drafting  # G = 1: 1.99 / 1.5 still pays


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
    with pytest.raises(ValueError, match="regression_half_life must be > 0"):
        _policy(regression_half_life=0)


def test_before_a_population_forms_an_aged_estimate_is_pulled_toward_k():
    """A served engine at concurrency 1 starts with no population: its first request's first
    block is weak and turns drafting off. Its estimate then ages toward K (what a request with
    no evidence counts) and drafting resumes after the dwell, long before the row is stale; it
    was held at the weak block until stale (an H100 server drafted in none of ~1,100 steps)."""
    p = _policy(dwell=2)
    p.observe(["r0"], torch.full((1, K), -10.0), [False])  # keeps ~nothing
    estimates = p.estimates
    assert estimates.population_mean() is None and estimates.estimate_totals(["r0"], 0)[0][0] < 0.01
    assert not p.decide(["r0"]).drafting
    back = next(n for n in range(1, 60) if p.decide(["r0"]).drafting)
    assert 2 <= back < p.stale_after(1) / 4  # (the dwell, then a step or two of age)
    for _ in range(16):  # once the population has its blocks, it is the target again
        p.observe(["r1"], torch.full((1, K), -10.0), [False])
    assert p.estimates.population_mean() == pytest.approx(0.0, abs=0.01)
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
    assert p.estimates.population_mean() == pytest.approx(0.0, abs=0.01)
    horizon = p.stale_after(1)
    decisions = [p.decide(["new"]).drafting for _ in range(horizon + 2)]
    probe = decisions.index(True)
    assert horizon - 1 <= probe <= horizon + 1 and not any(decisions[:probe])
    assert p.row_totals(["new"], 1) == ([float(K)], [STALE])
    p.observe(["new"], torch.full((1, K), -10.0), [False])  # the probe's block: weak again
    assert not any(p.decide(["new"]).drafting for _ in range(horizon // 2))


def test_an_aged_estimate_is_pulled_toward_the_population():
    """G = 1 at plain 1.0, full 2.5: drafting pays above ~1.6 kept drafts a block. The
    population (64 rows) keeps most drafts. A request that kept nothing in 12 blocks is pulled
    back over the line by the population mean (its own mean would keep it off for good); one
    whose 4 weak blocks follow 10 strong ones comes back too."""
    table = CostTable({}, {1: {1: 1.0, 8: 2.5}, 64: {64: 1.0, 512: 2.4}})
    strong, weak = torch.full((1, K), 3.0), torch.full((1, K), -10.0)
    p = _policy(table, dwell=2)
    for _ in range(4):
        p.observe(_ids(64), strong.expand(64, K), [False] * 64)
    for _ in range(12):
        p.observe(["poor"], weak, [False])
    for _ in range(10):
        p.observe(["dip"], strong, [False])
    for _ in range(4):
        p.observe(["dip"], weak, [False])
    assert not p.decide(["poor"]).drafting and not p.decide(["dip"]).drafting
    assert any(p.decide(["poor"]).drafting for _ in range(40))
    assert any(p.decide(["dip"]).drafting for _ in range(40))
    assert p.stale_after(1) == 150  # (within 40 steps nothing went stale)


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
    run of weak blocks the row is priced by the population mean and keeps drafting, where a
    policy before the fit has its pairs (rho = 1: own estimates in full) stops. Rows that keep
    their quality (rho ~ 1) stop as before."""
    rng = torch.Generator().manual_seed(0)
    coin = torch.rand(64, 40, generator=rng) < 0.5
    independent = lambda i, t: [None] * 64 if i is None else bool(coin[i, t])  # noqa: E731
    persistent = lambda i, t: [None] * 64 if i is None else i % 2 == 0  # noqa: E731
    fitted, unfitted = _policy(dwell=0), _policy(dwell=0, min_persistence_blocks=1e9)
    for p in (fitted, unfitted):
        _blocks(p, independent, 40)
        weak_run = torch.full((4, 1, K), -10.0)
        for logits in weak_run:  # r0's last four blocks kept nothing
            p.observe(["r0"], logits, [False], [0], [K])
    assert fitted.estimates.persistence < 0.2 and unfitted.estimates.persistence == 1.0
    assert fitted.decide(["r0"]).drafting
    assert not unfitted.decide(["r0"]).drafting
    kept = _policy(dwell=0)
    _blocks(kept, persistent, 40)
    assert kept.estimates.persistence > 0.9
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
    assert synchronous.estimates.persistence == 0.0 and ahead.estimates.persistence == 1.0
    ahead.forget("r0")  # (a finished request's earlier sum goes with it)
    earlier = ahead.estimates._earlier_sums
    assert "r0" not in earlier and "r1" in earlier
    with pytest.raises(ValueError, match="decision_lag must be 1 or 2, got 3"):
        _policy(decision_lag=3)


@pytest.mark.parametrize("seed", range(4))
def test_the_running_sum_equals_the_pass_over_the_rows(seed):
    """running_sum (RunningSums as requests join and leave, are forgotten while they run, age
    and go stale, and the population goes stale) equals the sum of estimate_totals at every
    call of a random run of drafting and plain stretches; a missed report falls back."""
    import random

    from dspark.policy.survival import SurvivalEstimates

    rng = random.Random(seed)
    est = SurvivalEstimates({g: torch.full((K,), 1.5) for g in (False, True)}, K)
    running, next_id, kept = [], 0, 0
    for _ in range(300):
        if rng.random() < 0.3 or not running:  # admissions (a preempted request comes back)
            for _ in range(rng.randint(1, 4)):
                running.append(f"r{next_id}")
                est.running(running[-1], True)
                next_id += 1
        if rng.random() < 0.3:  # finished (forgotten after leaving) or preempted (kept)
            for rid in rng.sample(running, min(len(running), rng.randint(1, 3))):
                running.remove(rid)
                est.running(rid, False)
                if rng.random() < 0.7:
                    est.forget(rid)
        if rng.random() < 0.1 and running:  # forgotten while it still runs
            est.forget(rng.choice(running))
        if rng.random() < 0.25 and running:  # a drafting step of some rows
            rows = rng.sample(running, rng.randint(1, len(running)))
            est.observe(rows, torch.randn(len(rows), K), [rng.random() < 0.5 for _ in rows],
                        [rng.randint(0, K) for _ in rows], [K] * len(rows))  # fmt: skip
        fresh_since = est.step - rng.randint(0, 40)
        expected = sum(est.estimate_totals(running, fresh_since)[0])
        assert est.running_sum(running, fresh_since) == pytest.approx(expected, abs=1e-9)
        kept += est._sums is not None
        est.step += 1
    assert kept > 150
    est.running("never-joined", False)  # (moves nothing)
    est.running(running[0], True)  # (reported twice: moves nothing)
    expected = sum(est.estimate_totals(running, est.step)[0])
    assert est.running_sum(running, est.step) == pytest.approx(expected, abs=1e-9)
    # a request the scheduler did not report: the pass over the rows
    rows = [*running, "unreported"]
    expected = sum(est.estimate_totals(rows, est.step)[0])
    assert est.running_sum(rows, est.step) == pytest.approx(expected, abs=1e-9)
    assert est._sums is None


@pytest.mark.parametrize("seed", range(3))
def test_the_vectors_at_once_equal_each_rows_own(seed):
    """estimate_vectors (every row's slot gathered at once) equals the rows priced one by one:
    estimate_totals' totals and kinds, and each row's vector smoothed over its own blocks (the
    population's for a request never observed, flat when stale) rescaled to its total, clipped
    to 1. Requests come and go (freed slots reused, the array grown past its first 64)."""
    import random

    import numpy as np

    from dspark.policy.survival import FRESH, UNSEEN, SurvivalEstimates

    rng, nrng = random.Random(seed), np.random.default_rng(seed)
    k = 5
    est = SurvivalEstimates({g: torch.full((k,), 1.5) for g in (False, True)}, k, keep_vectors=True)
    w = est._block_weight
    own, population, running, next_id = {}, np.zeros(k), [], 0
    for _ in range(200):
        for _ in range(rng.randint(0, 8)):
            running.append(f"r{next_id}")
            next_id += 1
        for rid in rng.sample(running, min(len(running), rng.randint(0, 6))):
            running.remove(rid)
            est.forget(rid)
            own.pop(rid, None)
        if running and rng.random() < 0.6:
            rows = rng.sample(running, rng.randint(1, len(running)))
            a = np.cumprod(nrng.uniform(0.0, 1.0, (len(rows), k)), axis=1)
            est.observe_survivals(rows, a, [rng.randint(0, k) for _ in rows], [k] * len(rows))
            for rid, block in zip(rows, a, strict=True):
                own[rid] = block if rid not in own else own[rid] + w * (block - own[rid])
            population = population * est._decay ** len(rows) + a.sum(0)
        fresh_since = est.step - rng.randint(0, 30)
        vectors, totals, kinds = est.estimate_vectors(running, fresh_since)
        want_totals, want_kinds = est.estimate_totals(running, fresh_since)
        assert kinds.tolist() == want_kinds
        np.testing.assert_allclose(totals, want_totals, rtol=1e-12, atol=1e-12)
        with_population = est.population_mean() is not None
        for i, (rid, total, kind) in enumerate(zip(running, want_totals, want_kinds, strict=True)):
            shape = (own[rid] if kind == FRESH else population
                     if kind == UNSEEN and with_population else np.ones(k))  # fmt: skip
            want = np.minimum(1.0, shape * total / shape.sum()) if shape.sum() > 0 else total / k
            np.testing.assert_allclose(vectors[i], want, rtol=1e-9, atol=1e-12)
        est.step += 1
    assert next_id > 64 + 40 and len(est.vectors.rows) > 66
