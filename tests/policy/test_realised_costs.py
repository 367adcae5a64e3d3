"""Realised step costs (policy/realised_costs.py): cells priced by the table scaled by what the
engine's steps in them took, so drafting steps dearer in a serving loop than in the profiler's
steady state stop paying where the table alone says they pay."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dspark import LLM, SamplingParams
from dspark.policy.cost_table import CostTable
from dspark.policy.policy import Decision, DraftingPolicy
from dspark.policy.realised_costs import RealisedCosts, StepPeriods
from dspark.policy.tuning import TUNING
from tests.policy.test_engine_policy import KW, PROMPTS, _spec, drafter  # noqa: F401

K = 7
ONES = {False: torch.ones(K), True: torch.ones(K)}


def _costs(**tuning) -> RealisedCosts:
    return RealisedCosts(replace(TUNING, **tuning))


def test_worked_example_of_the_docstring():
    costs = _costs(price_half_life=64.0, min_price_steps=8)
    g, full = 256, 256 * 8
    row = {g: 2.2e-3, full: 5.2e-3}
    assert costs.priced(g, row, False) == row  # nothing seen: the table
    for _ in range(7):
        costs.record((g, g), False, 2.2e-3, 2.42e-3)  # plain steps 1.1x the table
    assert costs.ratio((g, g), False) is None  # fewer than min_steps
    costs.record((g, g), False, 2.2e-3, 2.42e-3)
    assert costs.ratio((g, g), False) == pytest.approx(1.1)
    # the full block not seen yet: scaled by the plain cell's drift
    assert costs.priced(g, row, False)[full] == pytest.approx(5.2e-3 * 1.1)
    for _ in range(8):
        costs.record((g, full), False, 5.2e-3, 5.2e-3 * 1.6)
    priced = costs.priced(g, row, False)
    assert priced[g] == pytest.approx(2.42e-3) and priced[full] == pytest.approx(8.32e-3)
    assert costs.priced(g, row, True) == row  # sampled cells are their own
    # an idle pause between calls is clipped: one step cannot swing the ratio past 4
    costs.record((g, full), False, 5.2e-3, 10.0)
    assert costs.ratio((g, full), False) < 1.6 + 4.0 / 8
    assert costs.as_dict()["G=256 V=256 greedy steady"] == pytest.approx(1.1)
    with pytest.raises(ValueError, match="PolicyTuning.price_half_life must be > 0, got 0"):
        _costs(price_half_life=0)


def test_a_trimmed_cell_not_yet_run_is_priced_like_the_full_block_that_runs():
    """On a host slower than the profile, the full block that runs realises dearer than its
    table time. A trimmed cell not yet run takes the full block's ratio, not the plain cell's:
    it stays above the full block as the table has it (the H100's G = 1: trimmed 1.38 ms, full
    1.34 ms), where priced by plain's it would look cheaper and be chosen."""
    g, full, trimmed = 1, 8, 6
    row = {g: 0.73e-3, trimmed: 1.38e-3, full: 1.34e-3}
    costs = _costs(min_price_steps=8)
    for _ in range(8):
        costs.record((g, g), False, 0.73e-3, 0.73e-3)  # plain as the table
        costs.record((g, full), False, 1.34e-3, 1.34e-3 * 1.2)  # drafting 1.2x it
    priced = costs.priced(g, row, False)
    assert priced[trimmed] == pytest.approx(1.38e-3 * 1.2) and priced[trimmed] > priced[full]
    assert priced[g] == pytest.approx(0.73e-3)
    # with the full block unmeasured too, the plain cell's drift prices both
    costs = _costs(min_price_steps=8)
    for _ in range(8):
        costs.record((g, g), False, 0.73e-3, 0.73e-3 * 1.1)
    priced = costs.priced(g, row, False)
    assert priced[trimmed] == pytest.approx(1.38e-3 * 1.1)
    assert priced[full] == pytest.approx(1.34e-3 * 1.1)


def test_policy_stops_drafting_when_drafting_steps_realise_dearer():
    g, full = 64, 64 * (K + 1)
    table = CostTable({}, {g: {g: 1.0, full: 2.2}})
    ids = [f"r{i}" for i in range(g)]
    logits = torch.full((g, K), 0.0)  # survivals 0.5, 0.25, ...: a sum of ~1 a row
    tuning = replace(TUNING, dwell_steps=2, min_price_steps=4)
    policy = DraftingPolicy(table, ONES, K, tuning=tuning)
    policy.observe(ids, logits, [False] * g)
    decision = policy.decide(ids)  # full: 64 * 1.99 / 2.2 = 58 tokens/s, plain 64 / 1.0
    assert decision.drafting is False and decision.cell == (g, g)
    policy.observe(ids, torch.full((g, K), 3.0), [False] * g)  # confident: ~5.8 a row
    for _ in range(2):  # the dwell
        policy.record_step(policy.decide(ids), 1.0)
    decision = policy.decide(ids)
    assert decision.drafting and decision.cell == (g, full)
    for _ in range(4):  # drafting steps take 3.6x the table: 8 plain steps for ~6.8 tokens
        policy.record_step(decision, 8.0)
        decision = policy.decide(ids)
    assert not decision.drafting  # (by the table alone it would draft: 58 < 64 x 5.8 / 2.2)


def test_a_period_counts_only_after_a_step_of_the_same_cell():
    """The docstring's sequence (StepPeriods): under async scheduling a period ends with the
    previous step's completion, so the first step after a switch, and a lone probe with the
    plain step after it, teach nothing; an idle engine's pause is no period either."""
    g = 4
    plain = Decision(False, "no drafting", cell=(g, g))
    full = Decision(True, "full block", cell=(g, g * (K + 1)))
    sequence = [plain, plain, full, full, full, plain, plain, full, plain, plain]
    periods, recorded = StepPeriods(), []
    for i, decision in enumerate(sequence):
        counted = periods.decided(decision, float(i) * i, running=True)  # periods 1, 3, 5, ..
        recorded.append(counted)
    periods.decided(plain, 100.0, running=True)  # (closes the last period)
    recorded = recorded[1:] + [None]  # decision k's period is returned at call k + 1
    assert [c is not None for c in recorded[:-1]] == [
        False, True, False, True, True, False, True, False, False]  # fmt: skip
    assert recorded[1] == (plain, 3.0) and recorded[3] == (full, 7.0)
    # sampled and greedy steps of one cell are different cells
    periods = StepPeriods()
    sampled = Decision(False, "no drafting", cell=(g, g), sampled=True)
    assert periods.decided(plain, 0.0, True) is None
    assert periods.decided(sampled, 1.0, True) is None  # plain's, with nothing before it
    assert periods.decided(sampled, 2.0, True) is None  # sampled after greedy: a switch
    assert periods.decided(sampled, 3.0, True) == (sampled, 1.0)
    # idle: the pause after the last running step's decision is not a period
    assert periods.decided(sampled, 4.0, running=False) == (sampled, 1.0)
    assert periods.decided(sampled, 50.0, True) is None
    assert periods.decided(sampled, 51.0, True) is None  # its predecessor was idle
    assert periods.decided(sampled, 52.0, True) == (sampled, 1.0)


def test_engine_records_realised_costs(tiny_vocab_dir, drafter, tmp_path):  # noqa: F811
    probe = LLM(str(tiny_vocab_dir), speculative_config=_spec(drafter), **KW)
    cells = {g: {g: 1e-3, g * 4: 1.2e-3} for g in (1, 2, 4)}
    path = tmp_path / "t.json"
    path.write_text(CostTable(probe.engine.cost_fingerprint(), cells).to_json())
    llm = LLM(str(tiny_vocab_dir), speculative_config=_spec(drafter, cost_table=str(path)), **KW)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = LLM(str(tiny_vocab_dir), **KW).generate(PROMPTS, params, use_tqdm=False)
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    ratios = llm.get_metrics()["realised_cost_ratios"]
    assert ratios and all(0.25 <= r <= 4.0 for r in ratios.values()), ratios
    assert llm.engine.policy.realised_costs.stale_half_life == TUNING.stale_price_half_life == 16


def test_a_stale_price_reverts_to_its_long_run_level():
    """While a cell goes uncounted (drafting off), its recent ratio reverts toward its long-run
    one, halfway per stale_price_half_life steps counted elsewhere; measured again, it starts
    from the reverted value, not from the spike."""
    g, full = 64, 512
    plain, block = (g, g), (g, full)
    costs = RealisedCosts()  # (half-lives: recent 64 steps, long-run 1024, stale 16)
    ratios = [1.6] * 64 + [3.2] * 8  # drafting at the table's price x 1.6, then a burst: 3.2x
    for ratio in ratios:
        costs.record(block, False, 1.0, ratio)
    recent, long_run = _weighted(ratios, 64), _weighted(ratios, 1024)
    spiked = costs.ratio(block, False)
    assert spiked == pytest.approx(recent)  # counted every step: no reversion
    for _ in range(16):  # drafting off: 16 plain steps counted, no full block
        costs.record(plain, False, 1.0, 1.0)
    reverted = costs.ratio(block, False)
    assert reverted == pytest.approx(long_run + (spiked - long_run) / 2)
    assert costs.priced(g, {g: 1.0, full: 2.0}, False)[full] == pytest.approx(2 * reverted)
    costs.record(block, False, 1.0, 1.6)  # measured again at 1.6: not back up to the spike
    assert costs.ratio(block, False) < reverted
    assert costs.ratio(plain, False) == pytest.approx(1.0)  # measured every step
    with pytest.raises(ValueError, match="stale_price_half_life must be > 0"):
        _costs(stale_price_half_life=0)


def _weighted(ratios: list[float], half_life: float) -> float:
    """The exponentially weighted mean of the ratios, newest last."""
    total = weight = 0.0
    for ratio in ratios:
        total, weight = total * 0.5 ** (1 / half_life) + ratio, weight * 0.5 ** (1 / half_life) + 1
    return total / weight


def test_after_a_burst_drafting_resumes_long_before_the_survivals_go_stale():
    """The policy after a burst of dear drafting steps (arrivals): the full block's spiked
    price reverts toward its long-run level while drafting is off, and drafting resumes once
    it has reverted far enough (about a dozen plain steps), not only when the survivals go
    stale (100 steps) and a probe measures the price again."""
    g, full = 64, 64 * (K + 1)
    table = CostTable({}, {g: {g: 1.0, full: 2.0}})  # survivals stale after 100 plain steps
    step = _policy_stepper(g, 2.0, {False: 1.2, True: 1.2}, plain_ratio=1.0)
    assert all(step(False) for _ in range(1000))  # drafting pays at 1.2x the table
    dear = _policy_stepper(g, 2.0, {False: 4.0, True: 4.0}, plain_ratio=1.0, policy=step.policy)
    burst = next(i for i in range(100) if not dear(False))  # arrivals: drafting at 4x
    assert burst > 8  # (a few dear steps do not move the price enough)
    resumed = next(i for i in range(1, 300) if dear(False))  # (plain until drafting resumes)
    stale_after = DraftingPolicy(table, ONES, K).stale_after(g)
    assert stale_after == 100 and 8 < resumed < stale_after / 4, resumed


def test_after_a_first_wave_of_arrivals_drafting_resumes():
    """A fresh engine's first wave: every step admits requests, and a drafting step with
    arrivals costs ~2.1x the table (the pipeline drains into it), a steady one 1.1x. Priced
    apart, plain steps without arrivals lower the share that prices the full block, and
    drafting resumes after the wave (one price per cell would set the full block's long-run
    level at the wave's and keep drafting mostly off)."""
    step = _policy_stepper(64, 1.75, {False: 1.1, True: 2.1}, plain_ratio=1.2)
    for _ in range(40):  # the wave: every step admits
        step(arrivals=True)
    drafted = sum(step(arrivals=i % 3 == 0) for i in range(300)) / 300  # then a third do
    assert drafted > 0.9, drafted


def test_a_cell_priced_apart_mixes_its_parts_at_the_share_of_arrivals():
    """The module docstring's example: a full block steady at 1.1, with arrivals at 2.1, a
    third of the steps at its G with arrivals; a part not yet measured is the other's, and a
    full block seen only with arrivals takes its steady part from the plain cell."""
    costs = _costs(min_price_steps=1)
    plain, block = (64, 64), (64, 512)
    for i in range(300):
        arrivals = i % 3 == 0
        costs.record(block, False, 1.0, 2.1 if arrivals else 1.1, arrivals)
    assert costs.ratio(block, False) == pytest.approx(1.1 + (2.1 - 1.1) / 3, abs=0.02)
    assert "G=64 V=512 greedy arrivals" in costs.as_dict()
    wave = _costs(min_price_steps=1)
    wave.record(block, False, 1.0, 2.1, arrivals=True)
    assert wave.ratio(block, False) == pytest.approx(2.1)  # every step so far had arrivals
    for _ in range(200):
        wave.record(plain, False, 1.0, 1.2, arrivals=False)
    assert wave.ratio(plain, False) == pytest.approx(1.2)
    assert wave.ratio(block, False) == pytest.approx(1.2, abs=0.05)  # the plain cell's drift


def test_engine_records_steps_with_and_without_arrivals(tiny_vocab_dir, drafter, tmp_path):  # noqa: F811
    """The engine records both kinds of steps (twice as many prompts as seats, ending apart:
    later ones arrive while others decode), and the tokens stay the target's greedy ones."""
    probe = LLM(str(tiny_vocab_dir), speculative_config=_spec(drafter), **KW)
    cells = {g: {g: 1e-3, g * 4: 1.2e-3} for g in (1, 2, 4)}
    path = tmp_path / "t.json"
    path.write_text(CostTable(probe.engine.cost_fingerprint(), cells).to_json())
    llm = LLM(str(tiny_vocab_dir), speculative_config=_spec(drafter, cost_table=str(path)), **KW)
    prompts = PROMPTS * 2
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
              for n in (40, 12, 30, 20, 16, 36, 24, 28)]  # fmt: skip
    plain = LLM(str(tiny_vocab_dir), **KW).generate(prompts, params, use_tqdm=False)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    kinds = {name.rsplit(" ", 1)[1] for name in llm.get_metrics()["realised_cost_ratios"]}
    assert kinds == {"arrivals", "steady"}, kinds


def test_arrivals_priced_apart_keep_drafting_off_where_arrival_steps_make_it_lose():
    """The other side: at G = 256 a drafting step with arrivals costs ~2.5x the table and half
    the steps have arrivals. Drafting there loses to plain decoding, and the policy keeps it
    off (of the last 500 of 1,000 steps; the table's full / plain 2.05)."""
    step = _policy_stepper(256, 2.05, {False: 1.3, True: 2.5}, plain_ratio=1.1)
    drafted = [step(arrivals=i % 2 == 0) for i in range(1000)]
    assert sum(drafted[500:]) / 500 < 0.1


def _policy_stepper(g: int, full_price: float, draft_ratios, plain_ratio, policy=None):
    """One policy deciding for G identical rows (~2.06 drafts kept a row) over a table of
    plain 1.0 and full block `full_price`; step(arrivals) decides, feeds the survivals when it
    drafts, and records the period: the table's price times draft_ratios[arrivals] (drafting)
    or plain_ratio. Returns step, which returns whether the step drafted (step.policy: the
    policy, which another stepper may continue)."""
    full = g * (K + 1)
    table = CostTable({}, {g: {g: 1.0, full: full_price}})
    policy = policy or DraftingPolicy(table, ONES, K)
    ids = [f"r{i}" for i in range(g)]
    logits = torch.full((g, K), 0.8)

    def step(arrivals: bool) -> bool:
        decision = policy.decide(ids)
        if decision.drafting:
            policy.observe(ids, logits, [False] * g)
        ratio = draft_ratios[arrivals] if decision.drafting else plain_ratio
        policy.record_step(decision, ratio * table.cells[g][decision.cell[1]], arrivals)
        return decision.drafting

    step.policy = policy
    return step
