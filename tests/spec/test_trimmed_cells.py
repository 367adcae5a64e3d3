"""Trimmed cells (G, V): verify lengths chosen on the device from fresh survivals under the
cell's budget, the full-width windows compacted in place (spec/ragged.py), end to end through
the engine on the CPU: greedy output equals plain decoding, sampled output keeps the target's
distribution, and the profiler measures the cells."""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch

from dspark import LLM, SamplingParams
from dspark.benchmarks.profile import format_table, profile_cost_table
from dspark.policy.cost_table import CostTable, check_table, full_block_tokens
from dspark.policy.survival import survival
from dspark.spec.ragged import FullWidthWindows, compact_windows
from dspark.spec.selector import select_verify_lengths
from dspark.step_plan import PAD_SLOT, PAD_TOKEN_ID, SCRATCH_PAGE
from tests.helpers import assert_matches_distribution
from tests.policy.helpers import by_table
from tests.spec.eager_replay import EagerReplay
from tests.spec.test_spec_engine import PROMPTS12, _exact_pair_distribution
from tests.tiny_models import make_tiny_drafter

K = 3  # verified of the tiny drafter's 4


def test_compact_windows_worked_example():
    """spec/ragged.py's docstring: K = 3 (width 4), rows a0 and a1 live, row 2 a pad row."""
    w = 4
    ids = torch.tensor([10, 11, 12, 13, 20, 21, 22, 23, PAD_TOKEN_ID, 0, 0, 0])
    positions = torch.tensor([9, 10, 11, 12, 4, 5, 6, 7, 0, 1, 2, 3])
    slots = torch.tensor([109, 110, 111, 112, 204, 205, 206, 207] + [PAD_SLOT] * 4)
    cu = torch.tensor([0, 4, 8, 12], dtype=torch.int32)
    seq_lens = torch.tensor([13, 8, 4], dtype=torch.int32)
    logits = torch.tensor([[0.9, 0.8, 0.1], [0.7, 0.6, 0.5], [5.0, 5.0, 5.0]]).logit()
    # calibrated survival = cumprod(sigmoid(logit / T)); T = 1, and c so that a is as shown
    confidence = torch.stack([logits[:, 0], *(
        (logits[:, j].sigmoid() / logits[:, j - 1].sigmoid()).logit() for j in (1, 2)
    )], dim=1)  # fmt: skip
    a = survival(confidence, torch.ones(3))
    verify_len = select_verify_lengths(a, 4, torch.tensor([3, 3, 0]))
    assert verify_len.tolist() == [2, 2, 0]
    windows = FullWidthWindows(ids, positions, slots, cu, seq_lens, w)
    new_cu = compact_windows(windows, verify_len, 7)
    assert new_cu.tolist() == cu.tolist() == [0, 3, 6, 7]
    assert ids[:7].tolist() == [10, 11, 12, 20, 21, 22, PAD_TOKEN_ID]
    assert positions[:7].tolist() == [9, 10, 11, 4, 5, 6, 0]
    assert slots[:7].tolist() == [109, 110, 111, 204, 205, 206, PAD_SLOT]
    assert seq_lens.tolist() == [12, 7, 1]


def test_tokens_past_the_last_window_go_to_the_scratch_page():
    """Fewer candidates than the budget (capture on pad windows): the leftover tokens belong
    to no row and write the scratch page."""
    ids, pos = torch.arange(8), torch.arange(8)
    slots = torch.arange(100, 108)
    windows = FullWidthWindows(ids, pos, slots, torch.tensor([0, 4, 8]), torch.tensor([4, 4]), 4)
    cu = compact_windows(windows, torch.tensor([1, 0]), 5)  # 3 tokens in windows, V = 5
    assert cu.tolist() == [0, 2, 3]
    assert slots[:5].tolist() == [100, 101, 104, PAD_SLOT, PAD_SLOT]
    assert SCRATCH_PAGE == 0 and PAD_SLOT == SCRATCH_PAGE


# ---- the engine -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def drafter(tiny_vocab_dir, tmp_path_factory):
    return make_tiny_drafter(tiny_vocab_dir, tmp_path_factory.mktemp("drafter_t"), taps=(0,))


KW = dict(dtype="float32", device="cpu", num_kv_pages=256, max_num_seqs=4, max_model_len=64,
          async_scheduling=False)  # fmt: skip
LADDER = (1, 2, 4)


def _spec(drafter, **extra):
    return {"model": str(drafter), "num_speculative_tokens": K, "trimmed_widths": [2, 3],
            **extra}  # fmt: skip


def _trimming_table(fingerprint: dict, sizes=LADDER, cheapest: int = 2) -> CostTable:
    """Plain and the full block far dearer than the trimmed cells: the policy always drafts
    and picks a trimmed cell (w = `cheapest` the cheapest per token)."""
    price = {2: 0.1, 3: 0.2} if cheapest == 2 else {2: 0.2, 3: 0.1}
    cells = {g: {g: 1.0, 2 * g: price[2], 3 * g: price[3], full_block_tokens(g, K): 1.0}
             for g in sizes}  # fmt: skip
    return CostTable(fingerprint, cells, cells)


def _llm(tiny_vocab_dir, drafter, tmp_path, padded: bool, cheapest: int = 2, **kw):
    """An engine whose policy trims every drafting step: eager (the live rows, budget D of the
    cell), or padded to the ladder as captured cells replay (EagerReplay)."""
    probe = LLM(str(tiny_vocab_dir), speculative_config=_spec(drafter), **{**KW, **kw})
    path = tmp_path / f"trim_{padded}.json"
    sizes = [1 << i for i in range((kw.get("max_num_seqs", 4)).bit_length())]
    table = _trimming_table(probe.engine.cost_fingerprint(), sizes, cheapest)
    path.write_text(table.to_json())
    spec = _spec(drafter, cost_table=str(path))
    llm = by_table(LLM(str(tiny_vocab_dir), speculative_config=spec, **{**KW, **kw}))
    spec_runner = llm.engine.runner.spec_runner
    spec_runner.uniform_windows = True  # (what graphs turn on: trimmed cells need full width)
    if padded:
        trimmed = {g: (2 * g, 3 * g) for g in sizes}
        spec_runner.graphs = EagerReplay(spec_runner, list(sizes), trimmed=trimmed)
    return llm


@pytest.mark.parametrize("padded,ahead", [(False, False), (True, False), (True, True)])
def test_trimmed_cells_greedy_equal_plain(tiny_vocab_dir, drafter, tmp_path, padded, ahead):
    """Rows verifying 0..K drafts side by side, windows shortened near max_tokens, an opted-out
    request, a batch that shrinks as requests end and sizes between the ladder's; `ahead`:
    drafting steps launched behind the previous one, their anchors written on the device into
    the full-width inputs the trimmed cell then compacts."""
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, use_speculation=(i != 3))
        for i, n in enumerate([20, 13, 31, 17, 9])
    ]
    plain = LLM(str(tiny_vocab_dir), **KW).generate(PROMPTS12, params, use_tqdm=False)
    llm = _llm(tiny_vocab_dir, drafter, tmp_path, padded, async_scheduling=ahead)
    got = llm.generate(PROMPTS12, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    m = llm.get_metrics()
    if ahead:
        assert m["async_spec_steps"]["continuation_windows"] > 0, m["async_spec_steps"]
    stats = llm.engine.runner.stats
    trimmed = stats["spec_graph_steps_trimmed" if padded else "spec_steps_trimmed_eager"]
    assert trimmed > 0, dict(stats)
    assert m["drafting_policy"]["decision_trimmed"] > 0
    counts = m["verify_len_counts"]  # rows verified 0 and K drafts in trimmed steps
    assert counts[0] > 0 and counts[K] > 0, counts
    assert m["num_verified_tokens"] < (K + 1) * sum(counts)
    if padded:
        replayed = llm.engine.runner.spec_runner.graphs.replayed
        assert {(g, v) for g, _, v in replayed if v} >= {(4, 8)}
    e = llm.engine
    assert e.allocator.num_free == e.allocator.num_usable


@pytest.mark.parametrize("padded", [False, True], ids=["eager", "padded"])
def test_trimmed_cell_below_its_budget_verifies_every_candidate(tiny_vocab_dir, drafter,
                                                                 tmp_path, padded):  # fmt: skip
    """The widest cell (D = 2 G drafts) over three live rows of G = 4, windows shortened near
    max_tokens: the caps hold fewer candidates than D, and the cell runs all the same (every
    candidate verified, counted), not the full block."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (7, 10, 13)]
    plain = LLM(str(tiny_vocab_dir), **KW).generate(PROMPTS12[:3], params, use_tqdm=False)
    llm = _llm(tiny_vocab_dir, drafter, tmp_path, padded, cheapest=3)
    got = llm.generate(PROMPTS12[:3], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    stats = llm.engine.runner.stats
    assert stats["spec_steps_trimmed_below_budget"] > 0, dict(stats)
    assert not any(key.startswith("trimmed_fallback") for key in stats), dict(stats)
    if padded:  # (G = 4, V = 12: D = 8 over at most 3 x 3 candidates)
        assert (4, 12) in {(g, v) for g, _, v in llm.engine.runner.spec_runner.graphs.replayed}
    e = llm.engine
    assert e.allocator.num_free == e.allocator.num_usable


@pytest.mark.parametrize("padded", [False, True], ids=["eager", "padded"])
def test_a_trimmed_cell_drafts_only_its_reach(tiny_vocab_dir, drafter, tmp_path, padded):
    """The cell (G, 2 G) at K = 3 reaches 2 drafts a row (policy/cells.py cell_reach): its
    drafter's heads run over 2 slots, no window of it verifies a third, its confidences are
    not the policy's evidence (they stop at the reach), and greedy output equals plain."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 16, 21)]
    plain = LLM(str(tiny_vocab_dir), **KW).generate(PROMPTS12[:3], params, use_tqdm=False)
    llm = _llm(tiny_vocab_dir, drafter, tmp_path, padded, cheapest=2)
    spec = llm.engine.runner.spec_runner.spec
    drafted, verified, draft, trim = [], [], spec.draft, spec.trim

    def recording_draft(*args):  # (num_rows, st, input_ids, block_table, shaping, reach)
        block = draft(*args)
        drafted.append((args[5], block.tokens.shape[1]))
        return block

    def recording_trim(*args):
        verify_len, cu = trim(*args)
        verified.append(verify_len.clone())
        return verify_len, cu

    spec.draft, spec.trim = recording_draft, recording_trim
    policy, observed = llm.engine.policy, []  # the shapes the policy's sink is given
    observe = policy.observe_survivals

    def recording_observe(ids, a, *rest):
        observed.append(a.shape)
        observe(ids, a, *rest)

    policy.observe_survivals = recording_observe
    got = llm.generate(PROMPTS12[:3], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    assert (2, 2) in drafted and all(width == min(reach or K, K) for reach, width in drafted)
    assert verified and all(int(v.max()) <= 2 for v in verified)
    assert all(shape[1] == K for shape in observed)
    assert sum(r is None for r, _ in drafted) == len(observed)  # (the full blocks only)


def test_stats_line_names_the_trimmed_cell(tiny_vocab_dir, drafter, tmp_path, caplog):
    llm = _llm(tiny_vocab_dir, drafter, tmp_path, padded=False, log_stats_interval_s=1e-9)
    with caplog.at_level(logging.INFO, logger="dspark.engine.stats"):
        llm.generate(PROMPTS12[:4], SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)
    lines = [r.getMessage() for r in caplog.records if r.name == "dspark.engine.stats"]
    assert any(re.search(r"drafting on, trimmed cell G=4 V=8$", line) for line in lines), lines


def test_trimmed_cells_fall_back_to_the_full_block_with_reasons(tiny_vocab_dir, drafter, tmp_path):
    """Logprobs need the host's window lengths: such steps verify the full block, counted."""
    llm = _llm(tiny_vocab_dir, drafter, tmp_path, padded=False)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    llm.generate(PROMPTS12[:3], params, use_tqdm=False)
    stats = llm.engine.runner.stats
    assert stats["trimmed_fallback_logprobs"] > 0 and not stats["spec_steps_trimmed_eager"]


@pytest.mark.parametrize("temperature,top_p,ahead", [(1.0, 1.0, False), (0.8, 0.9, False),
                                                     (1.0, 1.0, True)])  # fmt: skip
def test_trimmed_sampled_speculation_keeps_the_target_distribution(
    tiny_vocab_dir, drafter, tmp_path, temperature, top_p, ahead
):
    """Tokens 2 and 3 of 3,000 seeded requests (token 1 from the prefill; then windows of up to
    2 drafts, of which the trimmed cell verifies half: D = G = R drafts for 2 R candidates):
    their joint is the target's."""
    n, prompt = 3000, [2, 3, 4]
    llm = _llm(tiny_vocab_dir, drafter, tmp_path, padded=True, max_num_seqs=64,
               num_kv_pages=1024, async_scheduling=ahead)  # fmt: skip
    params = [SamplingParams(temperature=temperature, top_p=top_p, seed=s, max_tokens=4,
                             ignore_eos=True) for s in range(n)]  # fmt: skip
    outs = [o.outputs[0].token_ids for o in llm.generate([prompt] * n, params, use_tqdm=False)]
    m = llm.get_metrics()
    assert llm.engine.runner.stats["spec_graph_steps_trimmed"] > 0
    assert m["verify_len_counts"][1] > 0 and m["num_accepted_tokens"] > 0, m
    pairs = torch.tensor([o[1] * 12 + o[2] for o in outs])
    counts = torch.bincount(pairs, minlength=144).float()
    expected = _exact_pair_distribution(llm.engine.model, prompt, temperature, top_p) * n
    assert_matches_distribution(counts, expected)


def test_profile_measures_the_trimmed_cells(tiny_vocab_dir, drafter):
    kw = {**KW, "max_model_len": 512}
    llm = LLM(str(tiny_vocab_dir), speculative_config=_spec(drafter), **kw)
    with pytest.raises(RuntimeError, match="G=2 V=4 did not run as one .*not_all_windows"):
        profile_cost_table(llm, [2], steps=5, warmup=1, prompt_len=8, rounds=1)
    llm = LLM(str(tiny_vocab_dir), speculative_config=_spec(drafter), **kw)
    llm.engine.runner.spec_runner.uniform_windows = True  # (as with graphs)
    table = profile_cost_table(llm, [2], steps=5, warmup=1, prompt_len=8, rounds=1)
    assert set(table.cells[2]) == {2, 4, 6, 8} == set(table.sampled_cells[2])
    assert table.fingerprint["trimmed_widths"] == [2, 3]
    assert check_table(table, llm.engine.cost_fingerprint()) is None
    assert "w=2" in format_table(table, K) and "w=3" in format_table(table, K)
    assert llm.engine.runner.stats["spec_steps_trimmed_eager"] > 0
    assert llm.engine.scheduler.trimmed_cell is None


# ---- the configuration ------------------------------------------------------------------------
# (the table's and the policy's side of trimmed cells: tests/policy/)


def test_trimmed_widths_configuration_errors(tiny_vocab_dir, drafter):
    kw = dict(dtype="float32", device="cpu", num_kv_pages=16)
    with pytest.raises(ValueError, match='trimmed_widths" must be a list of integers >= 2'):
        LLM(str(tiny_vocab_dir), speculative_config=_spec(drafter, trimmed_widths=[1]), **kw)
    with pytest.raises(ValueError, match=r"trimmed_widths \[4\] exceed num_speculative_tokens 3"):
        LLM(str(tiny_vocab_dir), speculative_config=_spec(drafter, trimmed_widths=[2, 4]), **kw)
    spec = json.loads(json.dumps(_spec(drafter)))
    llm = LLM(str(tiny_vocab_dir), speculative_config=spec, **kw)
    assert llm.engine.cost_fingerprint()["trimmed_widths"] == [2, 3]


# ---- the GPU: captured trimmed cells ---------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_captured_trimmed_cells_equal_the_eager_step(
    tiny_vocab_dir, drafter, tmp_path, temperature
):
    """The same trimming policy three ways on the GPU: each captured step run eagerly on the
    same padded buffers (EagerReplay: the same shapes, so the same bits), captured cells
    replayed (synchronous drafting steps), and replayed with drafting steps launched ahead: the
    same tokens. (Eager steps of unpadded batches draft in other shapes: their confidences
    differ in the last bits, which may move a near-tie of the selection, so they are not
    compared bit for bit.)"""
    kw = dict(dtype="float32", device="cuda", num_kv_pages=256, max_num_seqs=8, max_model_len=128)
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=n, ignore_eos=True)
              for i, n in enumerate([40, 33, 51, 37, 29])]  # fmt: skip
    probe = LLM(str(tiny_vocab_dir), speculative_config=_spec(drafter), **kw)
    path = tmp_path / "trim_gpu.json"
    sizes = probe.engine.runner.spec_runner.graphs.sizes
    path.write_text(_trimming_table(probe.engine.cost_fingerprint(), sizes).to_json())
    runs = {}
    for name, ahead in (("eager", False), ("graphs", False), ("ahead", True)):
        spec = _spec(drafter, cost_table=str(path))
        llm = by_table(LLM(str(tiny_vocab_dir), async_scheduling=ahead, speculative_config=spec,
                           **kw))  # fmt: skip
        spec_runner = llm.engine.runner.spec_runner
        if name == "eager":
            graphs = spec_runner.graphs
            spec_runner.graphs = EagerReplay(spec_runner, graphs.sizes, graphs.tails,
                                             graphs.trimmed)  # fmt: skip
        outs = llm.generate(PROMPTS12, params, use_tqdm=False)
        runs[name] = [o.outputs[0].token_ids for o in outs]
        assert llm.engine.runner.stats["spec_graph_steps_trimmed"] > 0, dict(spec_runner.stats)
    assert runs["graphs"] == runs["eager"] == runs["ahead"]


@pytest.mark.gpu
def test_engines_built_after_others_were_freed_capture_and_replay_the_same(
    tiny_vocab_dir, drafter, tmp_path
):
    """Several engines in one process, each built after the last one's graphs were freed (a
    benchmark's arms, a notebook's second LLM): every capture succeeds and every engine makes
    the same tokens. With every engine capturing on torch.cuda.graph's one default stream, the
    later captures failed with CUBLAS_STATUS_EXECUTION_FAILED in 7 of 8 processes on the H200
    (the cuBLAS workspace of that stream belonged to a freed graph: cuda_graph.capture_stream)."""
    import gc

    kw = dict(dtype="float32", device="cuda", num_kv_pages=256, max_num_seqs=8, max_model_len=128)
    probe = LLM(str(tiny_vocab_dir), speculative_config=_spec(drafter), **kw)
    path = tmp_path / "trim_gpu.json"
    sizes = probe.engine.runner.spec_runner.graphs.sizes
    path.write_text(_trimming_table(probe.engine.cost_fingerprint(), sizes).to_json())
    del probe
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=n, ignore_eos=True)
              for i, n in enumerate([40, 33, 51, 37, 29])]  # fmt: skip
    runs = []
    for _ in range(4):
        spec = _spec(drafter, cost_table=str(path))
        llm = by_table(LLM(str(tiny_vocab_dir), speculative_config=spec, **kw))
        runs.append([o.outputs[0].token_ids for o in llm.generate(PROMPTS12, params,
                                                                  use_tqdm=False)])  # fmt: skip
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert all(run == runs[0] for run in runs)
