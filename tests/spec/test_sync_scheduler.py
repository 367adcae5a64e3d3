"""The synchronous scheduler ("scheduler": "sync"): Algorithm 1 on the host picks each row's
verify length from the step's own survivals, priced by the cost table's cells as a staircase
(policy/planner.py, runner/spec_runner.py), and the windows are compacted to those lengths. On the
CPU: greedy output equals plain decoding, sampled output keeps the target's distribution."""

from __future__ import annotations

import pytest
import torch

from dspark import LLM, SamplingParams
from dspark.policy.cost_table import CostTable
from dspark.runner.chosen_lengths import staircase
from tests.helpers import assert_matches_distribution
from tests.spec.test_spec_engine import PROMPTS12, _exact_pair_distribution
from tests.tiny_models import make_tiny_drafter

K = 3


@pytest.fixture(scope="module")
def drafter(tiny_vocab_dir, tmp_path_factory):
    return make_tiny_drafter(tiny_vocab_dir, tmp_path_factory.mktemp("drafter_s"), taps=(0,))


KW = dict(dtype="float32", device="cpu", num_kv_pages=256, max_num_seqs=4, max_model_len=64)


def _spec(drafter, **extra):
    return {"model": str(drafter), "num_speculative_tokens": K, "scheduler": "sync",
            "trimmed_widths": [2, 3], "realised_costs": False, **extra}  # fmt: skip


def _llm(tiny_vocab_dir, drafter, tmp_path, **kw):
    """Plain steps dear, every drafting cell cheap and rising by 5% a stair: the policy always
    drafts, and Algorithm 1 stops where a stair costs more than its survivals add."""
    kw = {**KW, **kw}
    probe = LLM(str(tiny_vocab_dir), speculative_config=_spec(drafter), **kw)
    sizes = [1 << i for i in range(kw["max_num_seqs"].bit_length())]
    cells = {g: {g: 2.0, 2 * g: 1.0, 3 * g: 1.05, 4 * g: 1.1} for g in sizes}
    path = tmp_path / "sync.json"
    path.write_text(CostTable(probe.engine.cost_fingerprint(), cells, cells).to_json())
    return LLM(str(tiny_vocab_dir), speculative_config=_spec(drafter, cost_table=str(path)),
               **kw)  # fmt: skip


def test_staircase_worked_example():
    step_time = staircase({4: 1.0, 8: 1.2, 16: 2.0}, 4 - 3)
    assert [step_time(b) for b in (3, 5, 14, 16)] == [1.0, 1.2, 2.0, None]


def test_sync_scheduler_greedy_equals_plain(tiny_vocab_dir, drafter, tmp_path):
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, use_speculation=(i != 3))
        for i, n in enumerate([20, 13, 31, 17, 9])
    ]
    plain = LLM(str(tiny_vocab_dir), **KW).generate(PROMPTS12, params, use_tqdm=False)
    llm = _llm(tiny_vocab_dir, drafter, tmp_path)
    got = llm.generate(PROMPTS12, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    stats, m = llm.engine.runner.stats, llm.get_metrics()
    assert stats["sync_plans"] > 0 and not stats["sync_plans_unpriced"], dict(stats)
    assert stats["sync_drafts_trimmed"] > 0, dict(stats)  # fewer than the windows allowed
    assert m["num_draft_tokens"] > 0
    e = llm.engine
    assert e.allocator.num_free == e.allocator.num_usable


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.8, 0.9)])
def test_sync_scheduler_keeps_the_target_distribution(
    tiny_vocab_dir, drafter, tmp_path, temperature, top_p
):
    """Tokens 2 and 3 of 3,000 seeded requests: windows of up to 2 drafts, whose verify
    lengths Algorithm 1 chooses from the block's own survivals."""
    n, prompt = 3000, [2, 3, 4]
    llm = _llm(tiny_vocab_dir, drafter, tmp_path, max_num_seqs=64, num_kv_pages=1024)
    params = [SamplingParams(temperature=temperature, top_p=top_p, seed=s, max_tokens=4,
                             ignore_eos=True) for s in range(n)]  # fmt: skip
    outs = [o.outputs[0].token_ids for o in llm.generate([prompt] * n, params, use_tqdm=False)]
    stats = llm.engine.runner.stats
    assert stats["sync_plans"] > 0 and stats["sync_drafts_trimmed"] > 0, dict(stats)
    assert llm.get_metrics()["num_accepted_tokens"] > 0
    pairs = torch.tensor([o[1] * 12 + o[2] for o in outs])
    counts = torch.bincount(pairs, minlength=144).float()
    expected = _exact_pair_distribution(llm.engine.model, prompt, temperature, top_p) * n
    assert_matches_distribution(counts, expected)


def test_scheduler_configuration_errors(tiny_vocab_dir, drafter):
    with pytest.raises(ValueError, match="\"scheduler\" must be one of \\['lagged', 'sync'\\]"):
        LLM(str(tiny_vocab_dir), speculative_config=_spec(drafter, scheduler="greedy"), **KW)


def test_sync_scheduler_without_a_table_verifies_the_full_windows(tiny_vocab_dir, drafter):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = LLM(str(tiny_vocab_dir), **KW).generate(PROMPTS12, params, use_tqdm=False)
    llm = LLM(str(tiny_vocab_dir), speculative_config=_spec(drafter), **KW)
    got = llm.generate(PROMPTS12, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    stats = llm.engine.runner.stats
    assert stats["sync_plans_unpriced"] > 0 and not stats["sync_plans"], dict(stats)
