"""Realised step costs (policy/realised_costs.py): cells priced by the table scaled by what the
engine's steps in them took, so drafting steps dearer in a serving loop than in the profiler's
steady state stop paying where the table alone says they pay."""

from __future__ import annotations

import pytest
import torch

from dspark import LLM, SamplingParams
from dspark.policy.cost_table import CostTable
from dspark.policy.policy import Decision, DraftingPolicy
from dspark.policy.realised_costs import RealisedCosts, StepPeriods
from tests.policy.test_policy import KW, PROMPTS, _spec, drafter  # noqa: F401

K = 7


def test_worked_example_of_the_docstring():
    costs = RealisedCosts(half_life=64.0, min_steps=8)
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
    assert costs.as_dict()["G=256 V=256 greedy"] == pytest.approx(1.1)
    with pytest.raises(ValueError, match="half_life, min_steps and baseline_half_life must be > 0"):
        RealisedCosts(half_life=0)


def test_policy_stops_drafting_when_drafting_steps_realise_dearer():
    g, full = 64, 64 * (K + 1)
    table = CostTable({}, {g: {g: 1.0, full: 2.2}})
    ones = {False: torch.ones(K), True: torch.ones(K)}
    ids = [f"r{i}" for i in range(g)]
    logits = torch.full((g, K), 0.0)  # survivals 0.5, 0.25, ...: a sum of ~1 a row
    for realised in (None, RealisedCosts(min_steps=4)):
        policy = DraftingPolicy(table, ones, K, min_dwell_steps=2, realised_costs=realised)
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
        assert decision.drafting is (realised is None)


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
    spec = _spec(drafter, cost_table=str(path), realised_costs=True)
    llm = LLM(str(tiny_vocab_dir), speculative_config=spec, **KW)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = LLM(str(tiny_vocab_dir), **KW).generate(PROMPTS, params, use_tqdm=False)
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    ratios = llm.get_metrics()["realised_cost_ratios"]
    assert ratios and all(0.25 <= r <= 4.0 for r in ratios.values()), ratios
    with pytest.raises(ValueError, match='"realised_costs" must be true or false'):
        LLM(str(tiny_vocab_dir), speculative_config=_spec(drafter, realised_costs=1), **KW)
    assert llm.engine.policy.realised_costs.stale_half_life == 16  # the default
    spec = _spec(drafter, cost_table=str(path), realised_costs=True, stale_price_half_life=4)
    llm = LLM(str(tiny_vocab_dir), speculative_config=spec, **KW)
    assert llm.engine.policy.realised_costs.stale_half_life == 4
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    for bad in (-1, True, "16", 1e7):
        with pytest.raises(ValueError, match='"stale_price_half_life" must be a number of steps'):
            LLM(str(tiny_vocab_dir), speculative_config=_spec(drafter, stale_price_half_life=bad),
                **KW)  # fmt: skip


def test_a_stale_price_reverts_to_its_long_run_level():
    """stale_half_life: while a cell goes uncounted (drafting off), its recent ratio reverts
    toward its long-run one, halfway per stale_half_life steps counted elsewhere; measured
    again, it starts from the reverted value. Off (0), prices never move uncounted."""
    g, full = 64, 512
    plain, block = (g, g), (g, full)

    def history(costs):
        for _ in range(64):  # drafting at the table's price x 1.6 for a long while ...
            costs.record(block, False, 1.0, 1.6)
        for _ in range(8):  # ... then a burst of arrivals: 3.2x
            costs.record(block, False, 1.0, 3.2)
        return costs.ratio(block, False)

    frozen, reverting = RealisedCosts(), RealisedCosts(stale_half_life=16)
    spiked = history(frozen)
    assert history(reverting) == pytest.approx(spiked)  # counted every step: no reversion
    total = weight = 0.0  # the long-run ratio: the same steps, half-life 1024 steps
    for ratio in [1.6] * 64 + [3.2] * 8:
        total, weight = total * 0.5 ** (1 / 1024) + ratio, weight * 0.5 ** (1 / 1024) + 1
    long_run = total / weight
    for _ in range(16):  # drafting off: 16 plain steps counted, no full block
        frozen.record(plain, False, 1.0, 1.0)
        reverting.record(plain, False, 1.0, 1.0)
    assert frozen.ratio(block, False) == spiked  # held until the cell is measured again
    reverted = reverting.ratio(block, False)
    assert reverted == pytest.approx(long_run + (spiked - long_run) / 2)
    assert reverting.priced(g, {g: 1.0, full: 2.0}, False)[full] == pytest.approx(2 * reverted)
    # measured again at 1.6: from the reverted price, not back up to the spike
    reverting.record(block, False, 1.0, 1.6)
    assert reverting.ratio(block, False) < reverted
    frozen.record(block, False, 1.0, 1.6)
    assert frozen.ratio(block, False) > reverted
    assert reverting.ratio(plain, False) == pytest.approx(1.0)  # measured every step
    with pytest.raises(ValueError, match="stale_half_life must be >= 0"):
        RealisedCosts(stale_half_life=-1)


def test_a_spiked_price_holds_drafting_off_until_staleness_unless_it_reverts():
    """The policy after a burst of dear drafting steps (arrivals): with frozen prices drafting
    comes back only when the survivals go stale; with stale_price_half_life, once the full
    block's price has reverted far enough toward its long-run level."""
    g, full = 64, 64 * (K + 1)
    table = CostTable({}, {g: {g: 1.0, full: 2.0}})  # survivals stale after 100 plain steps
    ones = {False: torch.ones(K), True: torch.ones(K)}
    ids = [f"r{i}" for i in range(g)]
    logits = torch.full((g, K), 0.8)  # survival 0.69 a position: ~2.06 drafts a row kept

    def plain_steps_until_drafting(costs: RealisedCosts) -> int:
        policy = DraftingPolicy(table, ones, K, realised_costs=costs)

        def step(full_ratio: float) -> bool:  # a plain step costs the table's price
            decision = policy.decide(ids)
            if decision.drafting:
                policy.observe(ids, logits, [False] * g)
            ratio = full_ratio if decision.drafting else 1.0
            policy.record_step(decision, ratio * table.cells[g][decision.cell[1]])
            return decision.drafting

        assert all(step(1.2) for _ in range(1000))  # drafting pays at 1.2x the table
        burst = next(i for i in range(100) if not step(4.0))  # arrivals: drafting at 4x
        assert burst > 8  # (a few dear steps do not move the price enough)
        return next(i for i in range(1, 300) if step(4.0))  # (plain until drafting resumes)

    frozen = plain_steps_until_drafting(RealisedCosts())
    reverting = plain_steps_until_drafting(RealisedCosts(stale_half_life=16))
    assert frozen >= policy_stale_after(table) and 8 < reverting < frozen / 2, (frozen, reverting)


def policy_stale_after(table: CostTable) -> int:
    return DraftingPolicy(table, {False: torch.ones(K), True: torch.ones(K)}, K).stale_after(64)


def test_a_first_wave_of_arrivals_holds_drafting_off_unless_arrivals_are_priced_apart():
    """A fresh engine's first wave: every step admits requests, and a drafting step with
    arrivals costs ~2.1x the table (the pipeline drains into it), a steady one 1.1x. With one
    price per cell the wave sets the full block's long-run level too, so once drafting is off
    its price stays near 2.1x and drafting stays mostly off (41% of the steps after the wave
    drafted when written). With arrivals priced apart (split_arrivals), plain steps without
    arrivals lower the share that prices the full block, and drafting resumes (97%)."""

    def drafting_share(costs: RealisedCosts) -> float:
        """The share of 300 steps after a 40-step first wave that drafted (G = 64, the H100
        table's full / plain 1.75: drafting pays at 1.1x)."""
        step = _policy_stepper(64, 1.75, costs, {False: 1.1, True: 2.1}, plain_ratio=1.2)
        for _ in range(40):  # the wave: every step admits
            step(arrivals=True)
        return sum(step(arrivals=i % 3 == 0) for i in range(300)) / 300  # then a third do

    one_price = drafting_share(RealisedCosts(stale_half_life=16))
    apart = drafting_share(RealisedCosts(stale_half_life=16, split_arrivals=True))
    assert one_price < 0.6 and apart > 0.9, (one_price, apart)


def test_a_cell_priced_apart_mixes_its_parts_at_the_share_of_arrivals():
    """The module docstring's example: a full block steady at 1.1, with arrivals at 2.1, a
    third of the steps at its G with arrivals; a part not yet measured is the other's, and a
    full block seen only with arrivals takes its steady part from the plain cell."""
    costs = RealisedCosts(min_steps=1, split_arrivals=True)
    plain, block = (64, 64), (64, 512)
    for i in range(300):
        arrivals = i % 3 == 0
        costs.record(block, False, 1.0, 2.1 if arrivals else 1.1, arrivals)
    assert costs.ratio(block, False) == pytest.approx(1.1 + (2.1 - 1.1) / 3, abs=0.02)
    assert "G=64 V=512 greedy arrivals" in costs.as_dict()
    wave = RealisedCosts(min_steps=1, split_arrivals=True)
    wave.record(block, False, 1.0, 2.1, arrivals=True)
    assert wave.ratio(block, False) == pytest.approx(2.1)  # every step so far had arrivals
    for _ in range(200):
        wave.record(plain, False, 1.0, 1.2, arrivals=False)
    assert wave.ratio(plain, False) == pytest.approx(1.2)
    assert wave.ratio(block, False) == pytest.approx(1.2, abs=0.05)  # the plain cell's drift


def test_arrival_costs_is_a_key_of_speculative_config(tiny_vocab_dir, drafter, tmp_path):  # noqa: F811
    """ "arrival_costs" reaches the engine's realised costs (on by default; false keeps one
    price per cell); the engine records both kinds of steps (twice as many prompts as seats,
    ending apart: later ones arrive while others decode), and the tokens stay the target's
    greedy ones."""
    probe = LLM(str(tiny_vocab_dir), speculative_config=_spec(drafter), **KW)
    assert probe.engine.config.spec().arrival_costs is True  # the default
    cells = {g: {g: 1e-3, g * 4: 1.2e-3} for g in (1, 2, 4)}
    path = tmp_path / "t.json"
    path.write_text(CostTable(probe.engine.cost_fingerprint(), cells).to_json())
    spec = _spec(drafter, cost_table=str(path), realised_costs=True)
    off = LLM(str(tiny_vocab_dir), speculative_config={**spec, "arrival_costs": False}, **KW)
    assert off.engine.policy.realised_costs.split_arrivals is False
    llm = LLM(str(tiny_vocab_dir), speculative_config=spec, **KW)
    assert llm.engine.policy.realised_costs.split_arrivals is True
    prompts = PROMPTS * 2
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
              for n in (40, 12, 30, 20, 16, 36, 24, 28)]  # fmt: skip
    plain = LLM(str(tiny_vocab_dir), **KW).generate(prompts, params, use_tqdm=False)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    kinds = {name.rsplit(" ", 1)[1] for name in llm.get_metrics()["realised_cost_ratios"]}
    assert kinds == {"arrivals", "steady"}, kinds
    with pytest.raises(ValueError, match='"arrival_costs" must be true or false'):
        LLM(str(tiny_vocab_dir), speculative_config=_spec(drafter, arrival_costs=1), **KW)


def test_arrivals_priced_apart_still_keep_drafting_off_where_arrival_steps_make_it_lose():
    """The other side: at G = 256 a drafting step with arrivals costs ~2.5x the table (the
    thirty-third look: 2-3x) and half the steps have arrivals. Drafting there loses to plain
    decoding, and priced apart the policy keeps it off as much as with one price per cell."""

    def drafting_share(costs: RealisedCosts) -> float:
        """The share of the last 500 of 1,000 steps that drafted (G = 256, the H100 table's
        full / plain 2.05)."""
        step = _policy_stepper(256, 2.05, costs, {False: 1.3, True: 2.5}, plain_ratio=1.1)
        drafted = [step(arrivals=i % 2 == 0) for i in range(1000)]
        return sum(drafted[500:]) / 500

    one_price = drafting_share(RealisedCosts(stale_half_life=16))
    apart = drafting_share(RealisedCosts(stale_half_life=16, split_arrivals=True))
    assert one_price < 0.1 and apart < 0.1, (one_price, apart)


def _policy_stepper(g: int, full_price: float, costs: RealisedCosts, draft_ratios, plain_ratio):
    """One policy deciding for G identical rows (~2.06 drafts kept a row) over a table of
    plain 1.0 and full block `full_price`; step(arrivals) decides, feeds the survivals when it
    drafts, and records the period: the table's price times draft_ratios[arrivals] (drafting)
    or plain_ratio. Returns step, which returns whether the step drafted."""
    full = g * (K + 1)
    table = CostTable({}, {g: {g: 1.0, full: full_price}})
    policy = DraftingPolicy(table, {False: torch.ones(K), True: torch.ones(K)}, K,
                            realised_costs=costs)  # fmt: skip
    ids = [f"r{i}" for i in range(g)]
    logits = torch.full((g, K), 0.8)

    def step(arrivals: bool) -> bool:
        decision = policy.decide(ids)
        if decision.drafting:
            policy.observe(ids, logits, [False] * g)
        ratio = draft_ratios[arrivals] if decision.drafting else plain_ratio
        policy.record_step(decision, ratio * table.cells[g][decision.cell[1]], arrivals)
        return decision.drafting

    return step
